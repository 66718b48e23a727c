"""The ranks-agree check and failure reports on the backend's Horovod; the logic is the core's
(``hvdp.cluster.agreement``, ``hvdp.cluster.failures``), this file only supplies the collective and the variables."""
import horovod
import numpy as np

from hvdp import __version__

from hvdp.cluster import agreement
from hvdp.cluster.failures import FailureReporter
from hvdp.cluster.watchdog import StallWatchdog

from .backend import BACKEND as B

VERSIONS = {"hvdp": __version__, "horovod": horovod.__version__}
REPORTER = FailureReporter.for_horovod(B.hvd)
# the ranks-agree check's waits, the user's module collectives (functions.watched), the
# TensorFlow backend's reductions (B.watch); on torch, horovod.torch's watchdog times the reductions
WATCHDOG = StallWatchdog(None, B.hvd.rank, B.hvd.size, REPORTER, B.hvd.shutdown)


def allgather_fixed(process_set=B.hvd.global_process_set):
    """``(data, name) -> [every rank's bytes]`` on Horovod's allgather (equal lengths), run
    eagerly even while a train step is being traced, under the stall watchdog."""
    def gather(data: bytes, name: str):
        with WATCHDOG.waiting(name):  # the ranks-agree check (hvdp.agree.*), the levels' exchange
            out = B.allgather_np(np.frombuffer(data, np.uint8).reshape(1, -1), name, process_set)
        return [row.tobytes() for row in out]
    return gather


def variable_entries(variables, names):
    return [(n, tuple(v.shape), str(getattr(v.dtype, "name", v.dtype)), bool(getattr(v, "trainable", True)))
            for n, v in zip(names, variables)]


def check_broadcast(variables, names, root_rank, process_set) -> None:
    if process_set.size() <= 1:
        return
    desc = agreement.describe(variable_entries(variables, names), versions=VERSIONS, root_rank=root_rank)
    agreement.check(desc, allgather_fixed(process_set), "the variables given to broadcast_variables",
                    what="variable", name="hvdp.agree.broadcast")
