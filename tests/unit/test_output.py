"""Committing sampled tokens: a speculative step's run committed at once (`commit_run`,
one detokenizer push) ends exactly where, and leaves exactly the state, that committing
its tokens one by one (`commit_token`) does: output and pending ids, text, finish reason."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.core.request import Req
from specserve.core.sampling_params import SamplingParams
from specserve.engine.output import commit_run, commit_token, take_output
from specserve.tokenizer.streaming import IncrementalDetokenizer, StopChecker
from specserve.tokenizer.tokenizer import Tokenizer
from tests.unit.test_tokenizer import tiny  # noqa: F401  (the fixture)

EOS = frozenset({3})


def _req(tok: Tokenizer, prompt: int, params: SamplingParams) -> Req:
    return Req("r", list(range(10, 10 + prompt)), params, 0, IncrementalDetokenizer(tok), StopChecker(params.stop))


def _state(req: Req) -> tuple:
    """What the client sees in the end. Text is compared with what the detokenizer still
    holds: a run and its tokens one by one may hold back a partial character differently
    while the request goes on (a finished request holds nothing)."""
    out = take_output(req)
    return req.output_ids, out.token_ids, out.text + req.detok.flush(), out.finish_reason


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.lists(st.integers(0, 120), min_size=1, max_size=6), min_size=1, max_size=6),
       prompt=st.integers(1, 8), max_new=st.one_of(st.none(), st.integers(1, 20)),
       context=st.integers(4, 40), ignore_eos=st.booleans(), stop_ids=st.lists(st.integers(0, 120), max_size=2),
       stops=st.sampled_from([[], ["e"], ["ab", "c"]]))
def test_a_run_commits_as_its_tokens_one_by_one(tiny: Tokenizer, runs, prompt, max_new, context, ignore_eos,
                                                stop_ids, stops) -> None:
    # ids 0..120 of the tiny vocabulary are single bytes and specials: partial characters,
    # EOS (3) and stop ids inside runs, the length cut anywhere in a run
    params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=ignore_eos,
                            stop_token_ids=stop_ids, stop=stops)
    whole, single = _req(tiny, prompt, params), _req(tiny, prompt, params)
    for run in runs:
        if whole.finished:
            break
        n = commit_run(whole, run, EOS, context)
        for i, tok in enumerate(run):
            commit_token(single, tok, EOS, context)
            if single.finished:
                break
        assert n == i + 1 and whole.finished == single.finished
    assert _state(whole) == _state(single)
