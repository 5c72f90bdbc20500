"""The offline API: `Engine(model=...).generate(prompts, sampling_params)`.

Runs the same Scheduler as the server, in this process, stepping until every request it
was given has finished; with `tp_size` > 1 the scheduler runs in one engine process per
rank (engine/ranks.py), as the server's does, and `shutdown()` (or leaving a `with`
block) stops them. Keyword arguments are the server's flags with underscores
(`speculative_algorithm="NGRAM"`, `disable_radix_cache=True`, ...), validated by the same
code as the command line. Results have SGLang's shape:
{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
 "cached_tokens", "finish_reason", ...}}.
"""
from __future__ import annotations

import itertools
from typing import Any, cast

from specserve.args import parse_config
from specserve.core.config import Config, ConfigError
from specserve.core.messages import ControlOut, ControlReq, GenerateReq, TokenOut, unpack_outs
from specserve.core.sampling_params import SamplingParams
from specserve.engine.client import on_gpu
from specserve.engine.process import kv_leak
from specserve.engine.ranks import Layout, Replica
from specserve.engine.scheduler import Scheduler
from specserve.preflight import resolve_sources
from specserve.server.protocol import bias_map, one_constraint


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
        # SGLang's names for a grammar; logit_bias keys may be ints or OpenAI's strings
        grammar = {k: d.pop(k) for k in ("json_schema", "regex", "ebnf") if k in d}
        if grammar:
            d["constraint"] = one_constraint(**grammar)
        if d.get("logit_bias"):
            d["logit_bias"] = bias_map(d["logit_bias"])
        return SamplingParams(**d)
    except TypeError as e:
        raise ValueError(f"bad sampling_params: {e}") from None


class Engine:
    def __init__(self, model: str | None = None, *, config: Config | None = None, **kwargs: Any) -> None:
        start, self.tokenizer = resolve_sources(config or parse_config(kwargs_to_argv(model, kwargs)))
        self.config = start.config
        r = self.config.runner
        if r.dp_size > 1 or r.nnodes > 1:
            raise ConfigError("the offline Engine runs one replica on one host: --dp-size and --nnodes "
                              "above 1 need the server")
        if self.config.server.tokenizer_worker_num > 1:
            raise ConfigError("--tokenizer-worker-num sets the server's HTTP processes; the offline Engine has none")
        self._ids = itertools.count()
        self.scheduler: Scheduler | None = None
        self._ranks: Replica | None = None
        if r.tp_size == 1:
            self.scheduler = Scheduler(start, self.tokenizer)
            return
        layout = Layout.of(self.config, on_gpu(self.config))
        layout.check_gpus(1)
        self._ranks = Replica(start, layout.places(0))
        try:
            self._ranks.wait_ready()
        except BaseException:
            self._ranks.stop(grace_s=0)
            raise

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
        if self.scheduler is None:
            return self._run_ranks(reqs, acc, pending)
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

    def _run_ranks(self, reqs: list[GenerateReq], acc: dict[str, dict], pending: set[str]) -> list[dict]:
        ranks = self._ranks
        assert ranks is not None and ranks.inbox is not None and ranks.outbox is not None
        for r in reqs:
            ranks.inbox.send(r)
        while pending:
            while not ranks.outbox.poll(0.5):
                dead = ranks.dead()
                if dead is not None:
                    raise RuntimeError(dead)
            for out in unpack_outs(ranks.outbox.recv()):
                _accumulate(acc[out.rid], out)
                if out.finished:
                    pending.discard(out.rid)
        return [acc[r.rid] for r in reqs]

    def flush_cache(self) -> bool:
        """Empty the prefix cache (False while requests run), as SGLang's Engine does."""
        return self.scheduler.flush_cache() if self.scheduler is not None else self._control("flush_cache")

    def server_info(self) -> dict:
        """What /get_server_info answers: the config, KV slots, device and dtype."""
        return self.scheduler.server_info() if self.scheduler is not None else self._control("server_info")

    def kv_leak(self) -> str | None:
        """Flush the prefix cache; how the KV memory differs from idle, or None (tests)."""
        return kv_leak(self.scheduler) if self.scheduler is not None else self._control("kv_leak")

    def _control(self, op: str) -> Any:
        ranks = self._ranks
        assert ranks is not None and ranks.inbox is not None and ranks.outbox is not None
        ranks.inbox.send(ControlReq(op, 0))
        msg = ranks.outbox.recv()
        assert isinstance(msg, ControlOut), msg
        return msg.result

    def shutdown(self) -> None:
        """Stop the engine processes (tp_size > 1); with one rank the engine runs in this
        process and there is nothing to stop."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _accumulate(res: dict, out: TokenOut) -> None:
    res["text"] += out.text
    res["output_ids"] += out.token_ids
    if out.logprobs:
        res.setdefault("output_token_logprobs", []).extend((lp.logprob, lp.token_id) for lp in out.logprobs)
    res["meta_info"] = {"id": out.rid, "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
                        "finish_reason": out.finish_reason, **out.meta}
