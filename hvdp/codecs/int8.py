"""Blockwise absmax 8-bit quantisation: one float32 scale per block of ``block_size`` values.

q = round(x / s) with s = max|x| / 127 over the block, so |x - q*s| <= s/2 (half a step).
A non-finite input element is sent as the spare code -128 and decodes to NaN at its position:
quantisation never hides an inf/NaN, and the finite elements of its block keep their accuracy.
Such a block is flagged by a negative stored scale, so blocks without one decode in two passes.
"""
from dataclasses import dataclass

from .base import Codec, register

_NONFINITE = -128
_TINY = 1e-38  # flag magnitude for a flagged block whose finite elements are all zero (its scale is 0)


def _per_block_scale(ops, absmax, qmax=127.0):
    """absmax / qmax, correctly rounded on every framework and device.

    The divisor is an array, not a Python number: torch on CUDA turns division by a Python
    scalar into multiplication by its reciprocal, which differs from the division in the last
    bit for some values (seen on an H200: payloads of the CUDA path differed from numpy's).
    """
    return absmax / (ops.zeros(1, "float32", like=absmax) + qmax)


def quantise_blocks(ops, x2, qmax, nonfinite):
    """Blockwise absmax codes of the rows of ``x2``: (codes in [-qmax, qmax] as floats, with
    ``nonfinite`` where an element is not finite; the stored float32 scales, negative for a
    block holding a non-finite element). Shared by int8 and int4."""
    absmax = ops.amax_rows(ops.abs(x2))  # an inf/NaN in a block makes its absmax non-finite
    if ops.all_finite(absmax):
        scale = _per_block_scale(ops, absmax, qmax)
        safe = ops.where(scale > 0, scale, 1.0)
        # |x| <= absmax bounds |q| by qmax, except where the scale is a subnormal float (absmax
        # below ~1.5e-36): its rounding can make the quotient qmax + 1, which must not wrap
        return ops.clip(ops.round(x2 / ops.reshape(safe, (-1, 1))), -qmax, qmax), scale
    finite = ops.isfinite(x2)
    scale = _per_block_scale(ops, ops.amax_rows(ops.where(finite, ops.abs(x2), 0.0)), qmax)
    safe = ops.where(scale > 0, scale, 1.0)
    q = ops.clip(ops.round(x2 / ops.reshape(safe, (-1, 1))), -qmax, qmax)
    q = ops.where(finite, q, float(nonfinite))
    flagged = ops.amax_rows(ops.where(finite, 0.0, 1.0)) > 0
    # a flagged block stores -scale (decoded by |stored|: the codes' own scale, however small),
    # or -_TINY where its scale is 0 (all its finite elements are zero): -0.0 is no flag
    return q, ops.where(flagged, -ops.where(scale > 0, scale, _TINY), scale)


def dequantise_blocks(ops, q2, stored, nonfinite):
    """Codes (floats, one block a row) times their blocks' scales; NaN where a flagged block
    holds the ``nonfinite`` code. -> a flat float32 array."""
    n = ops.size(q2)
    if ops.all_nonnegative(stored):
        return ops.reshape(q2 * ops.reshape(stored, (-1, 1)), (n,))
    out = q2 * ops.reshape(ops.abs(stored), (-1, 1))
    return ops.reshape(ops.where(q2 == float(nonfinite), float("nan"), out), (n,))


@register
@dataclass(frozen=True)
class Int8(Codec):
    name = "int8"
    error_feedback_default = True
    block_size: int = 256

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 4 or self.block_size % 4:
            raise ValueError(f"int8 block_size must be a positive multiple of 4, got {self.block_size!r}")

    @property
    def align(self):
        return self.block_size

    def payload_nbytes(self, n):
        return n + 4 * (n // self.block_size)

    def encode(self, ops, x):
        n = ops.size(x)
        q, stored = quantise_blocks(ops, ops.reshape(x, (n // self.block_size, self.block_size)), 127.0, _NONFINITE)
        return ops.cat([ops.to_bytes(ops.cast(q, "int8")), ops.to_bytes(ops.cast(stored, "float32"))])

    def decode(self, ops, payload, n):
        q = ops.cast(ops.from_bytes(payload[:n], "int8"), "float32")
        stored = ops.from_bytes(payload[n:], "float32")
        return dequantise_blocks(ops, ops.reshape(q, (n // self.block_size, self.block_size)), stored, _NONFINITE)
