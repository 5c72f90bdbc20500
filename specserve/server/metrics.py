"""Prometheus text exposition of the engine's metrics snapshot.

Owns the naming: every numeric entry of `client.control('metrics')` (a flat dict of name ->
number) is exposed as `specserve:<name>`; names ending in `_total` are counters, the rest
gauges. Entries that SGLang dashboards and scripts know are also mirrored as
`sglang:<name>` so they keep working. It knows nothing about how the engine counts.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "specserve:"
# Gauges SGLang exposes under these names (sglang: metrics/collector.py).
SGLANG_MIRRORED = (
    "spec_accept_length",
    "spec_accept_rate",
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
)
_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


class _Snapshot(Collector):
    """A one-shot collector over a dict fetched from the engine for this scrape."""

    def __init__(self, values: Mapping[str, Any]):
        self.values = values

    def collect(self) -> Iterator[Metric]:
        for raw_name, raw_value in sorted(self.values.items()):
            value = _number(raw_value)
            if value is None:
                continue  # strings, None, nested dicts: not a sample
            name = _BAD_CHARS.sub("_", str(raw_name))
            yield self._family(PREFIX + name, value, f"specserve engine metric {raw_name}")
            if name in SGLANG_MIRRORED:
                yield GaugeMetricFamily(f"sglang:{name}", f"SGLang-compatible {name}", value=value)

    @staticmethod
    def _family(name: str, value: float, doc: str) -> Metric:
        if name.endswith("_total"):
            # prometheus_client appends _total itself to counter samples.
            return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)
        return GaugeMetricFamily(name, doc, value=value)


class _Replicas(Collector):
    """Each data-parallel replica's numbers as `specserve:replica_<name>{dp_rank="d"}` gauges."""

    def __init__(self, replicas: list[Mapping[str, Any]]):
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        names = sorted({k for r in self.replicas for k, v in r.items() if _number(v) is not None})
        for raw_name in names:
            name = PREFIX + "replica_" + _BAD_CHARS.sub("_", str(raw_name))
            family = GaugeMetricFamily(name, f"specserve engine metric {raw_name}, per replica", labels=["dp_rank"])
            for d, replica in enumerate(self.replicas):
                value = _number(replica.get(raw_name))
                if value is not None:
                    family.add_metric([str(d)], value)
            yield family


def render_metrics(values: Mapping[str, Any]) -> bytes:
    """The Prometheus text format (version 0.0.4) of one metrics snapshot; with data
    parallelism the totals, then each replica's ("replicas": a list of snapshots)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(values))
    replicas = values.get("replicas")
    if isinstance(replicas, list):
        registry.register(_Replicas(replicas))
    return generate_latest(registry)
