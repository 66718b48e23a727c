"""Horovod's blocking module collectives as hvdp.torch re-exports them: each call under the stall
watchdog (``hvdp.cluster.watchdog``), so that a rank that never arrives at a user's
``hvd.allreduce`` is named within the deadline instead of every other rank waiting forever.
The ``*_async`` forms return at once; their wait is ``synchronize``, which is watched."""
import horovod.torch as _hvd

from .agreement import WATCHDOG
from .functions import broadcast_optimizer_state

# every blocking collective horovod.torch exports (hvd.join is hvdp's own: hvdp.torch.join)
BLOCKING = ("allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
            "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
            "grouped_reducescatter", "broadcast_object", "allgather_object", "barrier", "synchronize")


def watched_collectives() -> dict:
    """name -> Horovod's collective (hvdp's ``broadcast_optimizer_state``), watched."""
    found = {n: getattr(_hvd, n) for n in BLOCKING if hasattr(_hvd, n)}
    found["broadcast_optimizer_state"] = broadcast_optimizer_state
    return {n: WATCHDOG.watched(fn) for n, fn in found.items()}
