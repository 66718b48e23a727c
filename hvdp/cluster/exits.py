"""Ranks end together where hvdp made process sets smaller than the job.

Horovod shuts the whole job down as soon as one rank ends (its exit handler, or the script's own
``hvd.shutdown()``; the coordinator passes the shutdown on to every rank), and a collective still
pending on another rank then fails with "Horovod has been shut down". A collective over the whole
job cannot be cut short that way: a rank ends only after its last one, which every rank is in. One
over a smaller process set can: the last part of every two-level step (``hierarchical=True``) is an
allgather inside the node, so a node that finished its last step first could end while another
node was still in that part of the same step. Seen on a lossy link (tests/parallel/bad_network.py,
two-level at 5% loss): node A's ranks ended cleanly, node B's raised at their last step.

So once hvdp has registered process sets smaller than the job (a two-level reduction, a
``ProcessMesh``: :func:`arm`, the same on every rank), a rank that ends normally first meets the
others in one collective over the whole job, waiting for it at most ``HVDP_EXIT_WAIT_SECONDS``
(default 30; 0: off), at its exit or in the adapters' ``hvd.shutdown()``. It completes when every
rank has finished its script. A rank that ends much earlier than the others (a shorter loop) waits
out the bound, says so, and ends as it would have without the wait (the others then see Horovod
shut down, that much later). No wait where the rank ends by an uncaught error (it reports and
shuts Horovod down at once, ``hvdp.cluster.failures``), where Horovod is shut down already (the
collective fails at once), or in an elastic job (workers leave it one by one; hvdp makes no
smaller process sets there).
"""
from __future__ import annotations

import atexit
import functools
import sys
import threading
from typing import Callable, List, Optional

from ..config import HVDP_EXIT_WAIT_SECONDS, elastic_mode, exit_wait_s
from .flight import DONE, FAILED, RECORDER as FLIGHT

_MEET: List[Callable[[], None]] = []  # the armed collective over the whole job (at most one)
_DONE: List[bool] = []                # the wait ran in this process


def arm(meet: Callable[[], None]) -> None:
    """Make this process's normal end wait for ``meet()``: a blocking collective over the whole
    job (``hvd.barrier()``, an allreduce of one number). Once per process; not in elastic jobs."""
    if _MEET or elastic_mode():
        return
    _MEET.append(meet)
    atexit.register(wait_for_the_others)  # runs before Horovod's exit handler (registered at init)


def armed() -> bool:
    return bool(_MEET)


def ended_by_error() -> bool:
    """Whether the interpreter is ending with an uncaught exception (it sets ``sys.last_value``
    before the exception hook runs)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def meet_within(meet: Callable[[], None], timeout_s: float, name: str = "hvdp-exit") -> Optional[bool]:
    """``meet()`` in a thread of its own (named ``name``): True where it returned within
    ``timeout_s``, False where it did not (the thread is left to Horovod's shutdown, which fails
    it), None where it raised."""
    done, ok = threading.Event(), []

    def run():
        try:
            meet()
            ok.append(True)
        except BaseException:  # Horovod shut down already, or not started
            pass
        finally:
            done.set()
    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(timeout_s):
        return False
    return True if ok else None


def wait_for_the_others() -> Optional[bool]:
    """The wait itself, once per process (at exit, or before the adapters' ``hvd.shutdown()``).
    -> what :func:`meet_within` said, or None where no wait was due."""
    if not _MEET or _DONE or ended_by_error():
        return None
    _DONE.append(True)
    try:
        timeout = exit_wait_s()
    except ValueError as e:  # a bad value is no reason to end differently: say it, use the default
        print(f"hvdp: {e}; waiting 30 s for the other ranks at exit", file=sys.stderr, flush=True)
        timeout = 30
    if timeout <= 0:
        return None
    rec = FLIGHT.start("hvdp.exit", "none", "exit", 4)  # named in a trace of a job that ended badly
    met = meet_within(_MEET[0], timeout)
    if met is not False:  # a wait cut short stays "started" in the record
        FLIGHT.end(rec, DONE if met else FAILED)
    if met is False:
        msg = (f"hvdp: this rank ended, and the other ranks had not ended {timeout} s later "
               f"({HVDP_EXIT_WAIT_SECONDS}): ending without them; Horovod shuts down under any "
               "collective they still run")
        FLIGHT.dump(msg)
        print(msg, file=sys.stderr, flush=True)
    return met


def ending(shutdown: Callable[..., None]) -> Callable[..., None]:
    """Horovod's ``shutdown`` as the adapters offer it (its signature, which ``inspect`` reads
    through ``__wrapped__``): the wait for the other ranks first."""
    @functools.wraps(shutdown)
    def shutdown_after_the_others(*args, **kwargs) -> None:
        wait_for_the_others()
        shutdown(*args, **kwargs)
    shutdown_after_the_others.__doc__ = (shutdown.__doc__ or "") + (
        "\n\nhvdp: where process sets smaller than the job are in use, it first waits (at most "
        "HVDP_EXIT_WAIT_SECONDS) for the other ranks to end (hvdp.cluster.exits).")
    return shutdown_after_the_others
