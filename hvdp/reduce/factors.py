"""The shapes side of the low-rank reduction (``hvdp.reduce.lowrank``): which tensors of a
bucket are matrices and where their factors P and Q lie in the bucket's P and Q buffers, and
the initial Qs every rank draws alike.

Example::

    lay = matrix_layout(get("powersgd", rank=2), [(256, 128), (128,)])
    lay.p_len, lay.q_len, lay.plain          # 512, 256, [(32768, 128)]
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

# (bucket name, [(m, r) per compressed tensor]) -> the initial Qs as float32 numpy arrays
InitQ = Callable[[str, List[Tuple[int, int]]], List[np.ndarray]]


def seeded_init(seed: int) -> InitQ:
    """Standard normal initial Qs from a numpy RandomState seeded by (seed, bucket name): the
    same on every rank, whatever order the buckets start in; a new draw on each call."""
    calls: Dict[str, int] = {}

    def init(name: str, dims: List[Tuple[int, int]]) -> List[np.ndarray]:
        k = calls[name] = calls.get(name, -1) + 1
        rs = np.random.RandomState([seed & 0xFFFFFFFF, zlib.crc32(name.encode()), k])
        return [rs.standard_normal((m, r)).astype(np.float32) for m, r in dims]
    return init


@dataclass
class Part:
    """One compressed tensor of a bucket: its place, its matrix and its factors' places."""
    offset: int
    n: int
    m: int
    r: int
    p_off: int = 0
    q_off: int = 0


@dataclass
class MatrixLayout:
    parts: List[Part]
    plain: List[Tuple[int, int]]  # (offset, length) of the uncompressed tensors
    p_len: int
    q_len: int


def matrix_layout(codec, tensors: Sequence[Sequence[int]]) -> MatrixLayout:
    """Where each tensor of a bucket lies, and for a matrix (``codec.matrix``) its factors."""
    parts, plain, off, p_len, q_len = [], [], 0, 0, 0
    for shape in tensors:
        numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        mat = codec.matrix(tuple(shape))
        if mat is None:
            plain.append((off, numel))
        else:
            n, m, r = mat
            parts.append(Part(off, n, m, r, p_len, q_len))
            p_len, q_len = p_len + n * r, q_len + m * r
        off += numel
    return MatrixLayout(parts, plain, p_len, q_len)
