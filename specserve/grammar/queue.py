"""Matchers built off the scheduler's thread, so a new grammar never stalls other requests.

The scheduler hands a constrained request to `submit` instead of its waiting queue and
takes it back from `ready()` once its matcher exists (llguidance builds without the GIL).
The first constrained request also builds the compiler (the tokenizer's token trie, about
half a second). With `sync=True` (tensor parallelism: every rank must admit the same
requests in the same step) the build happens inside `submit`.

Invariant: a request is in exactly one place: here (pending) or handed back once.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from specserve.core.request import Req
from specserve.grammar.compiler import GrammarCompiler, GrammarError
from specserve.grammar.matcher import GrammarMatcher


class GrammarQueue:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], sync: bool = False) -> None:
        self._make_compiler = make_compiler
        self._compiler: Future[GrammarCompiler] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar") if not sync else None
        self._pending: list[tuple[Req, Future[GrammarMatcher]]] = []

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, req: Req) -> None:
        """Start building `req`'s matcher (its params carry a constraint)."""
        constraint = req.params.constraint
        assert constraint is not None, "only constrained requests come here"
        self._pending.append((req, self._run(lambda: self._compiler_now().matcher(constraint))))

    def ready(self) -> list[tuple[Req, str | None]]:
        """Requests whose build ended, in submission order of those: (req, None) with
        req.grammar set, or (req, the error) when the constraint does not compile."""
        done: list[tuple[Req, str | None]] = []
        still = []
        for req, fut in self._pending:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = fut.result()
                done.append((req, None))
            except GrammarError as e:
                done.append((req, str(e)))
            except Exception as e:  # a client's grammar must not take the engine down
                done.append((req, f"the grammar could not be built: {e}"))
        self._pending = still
        return done

    def remove(self, rid: str) -> Req | None:
        """Take a pending request out (an abort); None when it is not here."""
        for i, (req, _) in enumerate(self._pending):
            if req.rid == rid:
                del self._pending[i]
                return req
        return None

    def _compiler_now(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = _done(self._make_compiler)
        return self._compiler.result()

    def _run(self, build: Callable[[], GrammarMatcher]) -> Future[GrammarMatcher]:
        return self._pool.submit(build) if self._pool is not None else _done(build)


def _done(fn: Callable) -> Future:
    """A future already holding fn()'s result or exception."""
    fut: Future = Future()
    try:
        fut.set_result(fn())
    except Exception as e:  # delivered through the future, like a pool's
        fut.set_exception(e)
    return fut
