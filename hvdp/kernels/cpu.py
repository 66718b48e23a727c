"""The CPU backend: ``cpu_codecs.c`` compiled once (``build``), called through ctypes on the
arrays' memory (numpy arrays, torch CPU tensors through zero-copy views; see ``ArrayOps.as_numpy``).

Serves int8 and int4 (any block size), bf16 and fp16 on arrays that live in host memory; topk, GPU tensors
and graphs being traced keep the array ops. Registered as provider ``cpu-c``.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from ..private import refusal
from .base import Unavailable
from .registry import register

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_codecs.c")
_I64, _F32, _INT, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_LIBS = {}
BLOCKWISE = ("int8", "int4")  # kernels taking the block size


def load():
    """(ctypes library, description); raises :class:`Unavailable` when it cannot be built."""
    from .build import build
    path, desc = build(_SRC)
    if path not in _LIBS:
        why = refusal(path, "file")  # checked by build; again just before dlopen runs its code
        if why is not None:
            raise Unavailable(f"not loading {path}: it {why}")
        lib = ctypes.CDLL(path)
        for name in BLOCKWISE:
            getattr(lib, f"hvdp_{name}_encode").argtypes = [_P, _P, _P, _P, _I64, _I64]
            getattr(lib, f"hvdp_{name}_encode").restype = _INT
            getattr(lib, f"hvdp_{name}_decode_sum").argtypes = [_P, _I64, _I64, _I64, _F32, _INT, _P]
            getattr(lib, f"hvdp_{name}_decode_sum").restype = None
        for name in ("bf16", "fp16"):
            getattr(lib, f"hvdp_{name}_encode").argtypes = [_P, _P, _P, _P, _I64]
            getattr(lib, f"hvdp_{name}_encode").restype = None
            getattr(lib, f"hvdp_{name}_decode_sum").argtypes = [_P, _I64, _I64, _F32, _INT, _P]
            getattr(lib, f"hvdp_{name}_decode_sum").restype = None
        _LIBS[path] = lib
    return _LIBS[path], desc


def _ptr(a):
    return None if a is None else a.ctypes.data


class CpuKernels:
    """:class:`~hvdp.kernels.base.CodecKernels` of one codec in C, on host memory."""

    path = "cpu-c"

    def __init__(self, codec, ops, lib, description: str):
        self.codec, self.ops, self.lib = codec, ops, lib
        self.description = description  # compiler and flags, for doctor
        self._kind = codec.name

    def __repr__(self):
        return f"CpuKernels({self.codec}, {self.description})"

    # --- numpy views of the caller's arrays ---------------------------------------------------
    def _input(self, x, dtype, n):
        a = self.ops.as_numpy(x)
        if a is None:
            raise ValueError(f"{self.path} kernels need arrays in host memory; got {type(x).__name__} "
                             "(a GPU tensor or a traced graph): use the array ops")
        if a.dtype != dtype or a.size != n:
            raise ValueError(f"expected {n} {np.dtype(dtype).name} values, got {a.size} {a.dtype}")
        return np.ascontiguousarray(a.reshape(-1))

    def _output(self, out, dtype, n):
        a = self.ops.as_numpy(out) if getattr(self.ops, "writable_views", False) else None
        if a is None:
            raise ValueError(f"{self.ops.name} arrays cannot be written in place: pass out=None "
                             "(and no residual) or use the array ops")
        if a.dtype != dtype or a.size != n or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"out must be a contiguous writable array of {n} {np.dtype(dtype).name}, "
                             f"got {a.size} {a.dtype}")
        return a.reshape(-1)

    def _result(self, a, out, like):
        return out if out is not None else self.ops.from_numpy(a, like=like)

    # --- the contract -------------------------------------------------------------------------
    def encode(self, x, prev=None, residual=None, out=None):
        c = self.ops.size(x)
        nb = self.codec.payload_nbytes(c)
        xa = self._input(x, np.float32, c)
        pa = None if prev is None else self._input(prev, np.float32, c)
        ra = None if residual is None else self._output(residual, np.float32, c)
        oa = np.empty(nb, np.uint8) if out is None else self._output(out, np.uint8, nb)
        if self._kind in BLOCKWISE:
            if getattr(self.lib, f"hvdp_{self._kind}_encode")(_ptr(xa), _ptr(pa), _ptr(ra), _ptr(oa), c,
                                                             self.codec.block_size) != 0:
                raise MemoryError(f"{self._kind} kernel: out of memory for one block")
        else:
            getattr(self.lib, f"hvdp_{self._kind}_encode")(_ptr(xa), _ptr(pa), _ptr(ra), _ptr(oa), c)
        return self._result(oa, out, x)

    def decode_sum(self, payloads, p, c, scale=1.0):
        nb = self.codec.payload_nbytes(c)
        pl = self._input(payloads, np.uint8, p * nb)
        o = np.empty(c, np.float32)
        self._decode_into(pl, p, c, scale, o)
        return self.ops.from_numpy(o, like=payloads)

    def decode(self, payload, c, out=None):
        pl = self._input(payload, np.uint8, self.codec.payload_nbytes(c))
        o = np.empty(c, np.float32) if out is None else self._output(out, np.float32, c)
        self._decode_into(pl, 1, c, 1.0, o)
        return self._result(o, out, payload)

    def _decode_into(self, pl, p, c, scale, o):
        do_scale = int(float(scale) != 1.0)
        if self._kind in BLOCKWISE:
            getattr(self.lib, f"hvdp_{self._kind}_decode_sum")(_ptr(pl), p, c, self.codec.block_size, scale,
                                                               do_scale, _ptr(o))
        else:
            getattr(self.lib, f"hvdp_{self._kind}_decode_sum")(_ptr(pl), p, c, scale, do_scale, _ptr(o))


SERVED = ("int8", "int4", "bf16", "fp16")


def provider(codec, ops, like):
    if codec.name not in SERVED:
        raise Unavailable(f"no CPU kernel for {codec.name} (kernels exist for {', '.join(SERVED)})")
    if not hasattr(ops, "as_numpy"):
        raise Unavailable(f"{ops.name} ops give no host views (ArrayOps.as_numpy)")
    host = None if like is None else ops.as_numpy(like)
    if like is not None and host is None:
        raise Unavailable(f"{ops.name} arrays not in host memory here (a GPU tensor or a traced graph)")
    if host is not None and host.dtype != np.float32 and host.dtype != np.uint8:
        raise Unavailable(f"the CPU kernels take float32 buckets, not {host.dtype}")
    lib, desc = load()
    return CpuKernels(codec, ops, lib, desc)


register("cpu-c", provider)
