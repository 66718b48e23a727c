"""Which tensors are compressed, and how they are fused into buckets. Same on every rank."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .. import config

# Below 1024 elements (4 KiB of float32) a tensor saves at most ~3 KiB per step when compressed:
# less than the fixed cost of encoding it, and such tensors are mostly biases and
# normalisation scales, which are sensitive to quantisation. They travel as float32.
DEFAULT_MIN_ELEMENTS = 1024
# A bucket is encoded and exchanged as soon as all its gradients exist, overlapping the rest of
# backward; 16 MiB keeps a few buckets in flight for mid-size models without many small messages.
DEFAULT_FUSION_BYTES = 16 * 2**20
# The first bucket (the last layers' gradients, which backward makes first) is smaller, so that an
# exchange starts early in backward even for a model that would fit in one bucket (DDP's first
# bucket is 1 MiB too).
DEFAULT_FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class CompressionPolicy:
    """Settings of what gets compressed and when.

    Args:
        min_elements: tensors with fewer elements stay uncompressed (float32).
        exclude: fnmatch patterns of parameter names that stay uncompressed, e.g. ``("*.bias",)``.
        warmup_steps: optimizer steps reduced uncompressed before compression starts.
        fusion_threshold_bytes: float32 bytes per compressed bucket.
        first_bucket_bytes: float32 bytes of the first bucket (the first gradients backward
            makes), at most ``fusion_threshold_bytes``; 0: as large as the others.
        error_feedback: keep the compression error and add it to the next step
            (``None``: the codec's default, on for int8 and topk).

    Example::

        CompressionPolicy(exclude=("*norm*",), warmup_steps=100)
    """

    min_elements: int = -1
    exclude: Tuple[str, ...] = ()
    warmup_steps: int = 0
    fusion_threshold_bytes: int = -1
    error_feedback: Optional[bool] = None
    first_bucket_bytes: int = -1

    def __post_init__(self):
        if self.min_elements == -1:
            object.__setattr__(self, "min_elements", config.min_compress_elements(DEFAULT_MIN_ELEMENTS))
        if self.fusion_threshold_bytes == -1:
            object.__setattr__(self, "fusion_threshold_bytes", config.fusion_threshold_bytes(DEFAULT_FUSION_BYTES))
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.min_elements < 0:
            raise ValueError(f"min_elements must be >= 0, got {self.min_elements}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.fusion_threshold_bytes <= 0:
            raise ValueError(f"fusion_threshold_bytes must be > 0, got {self.fusion_threshold_bytes}")
        if self.first_bucket_bytes == -1:
            object.__setattr__(self, "first_bucket_bytes", DEFAULT_FIRST_BUCKET_BYTES)
        if self.first_bucket_bytes < 0:
            raise ValueError(f"first_bucket_bytes must be >= 0 (0: as large as the others), got "
                             f"{self.first_bucket_bytes}")

    @property
    def first_bucket_limit(self) -> int:
        """Float32 bytes the first bucket holds at most (a larger tensor is a bucket of its own)."""
        first = self.first_bucket_bytes or self.fusion_threshold_bytes
        return min(first, self.fusion_threshold_bytes)

    def compresses(self, name: str, numel: int) -> bool:
        return numel >= max(1, self.min_elements) and not any(
            fnmatch.fnmatchcase(name, pat) for pat in self.exclude)


@dataclass(frozen=True)
class Plan:
    """``buckets``: tuples of tensor indices reduced together by the codec, in launch order;
    ``plain``: indices reduced uncompressed (Horovod's allreduce)."""

    buckets: Tuple[Tuple[int, ...], ...]
    plain: Tuple[int, ...]


def make_plan(names: Sequence[str], numels: Sequence[int], floating: Sequence[bool],
              policy: CompressionPolicy, compress: bool) -> Plan:
    """Fuse the compressible tensors into buckets, in reverse order (the order backward makes
    gradients), each at most ``policy.fusion_threshold_bytes`` of float32, the first at most
    ``policy.first_bucket_limit`` (a larger tensor is a bucket of its own)."""
    plain, buckets, cur, cur_bytes = [], [], [], 0
    for i in reversed(range(len(names))):
        if not (compress and floating[i] and policy.compresses(names[i], numels[i])):
            plain.append(i)
            continue
        nbytes = 4 * numels[i]
        limit = policy.fusion_threshold_bytes if buckets else policy.first_bucket_limit
        if cur and cur_bytes + nbytes > limit:
            buckets.append(tuple(cur))
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nbytes
    if cur:
        buckets.append(tuple(cur))
    return Plan(tuple(buckets), tuple(sorted(plain)))
