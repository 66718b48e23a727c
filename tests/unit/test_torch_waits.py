"""hvdp.torch's wait for Horovod's collectives (hvdp.torch.waits) without processes: the sleeps
between polls, the patch of Horovod's wait and its switch. Its effect on a waiting rank's CPU
time is checked in a real job (tests/parallel/workers/torch_wait_checks.py)."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("horovod.torch")

from horovod.torch import mpi_ops  # noqa: E402

import hvdp.torch  # noqa: E402,F401  (installs the wait)
from hvdp.torch import waits  # noqa: E402


def test_the_wait_sleeps_doubling_up_to_its_cap(monkeypatch):
    answers = iter([False] * 7 + [True])
    slept = []
    monkeypatch.setattr(waits._hvd, "poll", lambda handle: next(answers))
    monkeypatch.setattr(waits.time, "sleep", slept.append)
    waits.wait_done(3)
    assert slept == pytest.approx([20e-6, 40e-6, 80e-6, 160e-6, 250e-6, 250e-6, 250e-6])
    slept.clear()
    monkeypatch.setattr(waits._hvd, "poll", lambda handle: True)
    waits.wait_done(3)  # already finished: no sleep at all
    assert slept == []


def test_a_handle_horovod_no_longer_knows_is_left_to_horovods_own_wait(monkeypatch):
    def unknown(handle):
        raise ValueError("Handle 9 was not created or has been cleared.")
    monkeypatch.setattr(waits._hvd, "poll", unknown)
    monkeypatch.setattr(waits.time, "sleep", lambda s: pytest.fail("slept on an unknown handle"))
    waits.wait_done(9)  # returns: Horovod's wait that follows raises its own error for the handle


def test_import_puts_the_sleeping_wait_before_horovods_once(monkeypatch):
    lib = mpi_ops.mpi_lib
    patched = lib.horovod_torch_wait_and_clear
    assert patched.hvdp_sleeping and patched.spinning.__name__ == "horovod_torch_wait_and_clear"
    assert waits.install() is False and lib.horovod_torch_wait_and_clear is patched  # not twice
    calls = []

    def horovods(handle):
        calls.append(("horovod", handle))
    monkeypatch.setattr(lib, "horovod_torch_wait_and_clear", horovods)
    monkeypatch.setattr(waits, "wait_done", lambda h: calls.append(("poll", h)))
    assert waits.install() is True
    lib.horovod_torch_wait_and_clear(5)
    assert calls == [("poll", 5), ("horovod", 5)]


def test_hvdp_sleeping_wait_0_keeps_horovods_spinning_wait(monkeypatch):
    lib = mpi_ops.mpi_lib
    patched = lib.horovod_torch_wait_and_clear
    monkeypatch.setattr(lib, "horovod_torch_wait_and_clear", patched.spinning)
    monkeypatch.setenv("HVDP_SLEEPING_WAIT", "0")
    assert waits.install() is False and lib.horovod_torch_wait_and_clear is patched.spinning
    monkeypatch.setenv("HVDP_SLEEPING_WAIT", "1")
    assert waits.install() is True and lib.horovod_torch_wait_and_clear.hvdp_sleeping
