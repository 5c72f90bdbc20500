"""The torch reference backend: tree masks and ragged batches against plain causal runs."""
from __future__ import annotations

import torch

from specserve.core.forward_batch import ForwardMode
from specserve.models.loader import load_model
from tests.unit.model_utils import BareRunner, save_tiny_hf


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """[N, N] bool: node i sees itself and its ancestors (node 0 is the root)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_tree_verify_equals_each_branch_run_causally(tmp_path):
    model = load_model(save_tiny_hf("llama", tmp_path / "m"), torch.float32, torch.device("cpu"))
    prefix = list(range(10, 30))
    # root=5; children 6,7 of root; 8 child of 6; 9 child of 8; 11 child of 7
    tokens = [5, 6, 7, 8, 9, 11]
    parents = [-1, 0, 0, 1, 3, 2]
    depth = [0, 1, 1, 2, 3, 2]
    r = BareRunner(model)
    r.forward([0], [0], [prefix])
    tree = r.forward([0], [len(prefix)], [tokens], positions=[[len(prefix) + d for d in depth]],
                     masks=[_tree_mask(parents)], mode=ForwardMode.VERIFY)
    for leaf in (4, 5):  # the two root-to-leaf paths
        path, j = [], leaf
        while j != -1:
            path.append(j)
            j = parents[j]
        path.reverse()
        ref = BareRunner(model).forward([0], [0], [prefix + [tokens[i] for i in path]])[len(prefix):]
        torch.testing.assert_close(tree[path], ref, rtol=1e-5, atol=1e-5)


def test_batched_decode_with_ragged_lengths(tmp_path):
    model = load_model(save_tiny_hf("qwen3", tmp_path / "m"), torch.float32, torch.device("cpu"))
    seqs = [list(range(3, 3 + n)) for n in (5, 17, 9)]
    r = BareRunner(model)
    r.forward([0, 1, 2], [0, 0, 0], [s[:-1] for s in seqs])
    step = r.forward([0, 1, 2], [len(s) - 1 for s in seqs], [[s[-1]] for s in seqs], mode=ForwardMode.DECODE)
    for b, s in enumerate(seqs):
        ref = BareRunner(model).forward([0], [0], [s])[-1]
        torch.testing.assert_close(step[b], ref, rtol=1e-5, atol=1e-5)


def test_one_requests_metadata_is_the_batch_paths():
    """`_one_meta` (a batch of one, few ops) builds what `_batch_meta` builds, tensor for
    tensor: a decode, a one-token and a causal extend, and a verify with a tree mask."""
    from specserve.attention.torch_ref import TorchRefBackend
    from specserve.cache.req_table import ReqToTokenTable
    from specserve.core.forward_batch import ForwardBatch

    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    table.write(2, 0, torch.arange(100, 140))
    cases = [(ForwardMode.DECODE, 30, 1, None), (ForwardMode.EXTEND, 0, 1, None), (ForwardMode.EXTEND, 0, 12, None),
             (ForwardMode.EXTEND, 9, 7, None), (ForwardMode.VERIFY, 20, 6, [_tree_mask([-1, 0, 0, 1, 3, 2])])]
    for mode, prefix, n, masks in cases:
        fb = ForwardBatch(mode, torch.arange(n), torch.arange(prefix, prefix + n), torch.arange(n), torch.tensor([2]),
                          [prefix], [n], table.table, None, TorchRefBackend(), custom_masks=masks)
        fb.settle_prefix()
        one, batch = TorchRefBackend._one_meta(fb), TorchRefBackend()._batch_meta(fb)
        for a, b in zip((one.kv_index, one.q_index, one.q_valid, one.mask), (batch.kv_index, batch.q_index,
                                                                             batch.q_valid, batch.mask), strict=True):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), (mode, prefix, n)
