"""Top-k sparsification: the k largest magnitudes of each chunk, as float32 values + int32 indices.

k = max(1, ceil(ratio * n)) is fixed by the chunk length, so every payload has the same size.
Non-finite elements rank first, so an inf/NaN is carried exactly (unless a chunk holds more than
k of them). Without error feedback most of the gradient is dropped every step: keep it on.
"""
import math
from dataclasses import dataclass

from .base import Codec, register


@register
@dataclass(frozen=True)
class TopK(Codec):
    name = "topk"
    error_feedback_default = True
    ratio: float = 0.01

    def __post_init__(self):
        if not (0.0 < float(self.ratio) <= 1.0):
            raise ValueError(f"topk ratio must be in (0, 1], got {self.ratio!r}")

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n)))

    def payload_nbytes(self, n):
        return 8 * self.k(n) if n else 0

    def encode(self, ops, x):
        n = ops.size(x)
        if n == 0:
            return ops.zeros(0, "uint8", like=x)
        x2 = ops.reshape(x, (1, n))
        score = ops.where(ops.isfinite(x2), ops.abs(x2), float("inf"))
        idx = ops.topk_rows(score, self.k(n))
        values = ops.gather_rows(x2, idx)
        return ops.cat([ops.to_bytes(ops.cast(values, "float32")), ops.to_bytes(ops.cast(idx, "int32"))])

    def decode(self, ops, payload, n):
        if n == 0:
            return ops.zeros(0, "float32", like=payload)
        k = self.k(n)
        values = ops.reshape(ops.from_bytes(payload[:4 * k], "float32"), (1, k))
        idx = ops.reshape(ops.from_bytes(payload[4 * k:], "int32"), (1, k))
        return ops.reshape(ops.scatter_rows(1, n, idx, values), (n,))
