"""Horovod's own path on horovod.torch (``hvdp.reduce.reducer.PlainPath``), for the gradients hvdp does
not reduce in two phases: compress (a cast, or the user's Horovod compressor), sum/average with
Horovod's allreduce (one grouped allreduce for a group), decompress. Sparse gradients go
through Horovod's sparse allreduce.
"""
from typing import Any, List, NamedTuple, Optional

import horovod.torch as _hvd
import torch

from hvdp.reduce.collectives import SUM

from .comm import synchronize
from .tensors import SUMMABLE, for_sum, write_back


class Pending(NamedTuple):
    handle: Any              # shared by the tensors of one grouped allreduce
    waited: list             # [bool], shared likewise: Horovod's handle is waited on once
    stand_in: torch.Tensor   # what Horovod reduces in place (see tensors.for_sum)
    sent: torch.Tensor       # the compressed gradient
    ctx: Any                 # the compressor's context
    dtype: torch.dtype
    name: str                # the collective's name (the stall watchdog's message)


class SparsePending(NamedTuple):
    handle: Any
    dtype: torch.dtype
    name: str


class TorchPlain:
    """Example::

        plain = TorchPlain(comm, op="average", predivide=1.0)
        (pend, nbytes), = plain.submit([p.grad], "fc.weight", "float16")
        p.grad.copy_(plain.finish(pend))
    """

    def __init__(self, comm, op: str, predivide: float, compressor=None):
        self.comm, self.predivide, self.compressor = comm, predivide, compressor
        self.op = _hvd.Sum if op == SUM else _hvd.Average

    def is_sparse(self, g) -> bool:
        return g.is_sparse

    def dense(self, g):
        return g.to_dense() if g.is_sparse else g

    def submit(self, grads: List[torch.Tensor], name: str, wire: Optional[str]) -> list:
        name = self.comm.scope + ("group#" if len(grads) > 1 else "") + name
        if len(grads) == 1 and grads[0].is_sparse:
            g = grads[0]
            v = g if g.dtype in SUMMABLE else g.float()  # bf16 values travel as float32
            h = _hvd.sparse_allreduce_async(v, name=name, op=self.op, process_set=self.comm.process_set)
            return [(SparsePending(h, g.dtype, name), 4 * g.numel())]
        tensors, sent, ctxs = [], [], []
        for g in grads:
            if self.compressor is not None:
                t, ctx = self.compressor.compress(g)
            elif wire not in (None, "float32") and g.is_floating_point():
                t, ctx = g.to(getattr(torch, wire)), None
            else:
                t, ctx = g, None
            # Horovod sums contiguous tensors of a few dtypes only: a bf16 or channels_last /
            # transposed tensor goes through a stand-in, written back after the reduction
            tensors.append(for_sum(t))
            sent.append(t)
            ctxs.append(ctx)
        kw = dict(op=self.op, prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide,
                  process_set=self.comm.process_set)
        if len(tensors) > 1:
            h = _hvd.grouped_allreduce_async_(tensors, name=name, **kw)
        else:
            h = _hvd.allreduce_async_(tensors[0], name=name, **kw)
        waited = [False]
        return [(Pending(h, waited, s, t, ctx, g.dtype, name), t.numel() * t.element_size())
                for s, t, ctx, g in zip(tensors, sent, ctxs, grads)]

    def finish(self, pend) -> torch.Tensor:
        if isinstance(pend, SparsePending):  # Horovod hands back a function to call
            h = pend.handle
            return synchronize(h, pend.name).to(pend.dtype)
        if not pend.waited[0]:
            pend.waited[0] = True
            synchronize(pend.handle, pend.name)
        write_back(pend.sent, pend.stand_in)
        if self.compressor is not None:
            return self.compressor.decompress(pend.sent, pend.ctx)
        return pend.sent if pend.sent.dtype == pend.dtype else pend.sent.to(pend.dtype)
