"""engine/fronts.py: rank 0's pipes to several front ends, without an engine.

Messages come back tagged with their sender; each delta goes to the front end whose
request it is (until its finished delta); a front end whose pipe closes has its running
requests aborted while the others are served on; the launcher's closing is a stop.
"""
from __future__ import annotations

from multiprocessing import Pipe

from specserve.core.messages import AbortReq, ControlReq, GenerateReq, TokenOut
from specserve.core.sampling_params import SamplingParams
from specserve.engine.fronts import Fronts


def _wired(n: int):
    """Fronts over n pipe pairs, and the front ends' ends: (to the engine, from it) each."""
    to_engine = [Pipe(duplex=False) for _ in range(n)]  # (engine reads, front writes)
    from_engine = [Pipe(duplex=False) for _ in range(n)]  # (front reads, engine writes)
    fronts = Fronts([r for r, _ in to_engine], [w for _, w in from_engine])
    return fronts, [(w, r) for (_, w), (r, _) in zip(to_engine, from_engine)]


def _req(rid: str) -> GenerateReq:
    return GenerateReq(rid, [1, 2, 3], SamplingParams(max_new_tokens=4))


def _out(rid: str, finished: bool = False) -> TokenOut:
    return TokenOut(rid, [7], "x", finished)


def test_each_delta_goes_back_to_its_sender():
    fronts, ends = _wired(3)
    ends[0][0].send(_req("a#0.0"))
    ends[2][0].send(_req("b#2.0"))
    ends[2][0].send(ControlReq("metrics", 5))
    got = fronts.read(1.0)
    assert sorted((f, getattr(m, "rid", "control")) for f, m in got) == [(0, "a#0.0"), (2, "b#2.0"), (2, "control")]
    fronts.send([_out("a#0.0"), _out("b#2.0"), _out("b#2.0", finished=True)])
    assert [TokenOut.unpacked(r).rid for r in ends[0][1].recv()] == ["a#0.0"]
    assert [TokenOut.unpacked(r).finished for r in ends[2][1].recv()] == [False, True]
    assert not ends[1][1].poll(0.1)
    assert fronts.owner == {"a#0.0": 0}  # a finished request is forgotten
    fronts.answer_to(2)("answer")
    assert ends[2][1].recv() == "answer"


def test_a_front_end_that_goes_has_its_requests_aborted():
    fronts, ends = _wired(2)
    ends[0][0].send(_req("a#0.0"))
    ends[1][0].send(_req("b#1.0"))
    ends[1][0].send(_req("c#1.1"))
    fronts.read(1.0)
    ends[1][0].close()
    ends[1][1].close()
    got = fronts.read(1.0)
    assert sorted((f, m.rid) for f, m in got if isinstance(m, AbortReq)) == [(1, "b#1.0"), (1, "c#1.1")]
    fronts.send([_out("b#1.0", finished=True), _out("a#0.0")])  # the gone one's answer is dropped
    assert [TokenOut.unpacked(r).rid for r in ends[0][1].recv()] == ["a#0.0"]
    assert fronts.read(0.05) == []  # the others are served on


def test_the_launchers_pipe_closing_is_a_stop():
    fronts, ends = _wired(2)
    ends[0][0].close()
    assert fronts.read(1.0) == [(0, None)]
