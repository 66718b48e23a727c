"""The stall watchdog's polled waits (hvdp.cluster.watchdog.StallWatchdog.poll): collectives inside
TensorFlow's executor that no Python call brackets, seen as counts of waits begun and ended and the
calls in progress (calls_inside), with a fake clock and a directory board."""
import gc
import json
import os
import threading
import weakref

import pytest

from hvdp.cluster.boards import DirBoard
from hvdp.cluster.stall_notes import NOTE_KEY
from hvdp.cluster.watchdog import StallWatchdog, calls_inside
from unit.test_watchdog import Clock, dog


def test_polled_waits_fire_only_while_one_lasts_past_the_deadline(tmp_path):
    """Waits inside TensorFlow's executor (hvdp.keras on TF) are counts the watchdog reads: the
    deadline runs from when it first sees begun ahead of ended, restarts for the next wait, and
    the rank's own cause is what its failure reporter then says of Horovod's shut-down."""
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    counts, step = [0, 0], object()         # step: the traced step's call, in progress throughout
    d0.poll("hvdp.keras's gradient reduction", lambda: (*counts, (step,)))
    for _ in range(3):                      # healthy steps: each wait ends well within the deadline
        counts[0] += 1
        assert not d0.check()
        clock.t += 6
        assert not d0.check()               # past half: its note is left...
        assert json.loads(board.get(NOTE_KEY.format(rank=0)))["name"] == "hvdp.keras's gradient reduction"
        counts[1] += 1
        assert not d0.check()               # ...and taken back once the wait is over
        assert "name" not in json.loads(board.get(NOTE_KEY.format(rank=0)))
        clock.t += 30                       # between waits time does not count
        assert not d0.check()
    counts[0] += 1
    assert not d0.check()
    clock.t += 6
    counts[0], counts[1] = counts[0] + 1, counts[1] + 1   # that wait ended, the next began
    assert not d0.check()                   # a new wait: its deadline starts now
    clock.t += 9.9
    assert not d0.check() and down0 == []
    clock.t += 0.2
    assert d0.check() and down0 == ["down"]
    assert "rank 0 waited 10 s at hvdp.keras's gradient reduction: rank 1 did not arrive" in d0.message
    said = d0._reporter.explanation("Horovod has been shut down.")
    assert said.startswith(f"StallError: {d0.message}") and said.endswith("saw: Horovod has been shut down.")


def test_polled_calls_are_seen_without_keeping_their_frames(tmp_path):
    """calls_inside(): a thread's call, seen at each look as the same call while it lasts (the
    deadline fires), and not kept alive once it returned: a frame kept by the watchdog kept its
    locals (a dropped Keras model and its optimizer, in a CI run) until the watchdog's next look."""
    class Model:
        pass

    inside, leave = threading.Event(), threading.Event()
    seen = []

    def call():  # the user's frame, holding a model; its thread waits in threading.py
        model = Model()
        seen.append(weakref.ref(model))
        inside.set()
        leave.wait()

    def mine():  # this thread's call only: other tests' threads may wait in threading.py too
        return tuple(c for c in calls_inside(os.sep + "threading.py") if c[0] == t.ident)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    clock = Clock()
    d, down = dog(DirBoard(str(tmp_path / "b")), 0, size=2, clock=clock)
    try:
        assert inside.wait(10)
        first = mine()
        assert len(first) == 1 and mine() == first
        del first
        d.poll("hvdp.keras's gradient reduction", lambda: (1, 0, mine()))
        assert not d.check() and d._pwait is not None     # a wait, in this call
        clock.t += 10.1
        assert d.check() and down == ["down"]              # the same call past the deadline
    finally:
        leave.set()
    t.join(10)
    gc.collect()
    assert d._pwait is not None and seen[0]() is None, "the watchdog keeps the returned call's locals"


def test_polling_is_off_with_the_watchdog():
    d = StallWatchdog(0, lambda: 0, lambda: 2, None, lambda: None, clock=Clock(), start_thread=False)
    d.poll("x", lambda: (5, 0, (object(),)))
    assert not d.check() and d.message is None


def test_a_failed_steps_count_is_no_wait_once_its_call_has_returned(tmp_path):
    """A step that failed after its count began (a user's error, caught) leaves begun ahead of
    ended for good; what the rank does next, idle or short calls that reduce nothing
    (evaluate), is not a stall. Only one same call in progress past the deadline is."""
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    state = {"counts": (1, 0), "calls": ()}
    d0.poll("hvdp.keras's gradient reduction", lambda: (*state["counts"], state["calls"]))
    for _ in range(30):                     # idle: no call in progress
        clock.t += 1
        assert not d0.check()
    for _ in range(30):                     # evaluate: a new short call at each look
        state["calls"] = (object(), object())
        clock.t += 1
        assert not d0.check()
    assert down0 == [] and d0.message is None
    stuck = object()                        # then a step that really waits (the count goes on)
    state["counts"], state["calls"] = (2, 0), (object(), stuck)
    assert not d0.check()
    state["calls"] = (stuck,)
    clock.t += 9.9
    assert not d0.check() and down0 == []
    clock.t += 0.2
    assert d0.check() and down0 == ["down"]


@pytest.mark.parametrize("between", ["idle", "no_look"])
def test_a_failed_steps_count_is_the_baseline_for_one_long_call_after_it(tmp_path, between):
    """After a failed step's count is left ahead, one later call that lasts past the deadline
    and reduces nothing (a long predict, a blocked input pipeline) is no stall, whether the
    watchdog looked while the rank was idle between the two calls or not; a wait that such a
    call then begins still fires at its deadline."""
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    failed = object()
    state = {"counts": (1, 0), "calls": (failed,)}  # the failing step, its wait begun
    d0.poll("hvdp.keras's gradient reduction", lambda: (*state["counts"], state["calls"]))
    assert not d0.check()
    clock.t += 2
    if between == "idle":
        state["calls"] = ()
        assert not d0.check()
        clock.t += 1
    long_call = object()
    state["calls"] = (long_call,)
    for _ in range(30):                     # one same call, 30 s (the deadline is 10 s)
        assert not d0.check()
        clock.t += 1
    assert down0 == [] and d0.message is None
    state["counts"] = (2, 0)                # that call now begins a wait that does not end
    assert not d0.check()
    clock.t += 9.9
    assert not d0.check() and down0 == []
    clock.t += 0.2
    assert d0.check() and down0 == ["down"]
    assert "rank 1 did not arrive" in d0.message


# --- Horovod's module collectives called from user code (StallWatchdog.watched) -----------------
