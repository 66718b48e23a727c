"""The flight record (hvdp/cluster/flight.py), what records it (hvdp/reduce/recorded.py) and the
trace that merges the ranks' dumps (hvdp/cluster/trace.py): the ring, the dump, signals, and
the analysis on simulated workers and on synthetic dumps (a stall, a killed rank, a failed wait,
records pushed out of the ring, another job's dumps)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hvdp import codecs
from hvdp.cluster import flight, trace
from hvdp.cluster.flight import FlightRecorder
from hvdp.ops import NumpyOps
from hvdp.reduce import recorded
from hvdp.reduce.engine import Engine
from hvdp.reduce.plan import CompressionPolicy
from hvdp.reduce.settings import ReduceSettings
from hvdp.reduce.simcomm import FakeGroup

from unit.test_engine import NAMES, SHAPES, NumpyPlain, gather, grads_of, step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        self.t += 0.001
        return self.t


def recorder(rank=0, size=2, capacity=64, directory=None, clock=None):
    rec = FlightRecorder(capacity, directory, clock=clock or Clock())
    rec.attach(lambda: rank, lambda: size)
    return rec


def test_ring_keeps_the_last_n_and_counts_every_one():
    rec = recorder(capacity=3)
    recs = [rec.start("a" if i % 2 == 0 else "b", "int8", "alltoall", 100 + i, step=i) for i in range(5)]
    for r in recs[:4]:
        rec.end(r)
    rec.end(recs[4], flight.FAILED)
    snap = rec.snapshot()
    rows = [dict(zip(snap["fields"], r)) for r in snap["records"]]
    assert [r["seq"] for r in rows] == [3, 4, 5]                    # the last three
    assert [(r["name"], r["nth"]) for r in rows] == [("a", 1), ("b", 1), ("a", 2)]
    assert [r["state"] for r in rows] == ["done", "done", "failed"]
    assert rows[0]["bytes"] == 102 and rows[0]["step"] == 2 and rows[0]["end"] > rows[0]["start"]
    assert snap["started"] == {"a": 3, "b": 2} and snap["finished"] == {"a": 2, "b": 2}
    rec.end(recs[4])  # a record ends once
    assert rec.finished == {"a": 2, "b": 2}


def test_a_rank_ended_by_sigterm_names_the_collective_it_was_in():
    # horovodrun SIGTERMs every rank once one exited (a rank SIGKILLed inside a reduction): the
    # survivor's last words name where it was, that the launcher stopped it, and its record
    rec = recorder(rank=2)
    rec.end(rec.start("hvdp.opt0.b0", "int8", "alltoall", 100))
    rec.start("hvdp.opt0.b0", "int8", "allgather", 50)
    msg = rec.ended_message("SIGTERM", "/d/rank-2.json")
    assert msg.startswith("hvdp: rank 2 ended by SIGTERM in hvdp.opt0.b0 #1 (allgather, started).")
    assert "the rank it names as the first to exit is the one that failed" in msg and "/d/rank-2.json" in msg
    quiet = recorder(rank=0)
    assert "ended by SIGTERM outside hvdp's collectives" in quiet.ended_message("SIGTERM", None)


def test_off_records_and_dumps_nothing(tmp_path):
    rec = recorder(capacity=0, directory=str(tmp_path))
    assert rec.start("a", "none", "allreduce", 4) is None
    rec.end(None)
    assert rec.dump("test") is None and os.listdir(tmp_path) == []


def test_dump_is_one_file_per_rank_replaced_with_every_reason(tmp_path):
    rec = recorder(rank=3, directory=str(tmp_path / "d"))
    rec.end(rec.start("a", "none", "allreduce", 4))
    p1 = rec.dump("stall watchdog: rank 1 did not arrive")
    rec.start("a", "none", "allreduce", 4)
    p2 = rec.dump("signal SIGTERM")
    assert p1 == p2 == str(tmp_path / "d" / "rank-3.json") and os.listdir(tmp_path / "d") == ["rank-3.json"]
    d = json.loads(open(p2).read())
    assert d["rank"] == 3 and d["size"] == 2 and len(d["records"]) == 2
    assert [x["reason"] for x in d["reasons"]] == ["stall watchdog: rank 1 did not arrive", "signal SIGTERM"]


def test_dump_of_an_unwritable_directory_says_so_and_does_not_raise(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    rec = recorder(directory=str(tmp_path / "file" / "sub"))
    assert rec.dump("x") is None
    assert "flight record not written" in capsys.readouterr().err


def workers(p, codec, monkeypatch, recs):
    """p engines on simulated workers, each recording into its own recorder."""
    settings = ReduceSettings(codecs.get(codec), CompressionPolicy(min_elements=100))
    out = []
    for c, rec in zip(FakeGroup(p).comms, recs):
        monkeypatch.setattr(recorded, "RECORDER", rec)
        out.append(Engine(settings, NumpyOps(), c, NumpyPlain(c, "average"), gather(c)))
    return out


def test_an_engine_records_every_collective_of_a_step(monkeypatch):
    recs = [recorder(r) for r in range(2)]
    engs = workers(2, "int8", monkeypatch, recs)
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4, tensors=[(n, s, "float32", True) for n, s in zip(NAMES, SHAPES)])
    step(engs, grads_of(2))
    rows = [dict(zip(flight.FIELDS, r)) for r in recs[0].snapshot()["records"]]
    phases = {(r["name"], r["phase"]) for r in rows}
    assert ("hvdp.agree.optimizer.digest", "allgather (bytes)") in phases          # the ranks-agree check
    assert ("hvdp.a2a.b0", "alltoall") in phases and ("hvdp.ag.b0", "allgather") in phases
    assert any(r["phase"].startswith("allreduce") for r in rows)            # the plain tensors
    a2a = next(r for r in rows if r["name"] == "hvdp.a2a.b0")
    assert a2a["codec"] == "int8" and a2a["state"] == "done" and 0 < a2a["bytes"] < 4 * (64 * 40 + 40 * 30)
    assert all(r["state"] == "done" for r in rows)


def dumps_of(recs, reasons):
    return {r: json.loads(json.dumps(rec.snapshot(reasons[r]))) | {
        "records": [dict(zip(flight.FIELDS, x)) for x in rec.snapshot()["records"]]}
        for r, rec in enumerate(recs) if reasons[r] is not None}


def test_simulated_stall_names_the_rank_and_collective(monkeypatch):
    # two steps on both workers, then worker 0 starts a third that worker 1 never reaches
    clock = Clock()
    recs = [recorder(r, clock=clock) for r in range(2)]
    engs = workers(2, "int8", monkeypatch, recs)
    for e in engs:
        e.set_layout(NAMES, SHAPES, [True] * 4)
    for s in range(2):
        step(engs, grads_of(2, s))
    engs[0].submit(grads_of(2, 9)[0])   # rank 0 waits here (its watchdog would fire)
    dumps = dumps_of(recs, ["stall watchdog", "signal SIGTERM"])
    div = trace.analyse(dumps)
    first = min((r for r in dumps[0]["records"] if r["state"] == "started"), key=lambda r: r["seq"])
    assert div.key == (first["name"], 2) and div.record["step"] == 2
    assert div.by_state == {"started": [0], "unreached": [1]}
    text, rc = trace.report(dumps)
    assert rc == 1 and f"first divergence: {first['name']} #2" in text
    assert "started, never finished: rank 0" in text and "never reached: rank 1 (last:" in text


def synthetic(rank, size, rows, started=None, finished=None, job="gloo:h:1", t=2000.0):
    recs = [dict(zip(flight.FIELDS, r)) for r in rows]
    counts = started or {}
    if started is None:
        for r in recs:
            counts[r["name"]] = max(counts.get(r["name"], 0), r["nth"] + 1)
    fin = finished if finished is not None else {
        n: sum(1 for r in recs if r["name"] == n and r["state"] == "done") for n in counts}
    return {"rank": rank, "size": size, "host": "h", "pid": 1, "job": job, "time": t,
            "reasons": [{"time": t, "reason": "test"}], "records": recs, "started": counts, "finished": fin}


def row(seq, name, nth, state, t0, step=0):
    return [seq, name, nth, "int8", "alltoall", 64, step, t0, None if state == "started" else t0 + 0.01, state]


def test_killed_rank_without_a_dump_is_named_where_the_others_wait():
    # rank 2 was SIGKILLed: no dump; ranks 0 and 1 wait in their 3rd a2a, after the 2nd allgather
    both = [row(1, "a2a", 0, "done", 1.0), row(2, "ag", 0, "done", 1.1), row(3, "a2a", 1, "done", 2.0),
            row(4, "ag", 1, "done", 2.1), row(5, "a2a", 2, "started", 3.0)]
    dumps = {0: synthetic(0, 3, both), 1: synthetic(1, 3, both)}
    div = trace.analyse(dumps)
    assert div.key == ("a2a", 2) and div.by_state == {"started": [0, 1], "unknown": [2]}
    text, rc = trace.report(dumps)
    assert rc == 1 and "no dump (killed" in text and "rank 2" in text.splitlines()[-1]


def test_records_pushed_out_of_the_ring_still_count():
    # rank 1's ring (capacity 2) lost its first a2a; its counters say it finished it
    r0 = synthetic(0, 2, [row(1, "a2a", 0, "done", 1.0), row(2, "ag", 0, "done", 1.1),
                          row(3, "a2a", 1, "started", 2.0)])
    r1 = synthetic(1, 2, [row(2, "ag", 0, "done", 1.1), row(3, "x", 0, "done", 1.9)],
                   started={"a2a": 1, "ag": 1, "x": 1}, finished={"a2a": 1, "ag": 1, "x": 1})
    r0["started"]["x"], r0["finished"]["x"] = 0, 0
    div = trace.analyse({0: r0, 1: r1})
    # rank 0 never reached x (rank 1 called another collective: order differs)
    assert div.key == ("x", 0) and div.by_state == {"done": [1], "unreached": [0]}


def test_a_failed_wait_and_the_no_divergence_case():
    ok = [row(1, "a2a", 0, "done", 1.0)]
    assert trace.report({0: synthetic(0, 2, ok), 1: synthetic(1, 2, ok)})[1] == 0
    failed = synthetic(1, 2, ok + [row(2, "ag", 0, "failed", 1.5)])
    div = trace.analyse({0: synthetic(0, 2, ok + [row(2, "ag", 0, "done", 1.5)]), 1: failed})
    assert div.key == ("ag", 0) and div.by_state == {"done": [0], "failed": [1]}


def test_load_keeps_the_newest_job(tmp_path):
    ok = [row(1, "a2a", 0, "done", 1.0)]
    for r, job, t in ((0, "gloo:h:1", 5.0), (1, "gloo:h:1", 5.1), (2, "gloo:h:0", 1.0)):
        d = synthetic(r, 3 if job.endswith("0") else 2, ok, job=job, t=t)
        d["fields"], d["records"] = list(flight.FIELDS), [[x[f] for f in flight.FIELDS] for x in d["records"]]
        (tmp_path / f"rank-{r}.json").write_text(json.dumps(d))
    (tmp_path / "rank-9.json").write_text("{not json")
    dumps, notes = trace.load(str(tmp_path))
    assert sorted(dumps) == [0, 1]
    assert any("another job" in n for n in notes) and any("rank-9.json unreadable" in n for n in notes)
    assert trace.main([str(tmp_path)]) == 0
    assert trace.main([str(tmp_path / "empty")]) == 2


SIGNALS = textwrap.dedent("""
    import os, signal, sys, time
    from hvdp.cluster.flight import FlightRecorder
    seen = []
    signal.signal(signal.SIGTERM, lambda n, f: seen.append(n))     # the user's handler
    rec = FlightRecorder(8, sys.argv[1])
    rec.attach(lambda: 0, lambda: 1)
    assert rec.install_signals()
    rec.start("a", "none", "allreduce", 4)
    os.kill(os.getpid(), signal.SIGUSR1)        # a dump, the process goes on
    time.sleep(0.5)
    assert os.path.exists(os.path.join(sys.argv[1], "rank-0.json"))
    os.kill(os.getpid(), signal.SIGTERM)        # a dump, then the user's handler
    time.sleep(0.5)
    assert seen == [signal.SIGTERM], seen
    rec._previous[signal.SIGTERM] = signal.SIG_DFL   # as if installed over the default:
    print("READY", flush=True)                  # a dump, then the process ends
    time.sleep(30)
""")


def test_signals_dump_and_hand_over_to_the_previous_handler(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", SIGNALS, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "READY", p.stderr.read()
    p.terminate()
    assert p.wait(timeout=20) in (-15, 128 + 15), p.stderr.read()
    reasons = [x["reason"] for x in json.loads((tmp_path / "rank-0.json").read_text())["reasons"]]
    assert reasons == ["signal SIGUSR1", "signal SIGTERM", "signal SIGTERM"]


@pytest.mark.parametrize("args", [[], ["a", "b"], ["--help"]])
def test_trace_usage(args, capsys):
    assert trace.main(args) == 2 and "usage: python -m hvdp trace DIR" in capsys.readouterr().err


class DownComm:
    """Collectives of a rank whose Horovod is down: every submit raises."""
    size, rank, scope = 2, 0, "s."

    def alltoall_async(self, buf, name):
        raise ValueError("Horovod has been shut down")


def test_a_submit_that_raises_is_recorded_as_refused():
    rec = recorder()
    comm = recorded.Recorded(DownComm(), NumpyOps(), codec=lambda: "int8", step=lambda: 4, recorder=rec)
    with pytest.raises(ValueError):
        comm.alltoall_async(np.zeros(8, np.float32), "a2a")
    (r,) = [dict(zip(flight.FIELDS, x)) for x in rec.snapshot()["records"]]
    assert (r["name"], r["nth"], r["state"], r["bytes"], r["step"]) == ("s.a2a", 0, "refused", 32, 4)


def test_where_the_ranks_parted_comes_before_what_was_in_flight():
    # rank 1 failed mid-reduction with "x" in flight; rank 0 finished "x" and went on to "ag",
    # which rank 1 never reached: "ag" is where they parted, although "x" started earlier
    r0 = synthetic(0, 2, [row(1, "x", 0, "done", 1.0), row(2, "a2a", 0, "done", 1.1), row(3, "ag", 0, "failed", 1.3)])
    r1 = synthetic(1, 2, [row(1, "x", 0, "started", 1.0), row(2, "a2a", 0, "done", 1.1)])
    div = trace.analyse({0: r0, 1: r1})
    assert div.key == ("ag", 0) and div.by_state == {"failed": [0], "unreached": [1]}
    # a stalled rank that came back once Horovod was down: refused where rank 0 waits
    r1 = synthetic(1, 2, [row(1, "x", 0, "done", 1.0), row(2, "a2a", 0, "refused", 9.0)])
    r0 = synthetic(0, 2, [row(1, "x", 0, "done", 1.0), row(2, "a2a", 0, "started", 1.1)])
    div = trace.analyse({0: r0, 1: r1})
    assert div.key == ("a2a", 0) and div.by_state == {"started": [0], "refused": [1]}
    text, rc = trace.report({0: r0, 1: r1})
    assert rc == 1 and "reached it only once Horovod was down (its submit failed): rank 1 (at" in text


LATER = textwrap.dedent("""
    import os, signal, sys, time
    from hvdp.cluster.flight import FlightRecorder
    rec = FlightRecorder(8, sys.argv[1])
    rec.attach(lambda: 0, lambda: 1)
    assert rec.install_signals()                 # over SIGTERM's default
    seen = []
    signal.signal(signal.SIGTERM, lambda n, f: seen.append(n))   # the user's, set later, wins
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    assert seen == [signal.SIGTERM], seen
    print("ALIVE", flush=True)
""")


def test_a_handler_set_later_is_not_overruled(tmp_path):
    r = subprocess.run([sys.executable, "-c", LATER, str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "ALIVE" in r.stdout, r.stderr


FORKED = textwrap.dedent("""
    import os, signal, sys, time
    from hvdp.cluster.flight import FlightRecorder
    rec = FlightRecorder(8, sys.argv[1])
    rec.attach(lambda: 0, lambda: 1)
    assert rec.install_signals()                 # over SIGTERM's default
    rec.start("a", "none", "allreduce", 4)
    pid = os.fork()                              # e.g. a data loader's worker
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(0.2)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)                 # the child ends at once, as by default ...
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert time.monotonic() - t0 < 1.5
    time.sleep(0.5)                              # ... and neither ends nor dumps the parent
    assert not os.path.exists(os.path.join(sys.argv[1], "rank-0.json"))
    print("ALIVE", flush=True)
""")


def test_a_forked_child_signal_does_not_reach_the_parent(tmp_path):
    r = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "ALIVE" in r.stdout, r.stderr

