"""What happens to a sampled token: append it, check every finish condition, release text.

Used for plain decoding (one token per step) and for speculative steps (a run of accepted
tokens: EOS, stop strings and max_tokens can land mid-run, and the run ends at the first
finish). A run detokenizes once, not token by token, unless a stop string or logprobs need
each token seen alone (at batch 64 a speculative step commits ~170 tokens, and two
tokenizer decodes a token were a third of its host work).
"""
from __future__ import annotations

from specserve.core.messages import TokenLogprob, TokenOut
from specserve.core.request import Req
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
    if req.stops.active:
        released, matched = req.stops.push(req.detok.push([token_id]))
        req.pending_text += released
        if matched is not None:
            req.finish_reason = {"type": "stop", "matched": matched}  # text after it is dropped
            return
    else:
        req.pending_text += req.detok.push([token_id])
    if len(req.output_ids) >= _output_limit(req, context_length):
        _finish(req, {"type": "length"})


def commit_run(req: Req, tokens: list[int], eos_ids: frozenset[int], context_length: int) -> int:
    """Commit tokens in order up to the first that ends the request (EOS, a stop token or
    string, max_tokens, the context); returns how many were committed. The same as
    `commit_token` on each, with one detokenizer push for the run when the request has no
    stop strings (only a stop string needs the text after every token)."""
    if req.stops.active:
        for i, tok in enumerate(tokens):
            commit_token(req, tok, eos_ids, context_length)
            if req.finished:
                return i + 1
        return len(tokens)
    p = req.params
    # index of the first stopping token, else len(tokens); then the length cut
    stop_at = next((i for i, t in enumerate(tokens)
                    if t in p.stop_token_ids or (not p.ignore_eos and t in eos_ids)), len(tokens))
    room = max(1, _output_limit(req, context_length) - len(req.output_ids))  # tokens up to `length`
    run = tokens[:min(room, stop_at)]
    _append(req, run)
    req.pending_text += req.detok.push(run)
    if room <= stop_at:  # the length limit comes first (stop_at <= len(tokens): the run is `room` long)
        _finish(req, {"type": "length"})
        return room
    if stop_at == len(tokens):
        return stop_at
    stop = tokens[stop_at]  # appended, never detokenized (as commit_token does)
    _append(req, [stop])
    _finish(req, {"type": "stop", "matched": stop})
    return stop_at + 1


def _append(req: Req, run: list[int]) -> None:
    req.output_ids.extend(run)
    req.pending_ids.extend(run)


def _output_limit(req: Req, context_length: int) -> int:
    """Output tokens at which the request ends by length: max_tokens or the context."""
    return min(req.max_new_tokens, context_length - len(req.prompt_ids))


def commit_sampled(reqs: list[Req], so: SampleOutput, eos_ids: frozenset[int], context_length: int) -> None:
    """Commit one sampled token per request (a plain decode step), with its logprobs when asked."""
    ids = so.next_ids.tolist()  # the one device->host sync of a step
    lps = so.logprobs.tolist() if so.logprobs is not None else None
    tops = None
    if so.top_ids is not None and so.top_logprobs is not None:
        tops = (so.top_ids.tolist(), so.top_logprobs.tolist())
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
