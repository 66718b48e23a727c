"""PowerSGD: each matrix-shaped gradient sent as two thin factors of rank r (Vogels et al., 2019).

A gradient M of shape (n, ...) is viewed as an n x m matrix (m: the product of the other
dimensions, as DDP's ``powerSGD_hook`` does). One power-iteration step per training step, with
the factor Q kept from the step before (warm start)::

    P = M Q  -> allreduce(P) -> orthonormalise P -> Q = M^T P -> allreduce(Q) -> M ~ P Q^T / size

so (n + m) * r floats travel instead of n * m. Only matrices where that pays by
``min_compression_rate`` are compressed; vectors and the rest of a bucket go by one plain
allreduce. Error feedback keeps M - P Q^T for the next step. The work is
:class:`hvdp.reduce.lowrank.LowRankReducer`'s: this class holds the settings (its ``__str__`` is what the
ranks-agree check compares) and the decision of what to compress.

Example::

    hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                             compression=hvd.Compression.powersgd.configure(rank=4))
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Tuple

from .base import Codec, register


@register
@dataclass(frozen=True)
class PowerSGD(Codec):
    """Low-rank compression of matrix-shaped gradients over allreduce.

    Args:
        rank: the factors' rank r (DDP's ``matrix_approximation_rank``); a matrix with fewer
            rows or columns uses that many.
        min_compression_rate: a matrix is compressed only when n * m > rate * (n + m) * r.
        warm_start: keep Q from step to step (else a fresh random Q every step).
        seed: the random initial Q (the same on every rank).
        start_powerSGD_iter: optimizer steps reduced by a plain float32 allreduce before
            powersgd starts, as DDP's ``PowerSGDState(start_powerSGD_iter=...)``; the residuals
            and Qs start at that step. 0 (the default) compresses from the first step. DDP's
            default is 1000 and its documentation recommends a warm-up; to train as a DDP job
            did, pass the value it used (e.g. 10). Equal to ``CompressionPolicy(warmup_steps=...)``
            for this codec (the larger of the two counts).
    """

    name = "powersgd"
    low_rank: ClassVar[bool] = True
    error_feedback_default = True
    rank: int = 1
    min_compression_rate: float = 2.0
    warm_start: bool = True
    seed: int = 0
    start_powerSGD_iter: int = 0  # DDP's name, for a DDP user

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"powersgd rank must be an int >= 1, got {self.rank!r}")
        if not float(self.min_compression_rate) >= 0.0:
            raise ValueError(f"powersgd min_compression_rate must be >= 0, got {self.min_compression_rate!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"powersgd seed must be an int, got {self.seed!r}")
        start = self.start_powerSGD_iter
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"powersgd start_powerSGD_iter must be an int >= 0 (steps of plain allreduce "
                             f"before compression), got {start!r}")

    @property
    def warmup_steps(self) -> int:
        return self.start_powerSGD_iter

    def __str__(self) -> str:
        """The settings; ``start_powerSGD_iter`` only where set, so that a checkpoint's codec
        (compared on loading the residuals and Qs) reads as it did before the option existed."""
        text = super().__str__()
        return text if self.start_powerSGD_iter else text.replace(", start_powerSGD_iter=0", "")

    def matrix(self, shape: Sequence[int]) -> Optional[Tuple[int, int, int]]:
        """(rows, cols, rank) if a tensor of ``shape`` is compressed, else None (a vector or
        scalar, or a matrix where the factors would not save ``min_compression_rate``)."""
        if len(shape) < 2:
            return None
        n, m = int(shape[0]), int(math.prod(shape[1:]))
        r = min(n, m, self.rank)
        if r < 1 or not (n + m) * r * float(self.min_compression_rate) < n * m:
            return None
        return n, m, r

    def payload_nbytes(self, n):
        raise NotImplementedError("powersgd has no per-chunk payload: hvdp.reduce.lowrank reduces it by allreduce")

    def encode(self, ops, x):
        raise NotImplementedError("powersgd needs tensor shapes: hvdp.reduce.lowrank.LowRankReducer reduces it")

    def decode(self, ops, payload, n):
        raise NotImplementedError("powersgd needs tensor shapes: hvdp.reduce.lowrank.LowRankReducer reduces it")
