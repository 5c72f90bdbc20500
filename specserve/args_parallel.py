"""The rules of the parallelism flags (`--tp-size`, `--dp-size`, `--nnodes`, `--node-rank`,
`--dist-init-addr`, `--base-gpu-id`): what combinations start, and the one-line refusals
of the ones that are not built. The placement they describe is engine/ranks.py's; whether
a model's heads and vocabulary divide over the ranks is checked when it loads."""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.core.config import Config, ConfigError

if TYPE_CHECKING:
    from specserve.args_check import CheckContext


def check_parallel(cfg: Config, ctx: CheckContext) -> Config:
    r = cfg.runner
    for flag, value in (("--dp-size", r.dp_size), ("--nnodes", r.nnodes)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not 0 <= r.node_rank < r.nnodes:
        raise ConfigError(f"--node-rank must be in 0..{r.nnodes - 1} (--nnodes {r.nnodes}), got {r.node_rank}")
    if r.base_gpu_id < 0:
        raise ConfigError(f"--base-gpu-id must be >= 0, got {r.base_gpu_id}")
    if r.nnodes > 1:
        _check_nodes(cfg)
    elif r.dist_init_addr is not None:
        _parse_addr(r.dist_init_addr)
    if r.tp_size > 1 and cfg.runner.enable_torch_compile:
        raise ConfigError("--enable-torch-compile with --tp-size > 1 is not supported yet")
    if r.tp_size > 1 and cfg.spec.token_map is not None:
        raise ConfigError("--speculative-token-map with --tp-size > 1 is not supported yet "
                          "(the truncated head would need the whole vocabulary on each rank)")
    return cfg


def _check_nodes(cfg: Config) -> None:
    r = cfg.runner
    if r.dist_init_addr is None:
        raise ConfigError(f"--nnodes {r.nnodes} needs --dist-init-addr host:port (where the ranks meet)")
    _parse_addr(r.dist_init_addr)
    if r.tp_size % r.nnodes:
        raise ConfigError(f"--tp-size {r.tp_size} must be a multiple of --nnodes {r.nnodes} "
                          "(each host runs the same number of ranks)")
    if r.dp_size > 1:
        raise ConfigError("--dp-size > 1 with --nnodes > 1 is not supported yet")


def _parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise ConfigError(f"--dist-init-addr must be host:port with a port in 1..65534, got {addr!r}")
    return host, int(port)
