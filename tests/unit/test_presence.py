"""The torch adapter's per-step presence sum in the flight record: its record ends when Horovod has
finished the sum (found by a poll that never waits), so a rank failing between two steps does not
make the others' record name a sum long done; a failure found by the poll is raised where the wait
always was. A submit Horovod refused (it shut down after a rank died) is recorded as refused, for
the presence sum and for the join control (``StepControl``), the first collectives of a step: a
rank killed between two steps is then named there (the kill loop's random kills)."""
import importlib

import pytest
import torch

from hvdp.torch import presence
from hvdp.cluster import flight

join = importlib.import_module("hvdp.torch.join")  # the module (hvdp.torch.join is also hvd.join)


class FakeHorovod:
    """Horovod's async allreduce, poll and synchronize; ``done`` / ``fails`` say how each handle ends."""
    Sum = "sum"

    def __init__(self):
        self.submitted, self.done, self.fails, self.waited, self.down = [], set(), set(), [], False

    def allreduce_async_(self, x, name, op, process_set):
        if self.down:  # what Horovod's submit raises once it has shut down
            raise ValueError("Horovod has been shut down")
        self.submitted.append(name)
        return len(self.submitted) - 1

    def poll(self, handle):
        return handle in self.done or handle in self.fails

    def synchronize(self, handle):
        self.waited.append(handle)
        if handle in self.fails:
            raise RuntimeError("Horovod has been shut down")


class Comm:
    size, scope, process_set = 2, "hvdp.opt0.", None


@pytest.fixture
def fake(monkeypatch):
    hvd, rec = FakeHorovod(), flight.FlightRecorder(capacity=16, directory="unused")
    monkeypatch.setattr(presence, "_hvd", hvd)
    monkeypatch.setattr(presence, "FLIGHT", rec)
    monkeypatch.setattr(join, "_hvd", hvd)
    monkeypatch.setattr(join, "FLIGHT", rec)
    monkeypatch.setattr("hvdp.torch.comm._hvd", hvd)
    return hvd, rec


def states(rec):
    return [(r[flight.NAME], r[flight.NTH], r[flight.STATE]) for r in rec.snapshot()["records"]]


def test_the_sum_is_recorded_and_ends_when_a_poll_finds_it_done(fake):
    hvd, rec = fake
    p = presence.Presence(Comm())
    p.submit([True, False], torch.device("cpu"))
    p.finish_if_done()  # not done yet: no wait, still in flight
    assert hvd.waited == [] and states(rec) == [("hvdp.opt0.hvdp#present", 0, flight.STARTED)]
    hvd.done.add(0)
    p.finish_if_done()  # done: its record ends now, not when the next step waits
    assert hvd.waited == [0] and states(rec) == [("hvdp.opt0.hvdp#present", 0, flight.DONE)]
    p.submit([True, True], torch.device("cpu"))  # nothing left to wait for
    assert hvd.waited == [0] and rec.started == {"hvdp.opt0.hvdp#present": 2}


def test_a_sum_never_finished_stays_in_flight_where_the_rank_waits(fake):
    # a rank killed before it submitted the sum: the next step's wait is where the others stop
    hvd, rec = fake
    p = presence.Presence(Comm())
    p.submit([True], torch.device("cpu"))
    hvd.fails.add(0)
    with pytest.raises(RuntimeError, match="shut down"):
        p.submit([True], torch.device("cpu"))
    assert states(rec) == [("hvdp.opt0.hvdp#present", 0, flight.FAILED)]


def test_a_failure_found_by_the_poll_is_raised_at_the_wait(fake):
    hvd, rec = fake
    p = presence.Presence(Comm())
    p.submit([False], torch.device("cpu"))
    hvd.fails.add(0)
    p.finish_if_done()  # in a gradient hook: no error there
    assert states(rec) == [("hvdp.opt0.hvdp#present", 0, flight.FAILED)]
    with pytest.raises(RuntimeError, match="shut down"):
        p.nobody_had([0])
    p.reset()
    p.submit([True], torch.device("cpu"))  # a new step after the reset: no error left over
    assert hvd.submitted == ["hvdp.opt0.hvdp#present"] * 2


def test_one_rank_sends_nothing(fake):
    hvd, rec = fake
    p = presence.Presence(type("One", (Comm,), {"size": 1})())
    p.submit([True], torch.device("cpu"))
    p.finish_if_done()
    assert hvd.submitted == [] and rec.snapshot()["records"] == [] and p.nobody_had([0]) == [False]


def test_a_failed_step_leaves_a_finished_sum_done_and_one_in_flight_started(fake):
    # the step fails in a later reduction (a rank died): the sum Horovod had finished before
    # must not read as the place the ranks parted; one still in flight is left as it was
    hvd, rec = fake
    p = presence.Presence(Comm())
    p.submit([True], torch.device("cpu"))
    hvd.done.add(0)
    p.reset()
    p.submit([True], torch.device("cpu"))
    p.reset()
    assert states(rec) == [("hvdp.opt0.hvdp#present", 0, flight.DONE),
                           ("hvdp.opt0.hvdp#present", 1, flight.STARTED)]


def test_a_sum_horovod_refused_is_recorded_as_refused(fake):
    hvd, rec = fake
    hvd.down = True
    with pytest.raises(ValueError, match="shut down"):
        presence.Presence(Comm()).submit([True], torch.device("cpu"))
    assert states(rec) == [("hvdp.opt0.hvdp#present", 0, flight.REFUSED)]


def test_the_join_control_is_recorded_done_failed_or_refused(fake):
    hvd, rec = fake
    name = "hvdp.opt0.hvdp.join.active"
    c = join.StepControl(Comm())
    c.begin()
    assert states(rec) == [(name, 0, flight.STARTED)]
    hvd.done.add(0)
    c.end_step()
    c.begin()
    hvd.fails.add(1)
    with pytest.raises(RuntimeError, match="shut down"):
        c.active()
    c.reset()
    hvd.down = True
    with pytest.raises(ValueError, match="shut down"):
        c.begin()
    assert states(rec) == [(name, 0, flight.DONE), (name, 1, flight.FAILED), (name, 2, flight.REFUSED)]
