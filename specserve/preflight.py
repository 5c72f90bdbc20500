"""Start-up checks that need no weights, run before anything loads.

A mistake a user can make on the command line should cost seconds, not a model load: the
port is bound first (a taken port fails at once, and the server later serves on this very
socket), then the sources are resolved in the order that fails fastest: a --chat-template
file, an explicit draft path, the target (fetched or converted once), the tokenizer, the
target's config (its architecture must be one we serve), and the speculative set-up
(spec/registry.py `plan`: the draft's directory, shipped heads, MTP layers, token maps, the
tree). The result is an `EngineStart` nothing later needs to re-resolve, and the tokenizer
(with the --chat-template file's template, when one is given).
"""
from __future__ import annotations

import errno
import socket
from dataclasses import replace

from specserve.core.config import Config
from specserve.engine.protocol import EngineStart
from specserve.models.llama import LlamaConfig
from specserve.models.loader import read_hf_config
from specserve.models.source import resolve_model_dir
from specserve.runner.model_runner import pick_device
from specserve.spec import registry
from specserve.spec.sources import explicit_draft_dir
from specserve.tokenizer.tokenizer import Tokenizer, load_tokenizer, read_chat_template


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for the HTTP server to serve on; ValueError with one
    line when the address is taken or cannot be bound. It does not listen yet (the server
    does once it serves), so until then clients are refused rather than kept waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
        raise ValueError(f"address {host}:{port} {why} (choose another with --host / --port)") from None
    return sock


def resolve_sources(cfg: Config) -> tuple[EngineStart, Tokenizer]:
    """What an engine starts from, and the tokenizer; ValueError naming the first source
    that is wrong (module docstring for the order)."""
    # a wrong draft or template path fails before the target is fetched
    template = read_chat_template(cfg.server.chat_template) if cfg.server.chat_template else None
    draft = explicit_draft_dir(cfg.spec)
    if draft is not None:
        cfg = replace(cfg, spec=replace(cfg.spec, draft_dir=str(draft)))
    model_dir = resolve_model_dir(cfg.model.model_path, cfg.model.revision, cfg.model.load_format)
    tokenizer_path = cfg.model.tokenizer_path
    tokenizer_dir = resolve_model_dir(tokenizer_path) if tokenizer_path is not None else model_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    if template is not None:
        tokenizer.chat_template = template
    target = LlamaConfig.from_hf(read_hf_config(model_dir))
    on_cpu = pick_device(cfg.model.device).type == "cpu"
    plan = registry.plan(replace(cfg.spec, on_cpu=on_cpu), model_dir, target)
    if plan is not None:
        cfg = replace(cfg, spec=plan.spec)
    return EngineStart(cfg, model_dir, tokenizer_dir, plan), tokenizer
