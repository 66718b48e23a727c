"""The flight record beyond hvdp's own reductions: elastic worlds (each attempt of ``hvd.elastic.run``
counts anew, so workers that joined at a reset meet the others), blocking calls recorded around
(user collectives through hvdp, the elastic state's broadcasts), collectives counted outside
Python (a traced Keras step's), and the dump of a failed attempt."""
import json
import os
import re

import pytest

from hvdp.cluster import elastic, flight, trace
from hvdp.cluster.flight import FIELDS

from unit.test_flight import recorder


def test_a_new_world_numbers_collectives_alike_on_an_old_and_a_joined_worker(monkeypatch):
    # an elastic reset: the worker there from the start has done 40 steps, the one that joined
    # none; from the next attempt both count from 0, so the trace meets their collectives
    old, new = recorder(rank=0), recorder(rank=1)
    for _ in range(40):
        old.end(old.start("hvdp.opt0.a2a.b0", "int8", "alltoall", 64))
    for rec in (old, new):
        rec.new_world()
        rec.end(rec.start("hvdp.opt0.a2a.b0", "int8", "alltoall", 64))
        rec.start("hvdp.opt0.ag.b0", "int8", "allgather", 16)      # rank 2 killed: no dump
    assert old.snapshot()["resets"] == 1 and old.started == new.started == {"hvdp.opt0.a2a.b0": 1,
                                                                             "hvdp.opt0.ag.b0": 1}
    dumps = {r: dict(d, records=[dict(zip(d["fields"], x)) for x in d["records"]])
             for r, d in ((0, old.snapshot()), (1, new.snapshot()))}  # as trace.load reads them
    div = trace.analyse(dumps, size=3)
    assert div.key == ("hvdp.opt0.ag.b0", 0) and div.by_state == {"started": [0, 1], "unknown": [2]}


def test_around_records_a_blocking_call_and_its_failure():
    rec = recorder()
    with rec.around("hvd.allgather_object", "allgather_object"):
        pass
    with pytest.raises(RuntimeError):
        with rec.around("hvd.elastic.broadcast_object", "broadcast_object"):
            raise RuntimeError("Horovod has been shut down")
    rows = [dict(zip(FIELDS, r)) for r in rec.snapshot()["records"]]
    assert [(r["name"], r["phase"], r["state"]) for r in rows] == [
        ("hvd.allgather_object", "allgather_object", "done"),
        ("hvd.elastic.broadcast_object", "broadcast_object", "failed")]


def test_elastic_attempts_start_a_new_world_and_record_the_state_broadcast(monkeypatch):
    rec = recorder()
    monkeypatch.setattr(flight, "RECORDER", rec)

    class State:  # Horovod's State keeps the broadcast its commit and sync use in _bcast_object
        def __init__(self):
            self._bcast_object = lambda obj: obj

        def commit(self):
            return self._bcast_object(("host", "update"))

    state, seen = State(), []

    def train(state):
        seen.append(dict(rec.started))
        state.commit()
        return state.commit()
    attempt = elastic.recorded_attempts(train)
    rec.end(rec.start("before", "none", "x", 1))
    assert attempt(state) == ("host", "update")
    assert attempt(state) == ("host", "update")  # a second attempt: wrapped once, counted anew
    assert seen == [{}, {}] and rec.resets == 2
    assert rec.started == rec.finished == {"hvd.elastic.broadcast_object": 2}


def test_user_collectives_through_hvdp_are_in_the_record(monkeypatch):
    from hvdp.cluster import watchdog
    rec = recorder()
    monkeypatch.setattr(watchdog, "FLIGHT", rec)
    d = watchdog.StallWatchdog(0, lambda: 0, lambda: 2, None, lambda: None, start_thread=False)

    def allgather_object(obj, name=None):
        return [obj, obj]
    watched = d.watched(allgather_object)
    assert watched(1) == [1, 1] and watched(2, name="ids") == [2, 2]
    assert rec.finished == {"hvd.allgather_object": 1, "hvd.allgather_object(name='ids')": 1}


def test_an_elastic_attempt_that_fails_dumps_one_that_is_interrupted_does_not(monkeypatch, tmp_path):
    rec = recorder(directory=str(tmp_path))
    monkeypatch.setattr(flight, "RECORDER", rec)

    class HostsUpdatedInterrupt(RuntimeError):  # Horovod's: hosts were added, nothing failed
        pass

    def interrupted(state):
        rec.start("hvdp.opt0.a2a.b0", "int8", "alltoall", 64)
        raise HostsUpdatedInterrupt()

    def failed(state):
        rec.start("hvdp.opt0.a2a.b0", "int8", "alltoall", 64)
        raise RuntimeError("Horovod has been shut down")
    with pytest.raises(HostsUpdatedInterrupt):
        elastic.recorded_attempts(interrupted)(object())
    assert not os.listdir(tmp_path)
    with pytest.raises(RuntimeError):
        elastic.recorded_attempts(failed)(object())
    with open(tmp_path / "rank-0.json") as f:
        d = json.load(f)
    reason = d["reasons"][0]["reason"]
    assert "elastic attempt ended: RuntimeError: Horovod has been shut down" in reason
    # where it was raised, innermost first: the failing call's line, then its caller's
    assert re.search(r"\(raised unit/test_flight_worlds\.py:\d+ in failed <- cluster/elastic\.py:\d+ in attempt\)$",
                     reason), reason
    assert d["started"] == {"hvdp.opt0.a2a.b0": 1} and d["resets"] == 2


def test_collectives_counted_outside_python_are_in_the_dump_and_the_new_world():
    # a traced Keras step counts its reductions in two variables; rank 2 was killed in the 3rd
    # reduction of the world that began at the reset (after 5 before it)
    ranks = {}
    for r in (0, 1):
        rec, counts = recorder(rank=r, size=3), [5, 5]
        rec.count_outside("hvdp.keras.traced_step", lambda c=counts: tuple(c))
        rec.new_world()
        counts[:] = [8, 7]
        ranks[r] = rec.snapshot()
        assert ranks[r]["started"] == {"hvdp.keras.traced_step": 3}
        assert ranks[r]["finished"] == {"hvdp.keras.traced_step": 2}
    dumps = {r: dict(d, records=[dict(zip(d["fields"], x)) for x in d["records"]]) for r, d in ranks.items()}
    div = trace.analyse(dumps, size=3)
    assert div.key == ("hvdp.keras.traced_step", 2) and div.by_state == {"started": [0, 1], "unknown": [2]}
