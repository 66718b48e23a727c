"""hvdp.cluster.exits: a rank's normal end waits (bounded) for the others where process sets smaller
than the job are in use. The two-node job (tests/parallel/test_two_node.py) checks it on Horovod."""
import sys
import threading
import time

import pytest

from hvdp.cluster import exits, mesh


@pytest.fixture
def fresh(monkeypatch):
    """The module's per-process state emptied, atexit registrations collected instead of made."""
    registered = []
    monkeypatch.setattr(exits, "_MEET", [])
    monkeypatch.setattr(exits, "_DONE", [])
    monkeypatch.setattr(exits.atexit, "register", registered.append)
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    monkeypatch.delenv("HVDP_EXIT_WAIT_SECONDS", raising=False)
    for name in ("last_value", "last_exc"):
        monkeypatch.delattr(sys, name, raising=False)
    return registered


def test_arm_once_and_not_in_elastic_jobs(fresh, monkeypatch):
    exits.arm(lambda: None)
    exits.arm(lambda: None)
    assert exits.armed() and fresh == [exits.wait_for_the_others]
    monkeypatch.setattr(exits, "_MEET", [])
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    exits.arm(lambda: None)
    assert not exits.armed()


def test_the_wait_runs_once_and_returns_when_the_others_meet(fresh):
    met = []
    exits.arm(lambda: met.append(1))
    assert exits.wait_for_the_others() is True and met == [1]
    assert exits.wait_for_the_others() is None and met == [1]  # at exit after hvd.shutdown(): no second


def test_no_wait_unarmed_after_an_uncaught_error_or_when_off(fresh, monkeypatch):
    assert exits.wait_for_the_others() is None  # never armed
    calls = []
    exits.arm(lambda: calls.append(1))
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    assert exits.ended_by_error() and exits.wait_for_the_others() is None and calls == []
    monkeypatch.delattr(sys, "last_value")
    monkeypatch.setenv("HVDP_EXIT_WAIT_SECONDS", "0")
    assert exits.wait_for_the_others() is None and calls == []


def test_a_wait_past_the_bound_says_so_and_ends(fresh, monkeypatch, capsys):
    release = threading.Event()
    monkeypatch.setenv("HVDP_EXIT_WAIT_SECONDS", "1")
    exits.arm(lambda: release.wait(30))
    t0 = time.monotonic()
    assert exits.wait_for_the_others() is False
    assert 0.9 <= time.monotonic() - t0 < 10
    release.set()
    err = capsys.readouterr().err
    assert "had not ended 1 s later (HVDP_EXIT_WAIT_SECONDS)" in err, err


def test_a_failed_meet_is_no_wait(fresh):
    def shut_down():
        raise ValueError("Horovod has been shut down")
    exits.arm(shut_down)
    assert exits.wait_for_the_others() is None  # at once: the meet raised
    assert exits.meet_within(shut_down, 5) is None


def test_shutdown_waits_first_and_keeps_horovods_signature(fresh):
    import inspect
    order = []

    def shutdown(*args, **kwargs):  # horovod.torch's: shutdown(*args, **kwargs)
        order.append("shutdown")
    exits.arm(lambda: order.append("meet"))
    ours = exits.ending(shutdown)
    ours()
    assert order == ["meet", "shutdown"] and ours.__name__ == "shutdown"
    assert list(inspect.signature(ours).parameters) == ["args", "kwargs"]


def test_bad_setting_is_named_by_the_doctor(monkeypatch):
    from hvdp.config import problems
    monkeypatch.setenv("HVDP_EXIT_WAIT_SECONDS", "soon")
    assert any("HVDP_EXIT_WAIT_SECONDS" in p for p, _ in problems())


class _Sets:
    """register_groups' Horovod (hvdp.cluster.mesh.HorovodSets) with dynamic process sets."""

    def __init__(self, meet):
        self.made = []
        self.hv = mesh.HorovodSets(lambda: 0, lambda: 4, lambda g: tuple(g), self.add, "GLOBAL", meet)

    def add(self, ps):
        self.made.append(ps)
        return ps


def test_registering_smaller_groups_arms_the_wait(fresh, monkeypatch):
    monkeypatch.setattr(mesh, "_KNOWN", {})
    monkeypatch.setattr(mesh, "_registered", lambda ps: ps is not None)
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    sets = _Sets(meet=lambda: None)
    mesh.register_groups(sets.hv, [[0, 1, 2, 3]], "test", "(static)")
    assert not exits.armed()  # the whole job only: nothing can be cut short
    mesh.register_groups(sets.hv, [[0, 1], [2, 3]], "test", "(static)")
    assert exits.armed() and fresh == [exits.wait_for_the_others]
