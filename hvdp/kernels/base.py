"""The contract of a fused codec kernel: the phases of one codec, each one pass over memory.

A kernel is another implementation of a codec's phases (encode with error feedback, decode and
sum P payloads, decode), chosen per device when it can run. The codec's array-op path in
``hvdp.codecs`` stays the reference: every result of a kernel is bit-identical to it, so the
two-phase reducer gives the same bytes with or without a kernel.

Backends (``hvdp.kernels.cpu``, the torch adapter's CUDA kernel) register a provider in
``hvdp.kernels.registry``; the reducer asks ``select(codec, ops, like)`` and falls back to the
array ops when no provider serves.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from ..codecs.base import Codec

Array = Any


class Unavailable(Exception):
    """Raised by a kernel provider that cannot serve (no compiler, a device it does not handle);
    the message says why and how to fix it."""


@runtime_checkable
class CodecKernels(Protocol):
    """Fused phases of one codec (int8 with a given block_size; bf16; fp16) on one device.

    Every result is bit-identical to the codec's array-op path (``hvdp/codecs/*``), the reference.

    Example::

        k = select(get("int8"), NumpyOps(), x)          # None: use the array ops
        payload = k.encode(x, prev=r, residual=r)       # r updated in place
        y = k.decode(payload, x.size)
    """

    codec: Codec  # the codec these kernels implement
    path: str     # e.g. "cpu-c", "cuda-triton": shown by doctor and compression_stats()

    def encode(self, x: Array, prev: Optional[Array] = None, residual: Optional[Array] = None,
               out: Optional[Array] = None) -> Array:
        """Encode one chunk.

        Args:
            x: float32 chunk of length c (a multiple of ``codec.align``); not modified.
            prev: float32[c] or None. The encoded value is y = x + prev, added in float32 exactly
                like the reference ``x + prev``; not modified.
            residual: float32[c] or None. When given, receives y - decode(payload), with
                non-finite results replaced by 0 (``hvdp.reduce.residuals.finite_or_zero``'s rule). It must
                not overlap x or prev (the reducer writes a new residual each step: a snapshot
                of the old one, e.g. an elastic commit, stays valid).
            out: uint8 array of ``codec.payload_nbytes(c)`` bytes (e.g. a slice of a send
                buffer) or None.

        Returns:
            The uint8 payload (``out`` when given), bytes equal to ``codec.encode(ops, y)``.
        """
        ...

    def decode_sum(self, payloads: Array, p: int, c: int, scale: float = 1.0) -> Array:
        """Decode P payloads and sum them, in one pass.

        Args:
            payloads: uint8 array of ``p * codec.payload_nbytes(c)`` bytes (payloads back to back).
            p: number of payloads.
            c: chunk length.
            scale: multiplies the sum at the end (1.0: no multiplication).

        Returns:
            float32[c] = (decode(payload_0) + ... + decode(payload_{p-1})) * scale, summed in that
            fixed order in float32 (bit-identical to the reducer's ``add_`` loop then ``mul_``).
        """
        ...

    def decode(self, payload: Array, c: int, out: Optional[Array] = None) -> Array:
        """Decode one payload into ``out`` (float32[c], e.g. a slice of the final flat buffer) or
        a new array; bit-identical to ``codec.decode(ops, payload, c)``."""
        ...
