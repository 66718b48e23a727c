"""The stall watchdog (hvdp.cluster.watchdog) with a fake clock and a directory board: when it fires,
which ranks it names, what the waiting rank raises, and that it stays out of healthy waits."""
import json
import threading

import pytest

from hvdp.cluster.boards import DirBoard
from hvdp.cluster.failures import FailureReporter
from hvdp.cluster.reports import parse_reports
from hvdp.cluster.stall_notes import NOTE_KEY
from hvdp.cluster.watchdog import StallError, StallWatchdog


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def dog(board, rank, size=3, timeout=10.0, clock=None):
    calls = []
    rep = FailureReporter(lambda: rank, board, wait_s=0)
    d = StallWatchdog(timeout, lambda: rank, lambda: size, rep, lambda: calls.append("down"),
                      clock=clock or Clock(), start_thread=False)
    return d, calls


def test_fires_at_the_deadline_and_names_the_rank_that_did_not_arrive(tmp_path):
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, clock=clock)
    d2, _ = dog(board, 2, clock=clock)
    with pytest.raises(StallError) as info:
        with d0.waiting("hvdp.opt0.fc.weight"), d2.waiting("hvdp.opt0.fc.weight"):
            clock.t += 4.9
            assert not d0.check() and not d2.check()           # nothing before half the deadline
            assert board.get(NOTE_KEY.format(rank=0)) is None
            clock.t += 0.2
            d0.check(), d2.check()                              # half: both leave their note
            assert json.loads(board.get(NOTE_KEY.format(rank=2)))["name"] == "hvdp.opt0.fc.weight"
            clock.t += 4.95
            assert not d0.check() and down0 == []
            clock.t += 0.1
            assert d0.check() and down0 == ["down"]             # fired: Horovod shut down
            raise ValueError("Handle 7 was not created or has been cleared.")  # what synchronize raises then
    msg = str(info.value)
    assert msg == d0.message and "rank 0 waited 10 s at hvdp.opt0.fc.weight" in msg
    assert "rank 1 did not arrive" in msg and "rank 2" not in msg and "HVDP_STALL_TIMEOUT_SECONDS" in msg
    # the other ranks learn it from the board (the failure reporter's report)
    (rep,) = parse_reports(board.read(), exclude_rank=1)
    assert rep["rank"] == 0 and rep["where"] == "in hvdp's stall watchdog" and "rank 1 did not arrive" in rep["error"]


def test_a_rank_waiting_elsewhere_is_named_with_its_collective(tmp_path):
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, _ = dog(board, 0, size=2, clock=clock)
    d1, _ = dog(board, 1, size=2, clock=clock)
    with pytest.raises(StallError):
        with d0.waiting("a"), d1.waiting("b"):
            clock.t += 6
            d0.check(), d1.check()
            clock.t += 5
            d0.check()
            raise RuntimeError("Horovod has been shut down")
    assert "rank 1 waits at b instead" in d0.message and "did not arrive" not in d0.message


def test_without_a_board_it_still_ends_the_wait_and_says_it_cannot_name_ranks():
    clock = Clock()
    d, down = dog(None, 0, clock=clock)
    d._reporter._board = False   # what FailureReporter keeps for "no board"
    with pytest.raises(StallError, match="no failure board"):
        with d.waiting("x"):
            clock.t += 11
            assert d.check() and down == ["down"]
            raise RuntimeError("Horovod has been shut down")


def test_healthy_waits_pass_errors_unchanged_and_clear_their_note(tmp_path):
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d, down = dog(board, 0, clock=clock)
    with d.waiting("slow"):
        clock.t += 6
        d.check()                               # a slow but healthy wait leaves a note...
    assert json.loads(board.get(NOTE_KEY.format(rank=0))).get("name") is None  # ...cleared after
    e = KeyError("not a stall")
    with pytest.raises(KeyError) as info:
        with d.waiting("y"):
            raise e
    assert info.value is e and down == [] and d.message is None
    assert not d.check()                        # not waiting: never fires


def test_a_note_from_an_earlier_wait_does_not_count_as_arrived(tmp_path):
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    board.put(NOTE_KEY.format(rank=1), json.dumps({"rank": 1, "name": "x", "since": 0.0}).encode())
    d, _ = dog(board, 0, size=2, clock=clock)
    with pytest.raises(StallError):
        with d.waiting("x"):
            clock.t += 11
            d.check()
            raise RuntimeError("down")
    assert "rank 1 did not arrive" in d.message


def test_timeout_zero_turns_it_off_and_the_variable_is_checked(monkeypatch, tmp_path):
    d, down = dog(DirBoard(str(tmp_path / "b")), 0, timeout=0)
    with d.waiting("x"):
        pass
    assert d._thread is None and not d.check() and down == []
    monkeypatch.setenv("HVDP_STALL_TIMEOUT_SECONDS", "soon")
    d2, _ = dog(None, 0, timeout=None)
    with pytest.raises(ValueError, match="HVDP_STALL_TIMEOUT_SECONDS='soon' is not an integer"):
        with d2.waiting("x"):
            pass
    monkeypatch.setenv("HVDP_STALL_TIMEOUT_SECONDS", "0")
    d3, _ = dog(None, 0, timeout=None)
    assert d3.timeout_s == 0


def test_a_watched_collective_is_named_with_its_name_argument(tmp_path):
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    seen = []

    def allreduce(tensor, average=None, name=None, op=None):  # Horovod's signature: name third
        seen.append([w.name for w in d0._waits.values()])  # this process's waits during the call
        return tensor

    def broadcast_object(obj, root_rank=0, name=None):
        seen.append([w.name for w in d0._waits.values()])
        return obj

    ar, bo = d0.watched(allreduce), d0.watched(broadcast_object)
    assert ar.__wrapped__ is allreduce and ar.__name__ == "allreduce"
    assert ar(1, None, "loss") == 1 and ar(2, name="acc") == 2 and ar(3) == 3
    assert bo({"a": 1}, 0, "cfg") == {"a": 1} and bo(5) == 5
    assert seen == [["hvd.allreduce(name='loss')"], ["hvd.allreduce(name='acc')"], ["hvd.allreduce"],
                    ["hvd.broadcast_object(name='cfg')"], ["hvd.broadcast_object"]]
    assert d0._waits == {} and down0 == []              # each wait ended with its call
    seen.clear()
    assert d0.watched(allreduce, tracing=lambda: True)(4, name="x") == 4
    assert seen == [[]]                                 # a graph being traced: nothing waits


def test_a_rank_that_never_arrives_at_a_user_collective_is_named_within_the_deadline(tmp_path):
    """The real thread, a 0.4 s deadline: rank 0's hvd.allreduce (a fake that blocks until
    Horovod is shut down) ends in StallError naming rank 1, which never called it, and the call."""
    import time

    board = DirBoard(str(tmp_path / "b"))
    down = threading.Event()
    rep = FailureReporter(lambda: 0, board, wait_s=0)
    d0 = StallWatchdog(0.4, lambda: 0, lambda: 2, rep, down.set)

    def allreduce(tensor, average=None, name=None):
        if not down.wait(30):
            raise AssertionError("the watchdog never fired")
        raise RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks")

    t0 = time.monotonic()
    with pytest.raises(StallError) as info:
        d0.watched(allreduce)(1.0, name="user.loss")
    took = time.monotonic() - t0
    assert 0.4 <= took < 0.4 + 1.5, took
    msg = str(info.value)
    assert "rank 0 waited 0.4 s at hvd.allreduce(name='user.loss'): rank 1 did not arrive" in msg, msg


def test_the_waiting_rank_raises_once_the_watchdogs_shutdown_returned(tmp_path):
    """Horovod's shutdown joins its background thread unguarded: the waiting rank's error must
    not let the interpreter exit (whose atexit calls it again) while the watchdog's is still in
    it (seen: the second join hung until horovodrun killed the rank)."""
    import time

    failing, returned = threading.Event(), []

    def shutdown():
        failing.set()            # Horovod's loop stops: the waiting collective fails at once...
        time.sleep(0.5)          # ...while the shutdown still joins Horovod's thread
        returned.append(time.monotonic())

    rep = FailureReporter(lambda: 0, DirBoard(str(tmp_path / "b")), wait_s=0)
    d0 = StallWatchdog(0.3, lambda: 0, lambda: 2, rep, shutdown)

    def allreduce(tensor, name=None):
        assert failing.wait(30)
        raise RuntimeError("Horovod has been shut down.")

    with pytest.raises(StallError):
        d0.watched(allreduce)(1.0)
    assert returned and time.monotonic() >= returned[0]


def test_a_wait_inside_another_stands_for_it_and_restarts_its_deadline(tmp_path):
    """hvd.broadcast_optimizer_state (one wait) may run hvdp's own waits inside it: the inner one
    is what is timed; when it ends, the outer one's deadline starts again (it made progress)."""
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    with d0.waiting("outer"):
        clock.t += 6
        with d0.waiting("inner"):
            clock.t += 6                            # outer 12 s old, inner 6 s
            assert not d0.check()
            assert json.loads(board.get(NOTE_KEY.format(rank=0)))["name"] == "inner"
        assert "name" not in json.loads(board.get(NOTE_KEY.format(rank=0)))
        clock.t += 9.9                              # the outer one, since the inner ended
        assert not d0.check() and down0 == []
        clock.t += 0.2
        assert d0.check() and down0 == ["down"] and "at outer:" in d0.message
    assert d0._waits == {}


def test_waits_of_two_threads_are_timed_each(tmp_path):
    """A wait that ends in one thread (a user's collective in a helper thread) does not hide
    another thread's wait that goes on."""

    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    started, release, ended = threading.Event(), threading.Event(), threading.Event()

    def helper():
        with d0.waiting("hvd.allreduce(name='metric')"):
            started.set()
            release.wait(10)
        ended.set()

    with d0.waiting("hvdp.opt0.b0"):
        t = threading.Thread(target=helper)
        t.start()
        assert started.wait(10)
        clock.t += 3
        release.set()
        assert ended.wait(10)
        t.join(10)
        clock.t += 7.1                              # the main thread's wait: 10.1 s
        assert d0.check() and down0 == ["down"] and "at hvdp.opt0.b0:" in d0.message


def test_a_wait_stops_when_another_rank_says_it_is_ending(tmp_path):
    # rank 1 failed with an uncaught error: it reports, marks "ending" and shuts Horovod down; where
    # that shutdown never reaches rank 0 (seen rarely), rank 0's wait would last forever: after
    # ENDING_AFTER_S its watchdog finds the mark and shuts Horovod down here
    board, clock = DirBoard(str(tmp_path / "b")), Clock()
    d0, down0 = dog(board, 0, size=2, clock=clock)
    rep1 = FailureReporter(lambda: 1, board, wait_s=0, get_size=lambda: 2, shutdown=lambda: None, linger_s=0.01)
    rep1.install = None  # not installed: no hooks in the test process
    with d0.waiting("hvdp.opt0.hvdp#present"):
        clock.t += 5
        assert not d0.check() and down0 == []          # no mark: a wait like any other
        rep1.report(ValueError("boom"), "uncaught in the training script")
        rep1._size = 2
        rep1.linger()                                  # the mark, before its own shutdown
        clock.t -= 4.5                                 # a wait younger than ENDING_AFTER_S: not yet
        assert not d0.check() and down0 == []
        clock.t += 4.5
        assert not d0.check() and down0 == ["down"]    # Horovod shut down here; the watchdog goes on
        assert not d0.check() and down0 == ["down"]    # once
    assert d0.message is None                          # not a stall: the wait's error is explained as usual


def test_an_ending_mark_of_this_rank_or_from_before_is_no_reason(tmp_path):
    board = DirBoard(str(tmp_path / "b"))
    rep = FailureReporter(lambda: 0, board, wait_s=0)
    board.put("ending", json.dumps({"rank": 0, "time": 2e9}).encode())
    assert rep.ending_rank(since=1e9) is None          # its own
    board.put("ending", json.dumps({"rank": 1, "time": 1.5e9}).encode())
    assert rep.ending_rank(since=1.6e9) is None        # older than this process's watchdog
    assert rep.ending_rank(since=1.4e9) == 1
    board.put("ending", b"not json")
    assert rep.ending_rank(since=0) is None


def test_a_shutdown_that_does_not_return_after_the_mark_ends_the_process(tmp_path, monkeypatch, capsys):
    from hvdp.cluster import ending
    monkeypatch.setattr(ending, "ENDING_SHUTDOWN_S", 0.2)
    board = DirBoard(str(tmp_path / "b"))
    board.post(1, b'{"rank": 1, "host": "h", "time": 1, "where": "x", "type": "ValueError", "error": "boom"}')
    stuck = threading.Event()
    rep = FailureReporter(lambda: 0, board, wait_s=0, shutdown=lambda: stuck.wait(5))
    exits = []
    rep._exit = exits.append
    rep.stop_waiting(1, "hvdp.opt0.b0")  # the reporter's own shutdown
    stuck.set()
    err = capsys.readouterr().err
    assert exits == [1] and "did not shut down within 0.2 s while this rank waited at hvdp.opt0.b0" in err
    assert "ending the process (exit 1)" in err
