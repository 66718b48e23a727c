"""Where a two-phase reducer's fused kernels run: on the framework's own arrays (written in
place), on host (numpy) copies of them (*staged*: TensorFlow's eager tensors), or nowhere (the
codec's array ops: a graph being traced, top-k, no compiler). Chosen once per device and dtype.

Example::

    paths = KernelPaths(get("int8"), NumpyOps(), stats=None)
    k, staged = paths.choose(flat)          # the cpu-c kernels, not staged
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..kernels import registry as _kernels
from ..ops import NumpyOps

HOST_OPS = NumpyOps()  # the kernels' buffers when the framework's arrays are staged on the host


class KernelPaths:
    """The kernels of one codec on one framework's arrays, by device (see the module's docstring)."""

    def __init__(self, codec, ops, stats=None):
        self.codec, self.ops, self.stats = codec, ops, stats
        self._chosen: Dict[str, Tuple[Any, bool]] = {}  # by device: (kernels or None, staged)
        self.path: Optional[Tuple[str, str]] = None  # the last choice: (path, why no kernel or "")

    def choose(self, like) -> Tuple[Any, bool]:
        """(the fused kernels for arrays like ``like`` or None, whether they run on host copies)."""
        key = f"{type(like).__name__}:{getattr(like, 'device', '')}:{getattr(like, 'dtype', '')}"
        if key not in self._chosen:
            k, staged = None, False
            if self.ops.writable_views:  # kernels write into the reducer's buffers
                k, why = _kernels.explain(self.codec, self.ops, like)
            else:  # read-only arrays: the kernels may still run on host copies
                host = self.ops.as_numpy(like)
                if host is None:
                    why = [f"{self.ops.name} arrays are not written in place and give no host copy here "
                           "(a graph being traced, or not in host memory)"]
                else:
                    k, why = _kernels.explain(self.codec, HOST_OPS, host)
                    staged = k is not None
            self._chosen[key] = (k, staged)
            path = getattr(k, "path", "array ops") + (" (host copies)" if staged else "")
            self.path = (path, "" if k else "; ".join(why))
            if self.stats is not None:
                self.stats.path(self.codec.name, *self.path)
        return self._chosen[key]

    def ops_of(self, staged: bool):
        """The ops of the kernels' buffers: numpy's when staged on the host, else the reducer's."""
        return HOST_OPS if staged else self.ops

    def host(self, x, staged: bool):
        """x as the kernels' buffer: itself, or its host copy when staged."""
        if not staged or x is None or isinstance(x, np.ndarray):  # a host residual already is one
            return x
        return self.ops.as_numpy(x)

    def back(self, a, staged: bool):
        """A kernel's host result as the framework's array."""
        return self.ops.from_numpy(a) if staged else a
