"""Waiting for Horovod's torch collectives without spinning.

Horovod's wait (``synchronize``, and every blocking collective of horovod.torch through it) spins:
a loop of thread yields, the GIL dropped and retaken each turn, a whole core for as long as the
collective is in flight. Where ranks share cores with each other, with a data loader or with
Horovod's and Gloo's own threads, that core is taken from the work the wait is for. ``install``
(on ``import hvdp.torch``, unless ``HVDP_SLEEPING_WAIT=0``) makes every such wait in the process
sleep between polls instead: 20 us at first, doubling up to ``MAX_SLEEP_S``, so a finished
collective is seen at most that late. The handle's own wait then runs as before (it returns at
once, or raises Horovod's error for the collective)."""
import time

import horovod.torch as _hvd
from horovod.torch import mpi_ops as _mpi_ops

from hvdp import config

FIRST_SLEEP_S, MAX_SLEEP_S = 20e-6, 250e-6


def wait_done(handle) -> None:
    """Return once Horovod's collective ``handle`` has finished or failed (or Horovod no longer
    knows it: its own wait then says why), sleeping between polls."""
    delay = FIRST_SLEEP_S
    try:
        while not _hvd.poll(handle):
            time.sleep(delay)
            delay = min(2 * delay, MAX_SLEEP_S)
    except Exception:  # noqa: BLE001  the handle's own wait raises Horovod's error for it
        return


def install() -> bool:
    """Put ``wait_done`` before Horovod's wait for every handle of this process (once); False
    where ``HVDP_SLEEPING_WAIT=0`` keeps Horovod's spinning wait."""
    lib = _mpi_ops.mpi_lib
    if not config.sleeping_wait() or getattr(lib.horovod_torch_wait_and_clear, "hvdp_sleeping", False):
        return False
    spinning = lib.horovod_torch_wait_and_clear

    def wait_and_clear(handle):
        wait_done(handle)
        return spinning(handle)

    wait_and_clear.hvdp_sleeping = True
    wait_and_clear.spinning = spinning
    lib.horovod_torch_wait_and_clear = wait_and_clear
    return True
