"""One answer from several data-parallel replicas: the model info the front end checks
requests against, `/get_server_info`, and the `/metrics` snapshot.

Totals are sums (requests, tokens, slots, throughput) except for ratios, which are the
mean over the replicas that report them (token usage, acceptance). Each replica's own
answer stays under "replicas", in replica order.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specserve.engine.protocol import ModelInfo

_MEANS = frozenset({"token_usage", "spec_accept_length", "spec_accept_rate", "cache_hit_rate"})
_PER_REPLICA = ("max_total_num_tokens", "max_running_requests", "device", "internal_states")


def merge_model_info(infos: Sequence[ModelInfo]) -> ModelInfo:
    first = infos[0]
    return ModelInfo(first.served_model_name, min(i.context_length for i in infos), first.vocab_size,
                     sum(i.max_running_requests for i in infos), sum(i.max_total_tokens for i in infos))


def merge_server_info(infos: Sequence[dict], routed: Sequence[int]) -> dict:
    replicas = [{"dp_rank": d, "requests_routed": routed[d], **{k: info.get(k) for k in _PER_REPLICA}}
                for d, info in enumerate(infos)]
    lengths = [s.get("avg_spec_accept_length") for info in infos for s in info.get("internal_states") or []]
    known = [x for x in lengths if x is not None]
    return {**infos[0], "dp_size": len(infos), "replicas": replicas,
            "max_total_num_tokens": sum(i["max_total_num_tokens"] for i in infos),
            "max_running_requests": sum(i["max_running_requests"] for i in infos),
            "internal_states": [{"avg_spec_accept_length": sum(known) / len(known) if known else None}]}


def merge_metrics(snapshots: Sequence[dict]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for name in dict.fromkeys(k for s in snapshots for k in s):
        values = [s[name] for s in snapshots if isinstance(s.get(name), (int, float))]
        if values:
            total[name] = sum(values) / len(values) if name in _MEANS else sum(values)
    return {**total, "replicas": list(snapshots)}
