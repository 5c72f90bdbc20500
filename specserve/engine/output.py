"""What happens to a sampled token: append it, check every finish condition, release text.

Used for plain decoding (one token per step) and for speculative steps (a run of accepted
tokens, committed one by one so EOS, stop strings and max_tokens can land mid-run; the
caller stops at the first finish).
"""
from __future__ import annotations

from specserve.engine.messages import TokenLogprob, TokenOut
from specserve.engine.request import Req
from specserve.runner.sampler import SampleOutput


def commit_token(req: Req, token_id: int, eos_ids: frozenset[int], context_length: int,
                 logprob: TokenLogprob | None = None) -> None:
    """Append token_id to req's output; set req.finish_reason if it ends the request."""
    p = req.params
    req.output_ids.append(token_id)
    req.pending_ids.append(token_id)
    if logprob is not None:
        req.pending_logprobs.append(logprob)
    if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in eos_ids):
        _finish(req, {"type": "stop", "matched": token_id})
        return
    released, matched = req.stops.push(req.detok.push([token_id]))
    req.pending_text += released
    if matched is not None:
        req.finish_reason = {"type": "stop", "matched": matched}  # text after it is dropped
    elif len(req.output_ids) >= req.max_new_tokens or req.seq_len >= context_length:
        _finish(req, {"type": "length"})


def commit_sampled(reqs: list[Req], so: SampleOutput, eos_ids: frozenset[int], context_length: int) -> None:
    """Commit one sampled token per request (a plain decode step), with its logprobs when asked."""
    ids = so.next_ids.tolist()  # the one device->host sync of a step
    lps = so.logprobs.tolist() if so.logprobs is not None else None
    tops = (so.top_ids.tolist(), so.top_logprobs.tolist()) if so.top_ids is not None else None
    for b, (req, tid) in enumerate(zip(reqs, ids)):
        entry = None
        if lps is not None and req.params.logprobs:
            k = req.params.top_logprobs
            top = list(zip(tops[0][b][:k], tops[1][b][:k])) if tops and k else []
            entry = TokenLogprob(tid, lps[b], top)
        commit_token(req, tid, eos_ids, context_length, entry)


def _finish(req: Req, reason: dict) -> None:
    """End the request, releasing text held by the detokenizer and the stop checker.

    A held incomplete character may still complete a stop string; if so that wins."""
    released, matched = req.stops.push(req.detok.flush())
    req.pending_text += released
    if matched is not None:
        req.finish_reason = {"type": "stop", "matched": matched}
        return
    req.pending_text += req.stops.flush()  # nothing can complete a stop string any more
    req.finish_reason = reason


def finish_abort(req: Req, message: str) -> None:
    _finish(req, {"type": "abort", "message": message})


def take_output(req: Req) -> TokenOut:
    """The request's delta since the last call (and its final state when finished)."""
    out = TokenOut(
        rid=req.rid, token_ids=req.pending_ids, text=req.pending_text,
        finished=req.finished, finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens, logprobs=req.pending_logprobs, meta=dict(req.meta),
    )
    req.pending_ids, req.pending_text, req.pending_logprobs = [], "", []
    return out
