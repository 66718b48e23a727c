"""The ranks-agree check and failure reports on horovod.torch; the logic is the core's
(``hvdp.agreement``, ``hvdp.failures``), this file only supplies the collective and the tensors."""
import os

import horovod
import horovod.torch as _hvd
import torch

from hvdp import __version__, agreement
from hvdp.failures import FailureReporter

from .tensors import broadcast_

VERSIONS = {"hvdp": __version__, "horovod": horovod.__version__}
# An elastic survivor resets at once: it does not wait for another rank's report.
REPORTER = FailureReporter.for_horovod(_hvd, elastic_wait_s=0.0)


def allgather_fixed(process_set=_hvd.global_process_set):
    """``(data, name) -> [every rank's bytes]`` on Horovod's allgather (equal lengths)."""
    def gather(data: bytes, name: str):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, -1)
        out = _hvd.allgather(t, name=name, process_set=process_set)
        return [bytes(row.numpy().tobytes()) for row in out]
    return gather


def _entry(name, t):
    return name, tuple(t.shape), str(t.dtype).replace("torch.", ""), bool(t.requires_grad)


def elastic() -> bool:
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def check_optimizer(opt, at_creation: bool = False) -> None:
    """Every rank's hvdp optimizer must reduce the same tensors the same way.

    In an elastic job a worker that joins later makes its optimizer alone, so a check there
    would wait for ranks that never come: there the state's ``sync`` (every rank, at the start
    and after each reset) checks instead.
    """
    if opt._comm.size <= 1 or (at_creation and elastic()):
        return
    tensors = [_entry(opt._all_names[id(p)], p) for g in opt.param_groups for p in g["params"]]
    groups = sorted({tuple(opt._name[p] for p in g) for g in opt._groups.values()})
    desc = agreement.describe(
        tensors, opt._plan.buckets, VERSIONS,
        compression=str(opt._codec) if opt._codec is not None else type(opt._hvd_compressor).__name__,
        policy=repr(opt._policy), backward_passes_per_step=opt._bpps, op=opt._op,
        gradient_predivide_factor=opt._predivide, sparse_as_dense=opt._sparse_as_dense,
        groups=groups, size=opt._comm.size,
        instance=opt._instance,  # its collectives' names: optimizers made in another order hang
        uneven_inputs=getattr(opt, "_join", None) is not None)  # hvdp.join's per-step control
    agreement.check(desc, allgather_fixed(opt._comm.process_set), "the DistributedOptimizer",
                    name="hvdp.agree.optimizer")


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
    broadcast_(items, root_rank, process_set)  # any dtype (bf16) and layout (channels_last)
