"""Logits processors per tree node (runner/logits_process.py) and grammar matchers.

The contract that makes speculation lossless under processors: a tree node's row is
processed exactly as plain decoding would process the one row after the node's path
(prompt + output + the path's draft tokens). Each test builds that plain reference
node by node and compares; a planted off-by-one in the path counts must fail it.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from specserve.core.request import Req
from specserve.core.sampling_params import Constraint, SamplingParams
from specserve.grammar.compiler import GrammarCompiler, GrammarError
from specserve.runner import logits_process
from specserve.runner.logits_process import TreePaths, process, process_rows
from specserve.spec.drafts import Drafts

V = 64


def _req(params: SamplingParams, prompt: list[int], output: list[int]) -> Req:
    req = Req("r", prompt, params, 0, None, None)
    req.output_ids = list(output)
    return req


def _tree(root: int, seed: int, n: int = 9) -> Drafts:
    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [root] + [rng.randrange(8) for _ in range(1, n)]  # few distinct tokens: repeats on paths
    return Drafts.from_lists([tokens], [parents])


def _paths(drafts: Drafts) -> list[list[int]]:
    """Each node's draft tokens below the root, root-first."""
    tokens, parents = drafts.tokens[0].tolist(), drafts.parents[0].tolist()
    out = []
    for i in range(len(tokens)):
        path, node = [], i
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        out.append(path[::-1])
    return out


def _tree_paths(d: Drafts) -> TreePaths:
    return TreePaths.of(d.tokens, d.parents, d.valid, d.tree_mask())


def _plain_reference(logits: torch.Tensor, req: Req, paths: list[list[int]]) -> torch.Tensor:
    rows = []
    for i, path in enumerate(paths):
        node_req = _req(req.params, req.prompt_ids, req.output_ids + path)
        node_req.grammar = req.grammar
        rows.append(process_rows(logits[0, i][None], [node_req])[0])
    return torch.stack(rows)[None]


PENALTIES = [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.4),
    SamplingParams(repetition_penalty=1.6),
    SamplingParams(frequency_penalty=0.3, presence_penalty=0.5, repetition_penalty=0.7, logit_bias={3: 5.0, 9: -100}),
]


@pytest.mark.parametrize("params", PENALTIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_node_is_penalized_by_its_own_path(params, seed):
    torch.manual_seed(seed)
    req = _req(params, prompt=[5, 6, 11], output=[1, 2, 2, 7])
    drafts = _tree(root=7, seed=seed)
    logits = torch.randn(1, drafts.num_nodes, V) * 3
    got = process(logits, [req], _tree_paths(drafts))
    paths = _paths(drafts)
    torch.testing.assert_close(got, _plain_reference(logits, req, paths), rtol=0, atol=1e-6)
    # the comparison sees an off-by-one: counting a node's ancestors without the node itself
    shifted = _plain_reference(logits, req, [p[:-1] for p in paths])
    assert not torch.allclose(got, shifted)


def test_a_planted_off_by_one_in_the_path_counts_fails(monkeypatch):
    """Drop the node itself from its path (anc without the diagonal): the check must fail."""
    req = _req(SamplingParams(frequency_penalty=0.7), prompt=[5], output=[1, 2])
    drafts = _tree(root=2, seed=3)
    logits = torch.randn(1, drafts.num_nodes, V)
    planted = _tree_paths(drafts)
    planted.anc = planted.anc & ~torch.eye(drafts.num_nodes, dtype=torch.bool)
    assert not torch.allclose(process(logits, [req], planted), _plain_reference(logits, req, _paths(drafts)))


def test_rows_without_processors_are_untouched_and_padding_is_ignored():
    plain = _req(SamplingParams(), [1], [2])
    pen = _req(SamplingParams(frequency_penalty=1.0), [1], [2])
    drafts = Drafts.from_lists([[2, 4, 4], [2, 4]], [[-1, 0, 1], [-1, 0]])  # row 1 padded to 3 nodes
    logits = torch.randn(2, 3, V)
    assert process(logits, [plain, plain], _tree_paths(drafts)) is logits
    got = process(logits, [plain, pen], _tree_paths(drafts))
    assert torch.equal(got[0], logits[0])
    assert got[1, 1, 4] == logits[1, 1, 4] - 1.0  # its own token once; the padding node adds nothing
    assert got[1, 1, 2] == logits[1, 1, 2] - 1.0  # the output token


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    return GrammarCompiler(tok.to_json(), tok.vocab_size, sorted(tok.eos_token_ids))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.slow
def test_tree_masks_equal_each_paths_mask(compiler, smollm2_dir):
    """A draft tree mixing allowed and forbidden branches: every live node's mask is the
    mask after consuming its path; the matcher is back at its state afterwards."""
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    m = compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    m.sync(enc('{"a": 1'))  # committed state
    good, bad = enc('2, "b'), enc("x}")
    # root, a good chain, a bad branch off the root, and a branch off the good chain's first node
    tokens = [enc("1")[0]] + good + bad + [enc("}")[0]]
    g, b = len(good), len(bad)
    parents = [-1] + [0] + list(range(1, g)) + [0] + list(range(g + 1, g + b)) + [1]
    masks = m.tree_masks(tokens, parents, [True] * len(tokens))
    ref = compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    ref.sync(enc('{"a": 1'))
    torch.testing.assert_close(masks[0], ref.mask())
    for i, node_path in enumerate(_paths(Drafts.from_lists([tokens], [parents])), start=0):
        if i == 0 or i > g:  # the good chain only (the bad branch's first token is refused)
            continue
        probe = ref.ll.deep_copy()
        assert probe.try_consume_tokens(node_path) == len(node_path)
        want = torch.zeros_like(masks[i])
        probe.unsafe_compute_mask_ptr(want.data_ptr(), want.numel() * 4)
        assert torch.equal(masks[i], want), i
    assert torch.equal(masks[g + 1], torch.full_like(masks[0], -1))  # dead: refused at the root
    torch.testing.assert_close(m.mask(), ref.mask())  # rolled back to the committed state


@pytest.mark.slow
@pytest.mark.parametrize("kind, source, message", [
    ("json_schema", json.dumps({"type": "foo"}), "Invalid type"),
    ("json_schema", json.dumps({"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable"),
    ("regex", "(a", "unclosed group"),
    ("regex", "[^\\s\\S]", "matches no text"),
    ("ebnf", "root ::= undefined_rule", "invalid ebnf"),
])
def test_bad_grammars_raise_a_clear_error(compiler, kind, source, message):
    with pytest.raises(GrammarError, match=message):
        compiler.check(Constraint(kind, source))


def test_grammar_rows_are_masked_to_minus_inf(monkeypatch):
    class Fake:  # allows tokens 3 and 40 at every node
        def sync(self, ids): self.ids = ids

        def tree_masks(self, tokens, parents, valid):
            return self.mask()[None].repeat(len(tokens), 1)

        def mask(self):
            m = torch.zeros(2, dtype=torch.int32)
            m[0], m[1] = 1 << 3, 1 << (40 - 32)
            return m

    req = _req(SamplingParams(), [1], [2])
    req.params.constraint = Constraint("regex", "x")
    req.grammar = Fake()
    out = process_rows(torch.zeros(1, V), [req])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 40]
    assert logits_process.process(torch.zeros(1, 1, V), [_req(SamplingParams(), [1], [2])]).shape == (1, 1, V)


@pytest.mark.slow
def test_an_eos_in_a_draft_never_moves_the_matcher(compiler, smollm2_dir):
    """llguidance keeps no EOS in its history: a rollback over one undid a real token, and
    the grammar then allowed text after its end. Masks over a tree with an EOS node leave
    the matcher exactly at the committed state."""
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    m = compiler.matcher(Constraint("ebnf", 'root ::= colour "."\ncolour ::= "red" | "blue"'))
    m.sync(enc("red."))
    done = m.mask()
    eos, dot = 2, enc(".")[0]
    tokens, parents = [dot, eos, dot], [-1, 0, 1]
    m.tree_masks(tokens, parents, [True] * 3)
    assert torch.equal(m.mask(), done) and not m.ll.is_error()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_greedy_rows_skip_masks_only_where_the_walk_is_unchanged(compiler, smollm2_dir, seed, monkeypatch):
    """A greedy request's masks are not applied when its mask allows the argmax at every
    node of its greedy walk: the accepted path and tokens equal those of fully masked
    logits, whether the argmax is allowed everywhere or refused somewhere; and the argmax
    that llguidance's validate_tokens accepts but its mask refuses ('pet' where the mask
    wants 'p' + 'ets') is masked like any other."""
    from specserve.runner.sampler import sampling_batch
    from specserve.spec.accept import accept
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pets = {"type": "object", "properties": {"name": {"type": "string"}, "pets": {"type": "array"}},
            "required": ["name", "pets"], "additionalProperties": False}
    chain = enc('{"name": "Jo", "pets": []}')
    cut = chain.index(enc(' "')[0], 4) + 1  # just after the second key's opening quote
    req = _req(SamplingParams(temperature=0, constraint=Constraint("json_schema", json.dumps(pets))), [1], chain[:cut])
    req.grammar = compiler.matcher(req.params.constraint)
    nxt = chain[cut:cut + 4]
    tokens, parents = [chain[cut - 1]], [-1]
    for d, t in enumerate(nxt):  # the chain drafted, a wrong sibling at each depth
        tokens += [t, enc("}")[0]]
        parents += [2 * d - 1 if d else 0] * 2
    drafts = Drafts.from_lists([tokens], [parents])
    logits = torch.randn(1, len(tokens), tok.vocab_size, generator=torch.Generator().manual_seed(seed))
    for i, t in enumerate(nxt + enc("}")):  # the model favours the chain, then the closing brace ...
        logits[0, 0 if i == 0 else 2 * i - 1, t] += 30
    if seed % 2:  # ... or, at the root, 'pet': validated by llguidance, refused by its mask
        logits[0, 0, enc("pet")[0]] += 60
    sb = sampling_batch([req], tok.vocab_size, torch.device("cpu"))
    unused = torch.zeros(1, len(tokens) + 1)

    def walk() -> tuple[list[int], list[int]]:
        out = accept(drafts, process(logits, [req], _tree_paths(drafts)), sb, unused[:, :-1], unused[:, -1],
                     force_greedy=True)
        return out.paths[0], out.tokens[0]

    fast = walk()
    assert logits_process._needing_masks(logits, [req], [0], _tree_paths(drafts)) == ([0] if seed % 2 else [])
    monkeypatch.setattr(logits_process, "_needing_masks", lambda logits, reqs, rows, tree: rows)
    assert fast == walk()
    assert seed % 2 or len(fast[1]) == len(nxt) + 1  # the whole chain accepted where nothing was refused
