"""The array-ops protocol the codecs are written against, and its numpy reference.

Every codec and the two-phase reducer touch arrays only through an ``ArrayOps`` object, so each
algorithm exists once. An adapter fills the protocol with its framework's ops (torch, TF); the
numpy implementation below is the reference the unit tests compare every adapter against.

Conventions: arrays are 1-D or 2-D; dtypes are named by strings ("float32", "float16",
"bfloat16", "int8", "uint8", "int32"). Arithmetic operators (``+ - * /``) and basic slicing
``x[a:b]`` are assumed to work on every framework's arrays and are used directly.
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence, Tuple

import numpy as np

Array = Any


class ArrayOps(Protocol):
    """What a framework must provide for hvdp's codecs and reducers to run on its arrays."""

    name: str

    def zeros(self, n: int, dtype: str = "float32", like: Array | None = None) -> Array: ...
    def size(self, x: Array) -> int: ...
    def reshape(self, x: Array, shape: Sequence[int]) -> Array: ...
    def cat(self, xs: Sequence[Array]) -> Array: ...
    def cast(self, x: Array, dtype: str) -> Array: ...
    def dtype(self, x: Array) -> str: ...                  # x's dtype by name ("float32", ...)
    def to_bytes(self, x: Array) -> Array: ...            # uint8 view/copy of the raw bytes
    def from_bytes(self, b: Array, dtype: str) -> Array: ...  # inverse of to_bytes
    def abs(self, x: Array) -> Array: ...
    def amax_rows(self, x2d: Array) -> Array: ...          # max over the last axis
    def round(self, x: Array) -> Array: ...                # half to even
    def clip(self, x: Array, lo: float, hi: float) -> Array: ...
    def where(self, cond: Array, a: Array, b: Array) -> Array: ...
    def isfinite(self, x: Array) -> Array: ...
    # Fast-path guards: True only when certain. An implementation that cannot look at the data
    # (a TF graph being traced) returns False, and the codec takes its general path.
    def all_finite(self, x: Array) -> bool: ...
    def all_nonnegative(self, x: Array) -> bool: ...
    def topk_rows(self, score2d: Array, k: int) -> Array: ...  # int32 indices of the k largest
    def gather_rows(self, x2d: Array, idx2d: Array) -> Array: ...
    def scatter_rows(self, rows: int, cols: int, idx2d: Array, values2d: Array) -> Array: ...
    # Memory: a reducer's big temporaries. ``assemble`` writes the ``(offset, piece)`` pairs an
    # iterable yields, which tile [0, n) in any order, into one new n-element array (an eager
    # framework keeps one piece alive at a time; a graph framework may collect and concatenate).
    # ``add_``/``mul_`` return a + b / a * s and may overwrite ``a`` (the caller owns it and no
    # longer needs it); the bits are those of ``a + b`` / ``a * s``.
    def assemble(self, n: int, dtype: str, pieces: Iterable[Tuple[int, Array]],
                 like: Array | None = None) -> Array: ...
    def add_(self, a: Array, b: Array) -> Array: ...
    def mul_(self, a: Array, s: float) -> Array: ...
    # Host views for the CPU kernels (hvdp.kernels): ``as_numpy`` gives x's data as a numpy array
    # (zero-copy where the framework allows) or None (a GPU tensor, a graph being traced);
    # ``writable_views`` says whether writes into that array reach x. ``from_numpy`` wraps a
    # numpy array as the framework's array (zero-copy where possible).
    writable_views: bool
    def as_numpy(self, x: Array) -> "np.ndarray | None": ...
    # An uninitialised n-element array, for buffers a kernel fills whole (a framework without
    # one returns ``zeros``).
    def empty(self, n: int, dtype: str = "float32", like: Array | None = None) -> Array: ...
    def from_numpy(self, a: "np.ndarray", like: Array | None = None) -> Array: ...
    # Optional, used only by the low-rank codec (powersgd, ``hvdp.reduce.lowrank``); numpy, torch and
    # TF (hvdp.keras) provide them, graph-safe on TF. Float32 2-D arrays:
    # ``matmul`` is a @ b, ``transpose`` the 2-D transpose, ``orthonormalize`` an n x r array
    # (r <= n) whose columns span the same space, orthonormal: Gram-Schmidt for r <= 2, else a
    # QR factorisation's Q (as DDP's powerSGD_hook). A zero column comes back zero under
    # Gram-Schmidt, never NaN.
    def matmul(self, a: Array, b: Array) -> Array: ...
    def transpose(self, x2d: Array) -> Array: ...
    def orthonormalize(self, x2d: Array) -> Array: ...


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaN kept NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding a NaN payload could carry into the exponent: force a quiet NaN
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


class NumpyOps:
    """Reference implementation of :class:`ArrayOps` (bfloat16 emulated on uint16 bits)."""

    name = "numpy"
    writable_views = True
    _DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8,
               "uint8": np.uint8, "int32": np.int32, "bfloat16": np.uint16}

    def zeros(self, n, dtype="float32", like=None):
        return np.zeros(n, dtype=self._DTYPES[dtype])

    def empty(self, n, dtype="float32", like=None):
        return np.empty(n, dtype=self._DTYPES[dtype])

    def size(self, x):
        return int(np.size(x))

    def dtype(self, x):
        return str(np.asarray(x).dtype)

    def reshape(self, x, shape):
        return np.reshape(x, shape)

    def cat(self, xs):
        return np.concatenate([np.ravel(x) for x in xs]) if len(xs) else np.zeros(0, np.float32)

    def cast(self, x, dtype):
        x = np.asarray(x)
        if dtype == "bfloat16":
            return x if x.dtype == np.uint16 else _bf16_bits(x.astype(np.float32))
        if x.dtype == np.uint16:  # bfloat16 bits -> float
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x.astype(self._DTYPES[dtype])

    def to_bytes(self, x):
        return np.ascontiguousarray(x).view(np.uint8).ravel()

    def from_bytes(self, b, dtype):
        return np.ascontiguousarray(b).view(self._DTYPES[dtype])

    def abs(self, x):
        return np.abs(x)

    def amax_rows(self, x2d):
        return np.max(x2d, axis=-1) if x2d.shape[-1] else np.zeros(x2d.shape[0], x2d.dtype)

    def round(self, x):
        return np.rint(x)

    def clip(self, x, lo, hi):
        return np.clip(x, lo, hi)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def isfinite(self, x):
        return np.isfinite(x)

    def all_finite(self, x):
        return bool(np.isfinite(x).all())

    def all_nonnegative(self, x):
        return bool((x >= 0).all())

    def topk_rows(self, score2d, k):
        # largest first, ties by lower index
        return np.argsort(-score2d, axis=-1, kind="stable")[:, :k].astype(np.int32)

    def gather_rows(self, x2d, idx2d):
        return np.take_along_axis(x2d, idx2d.astype(np.int64), axis=-1)

    def scatter_rows(self, rows, cols, idx2d, values2d):
        out = np.zeros((rows, cols), dtype=np.float32)
        np.put_along_axis(out, idx2d.astype(np.int64), values2d.astype(np.float32), axis=-1)
        return out

    def assemble(self, n, dtype, pieces, like=None):
        out, total = np.empty(n, dtype=self._DTYPES[dtype]), 0
        for off, x in pieces:
            k = int(np.size(x))
            out[off:off + k] = np.ravel(x)
            total += k
        assert total == n, f"assemble: pieces hold {total} elements, expected {n}"
        return out

    def add_(self, a, b):
        return np.add(a, b, out=a)

    def mul_(self, a, s):
        return np.multiply(a, np.float32(s), out=a) if a.dtype == np.float32 else np.multiply(a, s, out=a)

    def as_numpy(self, x):
        return x if isinstance(x, np.ndarray) else None

    def from_numpy(self, a, like=None):
        return a

    def matmul(self, a, b):
        return np.matmul(a, b)

    def transpose(self, x2d):
        return np.ascontiguousarray(x2d.T)

    def orthonormalize(self, x2d):
        x = np.array(x2d, dtype=np.float32, copy=True)
        if x.shape[1] > 2:
            return np.linalg.qr(x)[0].astype(np.float32)
        for i in range(x.shape[1]):
            # the column scaled by a power of two first (its largest |value| to [0.5, 1)): a float32
            # sum of squares overflows above ~1.8e19 and underflows below ~1e-19 (the column, so
            # the matrix, would come out zero); the scaling is exact, so where the plain sum is in
            # range the bits are the same. The torch and TF ops do the same.
            col = x[:, i]
            big = float(np.max(np.abs(col))) if col.size else 0.0
            if 0 < big < np.inf:
                col = col * np.float32(2.0 ** -int(np.clip(np.frexp(big)[1], -126, 126)))
            norm = np.sqrt(np.sum(col * col))
            x[:, i] = col / (norm if norm > 0 else np.float32(1.0))  # zero stays zero, NaN stays NaN (as torch, TF)
            if i + 1 < x.shape[1]:
                x[:, i + 1:] -= np.sum(x[:, i:i + 1] * x[:, i + 1:], axis=0) * x[:, i:i + 1]
        return x
