"""Codecs fused by ``torch.compile``: the same core code, traced into one kernel per direction.

Eagerly, each array op of a codec is a pass over memory (int8 encode is about five); compiled,
the passes fuse. Opt in with ``DistributedOptimizer(..., compile_codecs=True)`` or
``HVDP_COMPILE_CODECS=1``: the first step of each bucket size pays the compilation (tens of
seconds on a small CPU). The traced ops take the codec's general path (the fast-path guards
answer False), whose results are identical.
"""
import torch

from .ops import TorchOps


class _TracedOps(TorchOps):
    def all_finite(self, x):
        return False

    def all_nonnegative(self, x):
        return False


class CompiledCodec:
    """Wraps a codec; encode / decode run compiled, everything else is the codec's own."""

    def __init__(self, codec):
        self.inner = codec
        ops = _TracedOps()
        # static shapes: one kernel per bucket chunk size (measured faster than dynamic=True)
        self._encode = torch.compile(lambda x: codec.encode(ops, x), dynamic=False)
        self._decode = torch.compile(lambda b, n: codec.decode(ops, b, n), dynamic=False)

    def __getattr__(self, name):  # name, summable, align, payload_nbytes, ...
        return getattr(self.inner, name)

    def __str__(self):
        return str(self.inner)

    def encode(self, ops, x):
        return self._encode(x)

    def decode(self, ops, payload, n):
        return self._decode(payload, n)
