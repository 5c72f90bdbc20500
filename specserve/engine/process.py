"""An engine process: one tensor-parallel rank that receives requests, steps the scheduler
and (rank 0) sends deltas back.

The HTTP server's event loop and the scheduler's hot loop must not share one GIL, so the
scheduler runs here. Messages are the dataclasses of `messages.py`: rank 0 reads them from
one-way multiprocessing pipes, a pair per front-end process (`fronts.py`), and answers each
request on its sender's pipe (deltas as `TokenOut.packed` tuples); under tensor parallelism it
broadcasts each batch it read to the other ranks (`core/parallel.py`), which handle the
same messages and run the same steps (engine/ranks.py says why). At tp 1 a step that
raises aborts the requests it touched (with the error) instead of killing the process: no
client can crash the server. Under tensor parallelism a failed step ends the process with
an error instead: the ranks could no longer be trusted to run the same steps, and the
launcher takes the whole replica down.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from specserve.core import parallel
from specserve.core.messages import AbortReq, ControlOut, ControlReq, GenerateReq
from specserve.engine.fronts import Fronts
from specserve.engine.protocol import EngineStart, ModelInfo, RankPlace
from specserve.engine.watchdog import StepClock

logger = logging.getLogger("specserve")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")


def engine_main(start: EngineStart, place: RankPlace, inboxes: list[Connection] | None,
                outboxes: list[Connection] | None, clock: StepClock | None = None) -> None:
    """Run rank `place.rank`; rank 0 alone has the pipes, a pair per front end (`inboxes`,
    `outboxes`; the first pair is the launcher's). Each step is timed on `clock`, which
    the front end's watchdog reads."""
    clock = clock or StepClock()
    # Ctrl-C reaches the whole process group; the front end decides when this process stops
    # (it sends None, then waits), so SIGINT here would only print a second traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if place.gpu is not None:  # every GPU stays visible (peers map each other's memory)
        use_gpu(place.gpu)
    # One rank speaks for the group: the others log warnings and errors only
    setup_logging(start.config.server.log_level if place.rank == 0 else "warning")
    if place.host_procs > 1:
        _share_cores(place)
    try:
        sched = _build(start, place)
    except Exception as e:  # report, don't hang the parent
        if outboxes:
            outboxes[0].send(("error", f"{type(e).__name__}: {e}"))
        logger.error("rank %d failed to start: %s: %s", place.rank, type(e).__name__, e)
        sys.exit(1)
    if not inboxes or not outboxes:
        _follow(sched, place, clock)
        return
    cfg = start.config
    served = cfg.model.served_model_name or cfg.model.model_path
    try:
        outboxes[0].send(("ready", ModelInfo(served, sched.context_length, sched.runner.vocab_size,
                                             sched.max_running, sched.kv.num_slots)))
        _loop(sched, Fronts(inboxes, outboxes), place.tp_size > 1, clock)
    except (BrokenPipeError, EOFError, OSError):
        return  # the front end went away: nothing left to serve
    except Exception as e:  # a collective failed: another rank is gone (the launcher says which)
        if place.tp_size == 1:
            raise
        logger.error("rank 0 stopped: %s: %s", type(e).__name__, str(e).splitlines()[0][:300])
        sys.exit(1)


def use_gpu(index: int) -> None:
    """Make GPU `index` this process's current device, before anything is allocated: the
    engine's tensors go to torch.device("cuda"), the current one."""
    import torch

    torch.cuda.set_device(index)


def _share_cores(place: RankPlace) -> None:
    """The engine processes of one host (ranks and replicas) split its cores for torch's
    CPU threads: more threads than cores would stall every collective on the slowest CPU
    rank, and one process's spinning pool would slow another's host work."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // place.host_procs))


def _build(start: EngineStart, place: RankPlace):
    from dataclasses import replace

    from specserve.engine.scheduler import Scheduler
    from specserve.engine.tp_group import join_tp_group
    from specserve.tokenizer.tokenizer import load_tokenizer

    if place.tp_size > 1:
        join_tp_group(place)
        # Unseeded requests draw their seeds from the scheduler's generator: one seed for all ranks
        sc = start.config.scheduler
        seed = parallel.broadcast_object(sc.random_seed if sc.random_seed is not None
                                         else int.from_bytes(os.urandom(7), "little"))
        start = replace(start, config=replace(start.config, scheduler=replace(sc, random_seed=seed)))
    return Scheduler(start, load_tokenizer(start.tokenizer_dir))


def _loop(sched, fronts: Fronts, shared: bool, clock: StepClock) -> None:
    """Rank 0: read what the front ends sent, share it with the other ranks, handle it, step."""
    while True:
        msgs = fronts.read(0.0 if sched.has_work else 0.05)
        if shared and parallel.broadcast_flag(bool(msgs)):  # most steps: one small collective
            parallel.broadcast_object([msg for _, msg in msgs])
        outs = []
        for front, msg in msgs:
            if msg is None:
                clock.stop()
                return
            outs += _handle(sched, msg, fronts.answer_to(front))
        if sched.has_work:  # timed on to the next step while work remains (engine/watchdog.py)
            with clock.step(still_busy=lambda: sched.has_work):
                outs += _safe_step(sched, shared)
        else:
            clock.stop()
        if outs:
            fronts.send(outs)


def _follow(sched, place: RankPlace, clock: StepClock) -> None:
    """Ranks above 0: handle what rank 0 shared, step as it does."""
    try:
        while True:
            for msg in parallel.broadcast_object(None) if parallel.broadcast_flag(False) else []:
                if msg is None:
                    return
                _handle(sched, msg, None)
            if sched.has_work:
                with clock.step():
                    sched.step()
    except Exception as e:
        logger.error("rank %d stopped: %s: %s", place.rank, type(e).__name__, e)
        sys.exit(1)


def _handle(sched, msg, answer: Callable[[ControlOut], None] | None) -> list:
    if isinstance(msg, GenerateReq):
        return sched.add_request(msg)
    if isinstance(msg, AbortReq):
        return sched.abort(msg.rid)
    if isinstance(msg, ControlReq):
        ops = {"flush_cache": sched.flush_cache, "server_info": sched.server_info, "metrics": sched.metrics,
               "kv_leak": lambda: kv_leak(sched)}
        result = ops[msg.op]() if msg.op in ops else {"error": f"unknown control op {msg.op}"}
        if answer is not None:
            answer(ControlOut(msg.token, result))
    return []


def kv_leak(sched) -> str | None:
    """Flush the prefix cache and say how the KV memory differs from idle (None: it is
    idle), for tests: after their requests every slot must be back."""
    if sched.has_work:
        return "requests are still running"
    sched.kv.flush_cache()
    try:
        sched.kv.assert_no_leak()
    except AssertionError as e:
        return str(e)
    return None


def _safe_step(sched, shared: bool) -> list:
    try:
        return sched.step()
    except Exception as e:
        if shared:  # the ranks may now differ: end the replica (engine/ranks.py stops the rest)
            logger.error("step failed on rank 0; stopping the tensor-parallel group:\n%s", traceback.format_exc())
            sys.exit(1)
        logger.error("step failed, aborting its requests:\n%s", traceback.format_exc())
        outs = []
        for req in list(sched.waiting) + sched.prefilling + sched.running:
            outs += sched.abort(req.rid)
        for out in outs:
            out.finish_reason = {"type": "abort", "message": f"internal error: {type(e).__name__}: {e}"}
        return outs
