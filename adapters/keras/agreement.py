"""The ranks-agree check and failure reports on the backend's Horovod; the logic is the core's
(``hvdp.agreement``, ``hvdp.failures``), this file only supplies the collective and the variables."""
import os

import horovod
import numpy as np

from hvdp import __version__, agreement
from hvdp.failures import FailureReporter

from .backend import BACKEND as B

VERSIONS = {"hvdp": __version__, "horovod": horovod.__version__}
REPORTER = FailureReporter.for_horovod(B.hvd)


def allgather_fixed(process_set=B.hvd.global_process_set):
    """``(data, name) -> [every rank's bytes]`` on Horovod's allgather (equal lengths), run
    eagerly even while a train step is being traced."""
    def gather(data: bytes, name: str):
        out = B.allgather_np(np.frombuffer(data, np.uint8).reshape(1, -1), name, process_set)
        return [row.tobytes() for row in out]
    return gather


def variable_entries(variables, names):
    return [(n, tuple(v.shape), str(getattr(v.dtype, "name", v.dtype)), bool(getattr(v, "trainable", True)))
            for n, v in zip(names, variables)]


def compression_name(reducer) -> str:
    c = getattr(reducer, "hvd_compressor", None)
    if getattr(reducer, "auto_settings", None) is not None:  # the setting, not one rank's measurements
        return str(reducer.auto_settings)
    return str(reducer.codec) if c is None else f"horovod:{getattr(c, '__qualname__', type(c).__name__)}"


def check_reducer(reducer, variables, at_build: bool = False) -> None:
    """Every rank's reducer must reduce the same variables the same way.

    In an elastic job a worker that joins later builds its optimizer alone, so a check there
    would wait for ranks that never come: there ``KerasState.sync`` (every rank) checks instead.
    """
    if reducer.comm.size <= 1 or (at_build and os.environ.get("HOROVOD_ELASTIC") == "1"):
        return
    desc = agreement.describe(variable_entries(variables, reducer.names), reducer.plan.buckets, VERSIONS,
                              compression=compression_name(reducer), policy=repr(reducer.policy), op=reducer.op,
                              gradient_predivide_factor=reducer.predivide,
                              sparse_as_dense=reducer.sparse_as_dense, size=reducer.comm.size,
                              **reducer.settings)
    agreement.check(desc, allgather_fixed(reducer.comm.process_set), "the DistributedOptimizer",
                    what="variable", name="hvdp.agree.optimizer")


def check_broadcast(variables, names, root_rank, process_set) -> None:
    if process_set.size() <= 1:
        return
    desc = agreement.describe(variable_entries(variables, names), versions=VERSIONS, root_rank=root_rank)
    agreement.check(desc, allgather_fixed(process_set), "the variables given to broadcast_variables",
                    what="variable", name="hvdp.agree.broadcast")
