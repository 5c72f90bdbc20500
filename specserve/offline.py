"""The offline API: `Engine(model=...).generate(prompts, sampling_params)`.

Runs the same Scheduler as the server, in this process, stepping until every request it
was given has finished. Keyword arguments are the server's flags with underscores
(`speculative_algorithm="NGRAM"`, `disable_radix_cache=True`, ...), validated by the
same code as the command line. Results have SGLang's shape:
{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
 "cached_tokens", "finish_reason", ...}}.
"""
from __future__ import annotations

import itertools
from typing import Any, cast

from specserve.args import parse_config
from specserve.core.config import Config
from specserve.core.messages import GenerateReq, TokenOut
from specserve.core.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.preflight import resolve_sources


def kwargs_to_argv(model: str | None, kwargs: dict[str, Any]) -> list[str]:
    argv = ["--model-path", model] if model else []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def make_sampling_params(d: dict | SamplingParams | None) -> SamplingParams:
    if isinstance(d, SamplingParams):
        return d
    d = dict(d or {})
    if isinstance(d.get("stop"), str):
        d["stop"] = [d["stop"]]
    try:
        return SamplingParams(**d)
    except TypeError as e:
        raise ValueError(f"bad sampling_params: {e}") from None


class Engine:
    def __init__(self, model: str | None = None, *, config: Config | None = None, **kwargs: Any) -> None:
        start, self.tokenizer = resolve_sources(config or parse_config(kwargs_to_argv(model, kwargs)))
        self.config = start.config
        self.scheduler = Scheduler(start, self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                 input_ids: list[int] | list[list[int]] | None = None) -> dict | list[dict]:
        single = isinstance(prompt, str) or bool(input_ids and isinstance(input_ids[0], int))
        batch: list[list[int]]
        if input_ids is None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
            batch = [self.tokenizer.encode(p) for p in prompts]
        else:
            batch = [cast(list[int], input_ids)] if single else cast(list[list[int]], input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        reqs = [GenerateReq(f"offline-{next(self._ids)}", ids, make_sampling_params(p))
                for ids, p in zip(batch, params)]
        results = self._run(reqs)
        return results[0] if single else results

    def _run(self, reqs: list[GenerateReq]) -> list[dict]:
        acc: dict[str, dict] = {r.rid: {"text": "", "output_ids": [], "meta_info": {}} for r in reqs}
        pending = set(acc)
        outs: list[TokenOut] = []
        for r in reqs:
            outs += self.scheduler.add_request(r)
        while True:
            for out in outs:
                _accumulate(acc[out.rid], out)
                if out.finished:
                    pending.discard(out.rid)
            if not pending:
                break
            outs = self.scheduler.step()
        return [acc[r.rid] for r in reqs]

    def shutdown(self) -> None:
        """Nothing to stop: the engine runs in this process. Kept for SGLang parity."""


def _accumulate(res: dict, out: TokenOut) -> None:
    res["text"] += out.text
    res["output_ids"] += out.token_ids
    if out.logprobs:
        res.setdefault("output_token_logprobs", []).extend((lp.logprob, lp.token_id) for lp in out.logprobs)
    res["meta_info"] = {"id": out.rid, "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
                        "finish_reason": out.finish_reason, **out.meta}
