"""Failure reports between ranks (hvdp.cluster.failures), with a directory board and a fake KV store."""
import http.server
import os
import stat
import sys
import tempfile
import threading
import time

import pytest

from hvdp.cluster.boards import DirBoard, KVBoard, board_from_env
from hvdp.cluster import reports
from hvdp.cluster.failures import FailureReporter
from hvdp.cluster.reports import explain
from hvdp.private import Refused


class HorovodInternalError(RuntimeError):
    """Same name as Horovod's: the reporter recognises it by name, without importing Horovod."""


SHUT = "Horovod has been shut down. This was caused by an exception on one of the ranks"


def test_cause_is_reported_and_survivor_names_it(tmp_path):
    board = DirBoard(str(tmp_path / "b"))
    failing, survivor = FailureReporter(lambda: 1, board), FailureReporter(lambda: 0, board, wait_s=0)
    cause = ValueError("shape mismatch in layer 3")
    assert failing.explained(cause) is cause            # a cause stays itself, but is reported
    new = survivor.explained(HorovodInternalError(SHUT))
    assert type(new) is HorovodInternalError            # elastic code catches by type
    msg = str(new)
    assert msg.startswith("hvdp: rank 1 (host ")
    assert "in hvdp's gradient reduction" in msg and "ValueError: shape mismatch in layer 3" in msg
    assert msg.rstrip().endswith(SHUT)
    assert survivor.explained(new) is new                # explained once


def test_a_rank_does_not_explain_with_its_own_report_and_nobody_reported(tmp_path):
    board = DirBoard(str(tmp_path / "b"))
    me = FailureReporter(lambda: 0, board, wait_s=0)
    me.report(ValueError("mine"), "x")
    msg = str(me.explained(RuntimeError(SHUT)))
    assert "no other rank reported an error" in msg and "stall inspector" in msg


def test_consequences_are_never_reported_and_once_only(tmp_path):
    board = DirBoard(str(tmp_path / "b"))
    r = FailureReporter(lambda: 2, board)
    r.report(HorovodInternalError("x"), "x")
    r.report(RuntimeError(SHUT), "x")
    assert board.read() == []
    e = KeyError("k")
    r.report(e, "first")
    r.report(e, "second")
    (only,) = reports.parse_reports(board.read(), exclude_rank=0)
    assert only["where"] == "first" and only["rank"] == 2


@pytest.mark.parametrize("message, failed", [
    # the survivor's error in a CI run where a peer was killed mid-step (Keras-TF, elastic, Gloo)
    ("[/tmp/hvdp-horovod-x/horovod-0.28.1/third_party/compatible17_gloo/gloo/transport/tcp/pair.cc:589]"
     " Read error [127.0.0.1]:31157: Connection reset by peer\n\t [[{{node cond/hvdp.ar.sequential/"
     "dense/bias}}]] [Op:__inference_step_1958]", True),
    ("Timed out waiting 30000ms\n\t [[{{node hvdp.ar.dense/kernel}}]] [Op:__inference_step_7]", True),
    (SHUT + ", or an attempt to allreduce ...", True),
    ("something\n\t [[{{node HorovodAllreduce_grads_0}}]]", True),
    ("Incompatible shapes: [8,4] vs. [8,3]\n\t [[{{node sequential/dense/BiasAdd}}]]", False),
    ("input must be 4-dimensional [[{{node my_hvdp.conv}}]]", False),
    ("", False),
])
def test_collective_failures_are_told_from_the_users_own_errors(message, failed):
    assert reports.collective_failed(message) is failed


def test_stale_reports_are_ignored():
    old = reports.make_report(1, ValueError("old"), "x", now=0.0)
    assert reports.parse_reports([old, b"not json"], exclude_rank=0, now=reports.MAX_AGE_S + 1) == []


def test_rank_is_remembered_after_horovod_is_gone(tmp_path):
    state = {"up": True}

    def rank():
        if not state["up"]:
            raise ValueError("Horovod has not been initialized")
        return 3

    r = FailureReporter(rank, DirBoard(str(tmp_path)))
    r.install()
    state["up"] = False
    assert r.rank() == 3


def test_excepthook_reports_causes_and_explains_shutdowns(tmp_path, monkeypatch, capsys):
    board = DirBoard(str(tmp_path / "b"))
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[1]))
    FailureReporter(lambda: 1, board).install()
    e = ZeroDivisionError("boom")
    sys.excepthook(type(e), e, None)
    assert seen == [e]
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[1]))
    FailureReporter(lambda: 0, board, wait_s=0).install()
    s = RuntimeError(SHUT)
    sys.excepthook(type(s), s, None)
    err = capsys.readouterr().err
    assert "rank 1" in err and "ZeroDivisionError: boom" in err and seen[-1] is s


def _failed_rank(board, linger_s, calls):
    r = FailureReporter(lambda: 1, board, get_size=lambda: 3, shutdown=lambda: calls.append("down"),
                        linger_s=linger_s)
    r._rank, r._size = 1, 3  # what install() reads while Horovod is up
    r.report(ValueError("boom"), "x")
    return r


def test_a_failed_rank_lingers_until_the_others_are_done(tmp_path):
    board, calls = DirBoard(str(tmp_path / "b")), []
    failed = _failed_rank(board, linger_s=10.0, calls=calls)
    survivors = [FailureReporter(lambda r=r: r, board, wait_s=0) for r in (0, 2)]
    for s in survivors:
        s.rank()

    def finish():
        for s in survivors:
            s.explained(RuntimeError(SHUT))
            s.mark_done()
    timer = threading.Timer(0.3, finish)
    timer.start()
    waited = failed.linger()
    timer.join()
    assert calls == ["down"]              # Horovod shut down first: the survivors' collectives fail
    assert 0.25 <= waited < 5.0, waited    # released by the marks, not by the bound


def test_linger_is_bounded_and_ignores_stale_marks(tmp_path):
    board, calls = DirBoard(str(tmp_path / "b")), []
    board.mark_done(0, b'{"rank": 0, "time": 0.0}')   # from an earlier failure (elastic)
    failed = _failed_rank(board, linger_s=0.4, calls=calls)
    assert 0.4 <= failed.linger() < 3.0                # nobody marked: the bound ends it
    assert FailureReporter(lambda: 0, board, linger_s=5.0).linger() == 0.0  # did not fail itself


def test_a_stuck_shutdown_ends_the_failed_rank_instead_of_hanging(tmp_path, capsys):
    """Seen once under MPI: the failed rank's own Horovod shutdown never returned, so it never
    exited and the launcher never stopped the job. Past ``shutdown_s`` the rank says so and ends."""
    board, exits, stuck = DirBoard(str(tmp_path / "b")), [], threading.Event()
    r = FailureReporter(lambda: 1, board, get_size=lambda: 3, shutdown=stuck.wait, linger_s=10.0,
                        shutdown_s=0.3)
    r._rank, r._size = 1, 3
    r._exit = exits.append
    r.report(ValueError("boom"), "x")
    t0 = time.monotonic()
    r.linger()
    assert exits == [1] and 0.3 <= time.monotonic() - t0 < 3.0
    assert "Horovod's shutdown after this rank's error did not finish within 0.3 s" in capsys.readouterr().err
    stuck.set()
    # a shutdown that returns in time: no exit, the linger goes on as before
    ok = _failed_rank(board, linger_s=0.2, calls=[])
    ok._exit = exits.append
    assert ok.linger() >= 0.2 and exits == [1]


def test_failed_ranks_do_not_wait_for_each_other(tmp_path):
    board = DirBoard(str(tmp_path / "b"))
    a = _failed_rank(board, linger_s=10.0, calls=[])
    b = FailureReporter(lambda: 0, board, get_size=lambda: 2, linger_s=10.0)
    b.rank()
    b._size = 2
    b.report(ValueError("mine too"), "x")      # a rank that failed itself marks done when it reports
    a._size = 2
    assert a.linger() < 3.0 and b.linger() < 3.0


def test_an_error_after_explaining_another_ranks_failure_does_not_linger(tmp_path):
    """Seen in a kept flight record: a remote rank explained Horovod's shutdown (rank 0 had
    failed), then its print to the closed ssh session raised BrokenPipeError, which it reported
    as its own failure and lingered the whole bound for marks that nobody would leave."""
    board = DirBoard(str(tmp_path / "b"))
    first = FailureReporter(lambda: 0, board, get_size=lambda: 3, linger_s=10.0)
    first.rank()
    first._size = 3
    first.report(ValueError("the cause"), "x")
    late = FailureReporter(lambda: 2, board, get_size=lambda: 3, shutdown=lambda: None, linger_s=10.0)
    late.rank()
    late._size = 3
    assert "rank 0" in str(late.explained(RuntimeError(SHUT)))
    late.report(BrokenPipeError("[Errno 32] Broken pipe"), "print")
    t0 = time.monotonic()
    assert late.linger() == 0.0 and time.monotonic() - t0 < 1.0
    assert [r["rank"] for r in first.reports()] == [2]  # its report is still on the board
    # a rank that explained nothing lingers as before
    alone = _failed_rank(DirBoard(str(tmp_path / "c")), linger_s=0.3, calls=[])
    assert alone.linger() >= 0.3


class _Store(http.server.BaseHTTPRequestHandler):
    """The two verbs of horovodrun's rendezvous store that the board uses."""
    data = {}

    def do_PUT(self):
        self.data[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        v = self.data.get(self.path)
        self.send_response(404 if v is None else 200)
        self.send_header("Content-Length", str(len(v or b"")))
        self.end_headers()
        self.wfile.write(v or b"")

    def log_message(self, *a):
        pass


@pytest.fixture
def kv_store():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Store)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address
    srv.shutdown()
    _Store.data.clear()


def test_kv_board_roundtrip_and_env_choice(kv_store, tmp_path):
    addr, port = kv_store
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}
    board = board_from_env(env)
    assert isinstance(board, KVBoard) and board.read() == []
    FailureReporter(lambda: 1, board).report(OSError("disk full"), "x")
    assert "OSError: disk full" in str(FailureReporter(lambda: 0, board, wait_s=0).explained(RuntimeError(SHUT)))
    assert board.read_done(0) is None and board.read_done(1) is not None  # marked by the report
    mpi = board_from_env({"PMIX_NAMESPACE": "job-7"})
    assert isinstance(mpi, DirBoard) and mpi.path == board_from_env({"PMIX_NAMESPACE": "job-7"}).path
    assert board_from_env({"PMIX_NAMESPACE": "job-7", "HVDP_FAILURE_BOARD": "0"}) is None
    assert board_from_env({}) is None


def test_explain_without_rank():
    assert explain("x", [], None).startswith("hvdp: this rank saw Horovod shut down")


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a directory of another uid needs root")
def test_a_board_directory_another_account_made_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {"OMPI_MCA_ess_base_jobid": "4242"}
    good = board_from_env(env)                 # the path the job's ranks share
    planted = good.path
    os.mkdir(planted, 0o777)
    os.chmod(planted, 0o777)
    os.chown(planted, 12345, 12345)            # another account made it first
    with pytest.warns(UserWarning, match="no failure reports between ranks.*owned by uid 12345"):
        assert board_from_env(env) is None
    with pytest.raises(Refused, match="owned by uid 12345"):
        DirBoard(planted).read()
    with pytest.raises(Refused):
        DirBoard(planted).post(0, b"{}")       # nothing is written into it either
    assert os.listdir(planted) == []


def test_a_board_directory_is_private_and_group_writable_ones_are_refused(tmp_path):
    b = DirBoard(str(tmp_path / "b"))
    b.post(1, b"{}")
    assert stat.S_IMODE(os.stat(b.path).st_mode) == 0o700
    os.chmod(b.path, 0o770)
    with pytest.raises(Refused, match="writable by group"):
        b.read()
    link = tmp_path / "link"
    os.chmod(b.path, 0o700)
    os.symlink(b.path, link)
    with pytest.raises(Refused, match="symbolic link"):
        DirBoard(str(link)).read()


def test_a_failed_rank_lingers_longer_than_a_survivor_needs_to_speak():
    """A survivor that Horovod's shutdown does not reach finds the failed rank's "ending" mark once
    a wait is ENDING_AFTER_S old, then gives its own shutdown ENDING_SHUTDOWN_S before it explains
    and exits. The failed rank must still be there by then: the launcher stops every other rank as
    soon as it exits (a CI run of 2026-12-06: rank 0 killed with exit 137, no word, 3 s linger)."""
    from hvdp.cluster import ending, failures, watchdog
    assert failures.LINGER_S > watchdog.ENDING_AFTER_S + ending.ENDING_SHUTDOWN_S + 2.0
    assert failures.SHUTDOWN_S > watchdog.ENDING_AFTER_S + ending.ENDING_SHUTDOWN_S


def test_a_stall_lingers_only_as_long_as_asked(tmp_path):
    """The stall watchdog's report lingers STALL_LINGER_S, not the reporter's whole linger: the
    ranks it names did not arrive and would not mark "done" (a stalled Keras check lingered 15 s)."""
    board = DirBoard(str(tmp_path / "b"))
    r = FailureReporter(lambda: 1, board, get_size=lambda: 3, shutdown=lambda: None, linger_s=10.0)
    r._rank, r._size = 1, 3
    r.report(RuntimeError("stalled"), "in hvdp's stall watchdog", linger_s=0.3)
    assert 0.3 <= r.linger() < 3.0
