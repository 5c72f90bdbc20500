"""Start-up checks that need no weights, run before anything loads.

A mistake a user can make on the command line should cost seconds, not a model load: the
port is bound first (a taken port fails at once, and the server later serves on this very
socket), then the sources are resolved in the order that fails fastest: an explicit draft
path, the target (fetched or converted once), the tokenizer, the target's config (its
architecture must be one we serve), and the speculative set-up that config files decide
(`spec/factory.py` `resolve_spec`: shipped heads, MTP layers, token maps, the tree). The
result is a Config nothing later needs to re-resolve, the target's local directory and
the tokenizer.
"""
from __future__ import annotations

import errno
import socket
from dataclasses import dataclass, replace
from pathlib import Path

from specserve.config import Config
from specserve.models.llama import LlamaConfig
from specserve.models.loader import read_hf_config
from specserve.models.source import resolve_model_dir
from specserve.server.tokenizer import Tokenizer, load_tokenizer
from specserve.spec.factory import explicit_draft_dir, resolve_spec


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


@dataclass(frozen=True)
class Sources:
    config: Config  # its speculative set-up settled (SpecConfig.draft_dir, the tree)
    model_dir: Path  # the target's local Hugging Face-layout directory
    tokenizer: Tokenizer


def resolve_sources(cfg: Config) -> Sources:
    """Everything start-up needs before weights load; ValueError naming the first source
    that is wrong (module docstring for the order)."""
    explicit_draft_dir(cfg.spec)  # a wrong draft path fails before the target is fetched
    model_dir = resolve_model_dir(cfg.model.model_path, cfg.model.revision, cfg.model.load_format)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path, model_dir)
    target = LlamaConfig.from_hf(read_hf_config(model_dir))
    spec = resolve_spec(cfg.spec, model_dir, target.architecture, target.vocab_size)
    return Sources(replace(cfg, spec=spec), model_dir, tokenizer)
