"""The ranks-agree check's collective, failure reports and the stall watchdog on horovod.torch;
the logic is the core's (``hvdp.cluster.agreement``, ``hvdp.cluster.failures``,
``hvdp.cluster.watchdog``; an optimizer's description is its engine's)."""
import horovod
import horovod.torch as _hvd
import torch

from hvdp import __version__

from hvdp.cluster import agreement
from hvdp.cluster.failures import FailureReporter
from hvdp.cluster.watchdog import StallWatchdog

from .tensors import broadcast_

VERSIONS = {"hvdp": __version__, "horovod": horovod.__version__}
# An elastic survivor resets at once: it does not wait for another rank's report.
REPORTER = FailureReporter.for_horovod(_hvd, elastic_wait_s=0.0)
# A deadline on hvdp's waits (HVDP_STALL_TIMEOUT_SECONDS): a stalled rank ends the job, over Gloo too.
WATCHDOG = StallWatchdog(None, _hvd.rank, _hvd.size, REPORTER, _hvd.shutdown)


def allgather_fixed(process_set=_hvd.global_process_set):
    """``(data, name) -> [every rank's bytes]`` on Horovod's allgather (equal lengths), under the
    stall watchdog."""
    def gather(data: bytes, name: str):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, -1)
        with WATCHDOG.waiting(name):  # the ranks-agree check (hvdp.agree.*), the levels' exchange
            out = _hvd.allgather(t, name=name, process_set=process_set)
        return [bytes(row.numpy().tobytes()) for row in out]
    return gather


def broadcast_parameters(params, root_rank, process_set=_hvd.global_process_set):
    """Horovod's ``broadcast_parameters``, after checking that every rank passes the same tensor
    names, shapes and dtypes (a difference would hang or fail on one rank only)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}; pass model.state_dict(), "
                         "list(model.named_parameters()) or list(model.parameters())")
    if process_set.size() > 1:
        desc = agreement.describe([(k if k is not None else f"#{i}", tuple(t.shape),
                                    str(t.dtype).replace("torch.", ""), True)
                                   for i, (k, t) in enumerate(items)], versions=VERSIONS,
                                  root_rank=root_rank)
        agreement.check(desc, allgather_fixed(process_set), "the tensors given to broadcast_parameters",
                        what="tensor", name="hvdp.agree.broadcast")
    with WATCHDOG.waiting("hvd.broadcast_parameters"):  # all submitted at once: one wait
        broadcast_(items, root_rank, process_set)  # any dtype (bf16) and layout (channels_last)
