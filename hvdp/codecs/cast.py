"""Dtype-cast codecs: none (float32), fp16 and bf16. One rounding, no per-worker state."""
from dataclasses import dataclass

from .base import Codec, register


class _Cast(Codec):
    dtype = "float32"
    itemsize = 4

    def payload_nbytes(self, n):
        return n * self.itemsize

    def encode(self, ops, x):
        return ops.to_bytes(ops.cast(x, self.dtype))

    def decode(self, ops, payload, n):
        return ops.cast(ops.from_bytes(payload, self.dtype), "float32")


@register
@dataclass(frozen=True)
class NoCompression(_Cast):
    """Gradients travel as float32 (Horovod's ``Compression.none``)."""
    name = "none"
    summable = True
    wire_dtype = "float32"

    @staticmethod
    def compress(tensor):
        """Horovod's ``Compression.none``: the tensor itself, no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


@register
@dataclass(frozen=True)
class FP16(_Cast):
    """IEEE half precision; summed by Horovod's allreduce like ``horovod Compression.fp16``.

    Values beyond ±65504 become ±inf, as with Horovod's fp16 compressor.
    """
    name = "fp16"
    summable = True
    wire_dtype = "float16"
    dtype = "float16"
    itemsize = 2


@register
@dataclass(frozen=True)
class BF16(_Cast):
    """bfloat16 (float32's range, 8 bits of mantissa). Horovod has no bf16 sum, so the payload
    goes through the two-phase reduction and is summed in float32."""
    name = "bf16"
    dtype = "bfloat16"
    itemsize = 2
