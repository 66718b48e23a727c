"""Horovod's own path, for the gradients hvdp does not reduce in two phases: compress (a cast,
or the user's Horovod compressor), sum/average with Horovod's allreduce (one grouped allreduce
for a group), decompress into ``p.grad``. Sparse gradients go through Horovod's sparse allreduce.
"""
from typing import Any, List, NamedTuple, Optional, Set

import horovod.torch as _hvd
import torch

from hvdp.collectives import SUM
from hvdp.stats import WireStats, ring_allreduce_bytes

from .tensors import SUMMABLE, for_sum, write_back


class Pending(NamedTuple):
    handle: Any              # shared by the tensors of one grouped allreduce
    stand_in: torch.Tensor   # what Horovod reduces in place (see tensors.for_sum)
    sent: torch.Tensor       # the compressed gradient
    ctx: Any                 # the compressor's context


class SparsePending(NamedTuple):
    handle: Any


def _op(op: str):
    return _hvd.Sum if op == SUM else _hvd.Average


def submit(grads: List[torch.Tensor], name: str, wire: Optional[torch.dtype], compressor, op: str,
           predivide: float, comm, stats: WireStats, label: str) -> List[Pending]:
    """Start one allreduce (grouped if several gradients); ``wire``: the cast's dtype or None."""
    tensors, sent, ctxs = [], [], []
    for g in grads:
        if compressor is not None:
            t, ctx = compressor.compress(g)
        elif wire is not None and g.is_floating_point():
            t, ctx = g.to(wire), g.dtype
        else:
            t, ctx = g, None
        # Horovod sums contiguous tensors of a few dtypes only: a bf16 or channels_last /
        # transposed tensor goes through a stand-in, written back after the reduction
        tensors.append(for_sum(t))
        sent.append(t)
        ctxs.append(ctx)
        nbytes = t.numel() * t.element_size()
        stats.record(label, g.numel(), nbytes, ring_allreduce_bytes(nbytes, comm.size),
                     ring_allreduce_bytes(4 * g.numel(), comm.size))
    kw = dict(op=_op(op), prescale_factor=1.0 / predivide, postscale_factor=predivide,
              process_set=comm.process_set)
    if len(tensors) > 1:
        h = _hvd.grouped_allreduce_async_(tensors, name=name, **kw)
    else:
        h = _hvd.allreduce_async_(tensors[0], name=name, **kw)
    return [Pending(h, s, t, ctx) for s, t, ctx in zip(tensors, sent, ctxs)]


def submit_sparse(grad: torch.Tensor, name: str, op: str, comm) -> SparsePending:
    g = grad if grad.dtype in SUMMABLE else grad.float()  # bf16 values travel as float32
    return SparsePending(_hvd.sparse_allreduce_async(g, name=name, op=_op(op), process_set=comm.process_set))


def finish(p: torch.Tensor, pend, compressor, waited: Set[int]) -> None:
    """Wait (once per handle) and put the reduced gradient into ``p.grad``."""
    if isinstance(pend, SparsePending):  # Horovod hands back a function to call
        h = pend.handle
        p.grad = (h() if callable(h) else _hvd.synchronize(h)).to(p.grad.dtype)
        return
    if id(pend.handle) not in waited:
        waited.add(id(pend.handle))
        _hvd.synchronize(pend.handle)
    write_back(pend.sent, pend.stand_in)
    if compressor is not None:
        p.grad.copy_(compressor.decompress(pend.sent, pend.ctx))
    elif pend.sent is not p.grad:
        p.grad.copy_(pend.sent)
