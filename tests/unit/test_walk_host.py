"""The host walk (spec/walk_host.py) against the vectorised walk it stands in for on the
CPU (spec/accept.py `walk_greedy`, torch ops): the same paths and tokens over random trees
with repeated tokens among siblings, invalid padding nodes and ragged sizes."""
from __future__ import annotations

import random

import pytest
import torch

from specserve import kernels
from specserve.spec.accept import _parse_walk, walk_greedy
from specserve.spec.drafts import Drafts
from specserve.spec.walk_host import walk_host


def _trees(rng: random.Random, batch: int, vocab: int) -> Drafts:
    tokens, parents = [], []
    for _ in range(batch):
        n = rng.randint(1, 12)
        parents.append([-1] + [rng.randrange(i) for i in range(1, n)])
        tokens.append([rng.randrange(vocab) for _ in range(n)])  # siblings may repeat a token
    return Drafts.from_lists(tokens, parents)


@pytest.mark.parametrize("fused", [False, True])
def test_the_host_walk_equals_the_vectorised_one(fused):
    """With the fused kernels on (the GPU's path for trees drafted on the host, here under
    Triton's interpreter; on a GPU machine, the logits on the GPU as the engine has them)
    the host walk takes its targets from kernels/argmax.py."""
    device = "cuda" if fused and torch.cuda.is_available() else "cpu"
    rng = random.Random(0)
    walked = 0
    with kernels.fused_kernels(fused):
        for seed in range(40 if fused else 200):
            drafts = _trees(rng, rng.randint(1, 4), vocab=3)  # a small vocabulary: many hits
            logits = torch.randn(drafts.batch_size, drafts.num_nodes, 3, generator=torch.Generator().manual_seed(seed))
            with kernels.fused_kernels(False):
                want = _parse_walk(walk_greedy(drafts, logits, None)[0].tolist(), drafts.num_nodes)
            assert walk_host(drafts, logits.to(device)) == want
            walked += sum(len(p) > 1 for p in want[0])
    assert walked > (20 if fused else 100)  # most trees accepted some drafts: the rule was exercised
