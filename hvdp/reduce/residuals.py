"""Error-feedback residuals as every reducer treats them: a non-finite value never enters one,
a residual of another layout is not read, and a step whose reduced result is not finite (a loss
scaler then skips it) leaves the residuals as it found them, on every rank alike.

Example::

    prev = previous(ops, store, "b0", 1024)       # None: none yet, or another layout's
    keep_if_finite(ops, "b0", out, ((store, prev),))
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Tuple

import numpy as np

from .staging import HOST_OPS

Array = Any


def finite_or_zero(ops, r: Array) -> Array:
    """r with its non-finite elements set to 0 (r itself when all are finite)."""
    if ops.all_finite(r):
        return r
    return ops.where(ops.isfinite(r), r, 0.0)


def previous(ops, store, name: str, size: int) -> Optional[Array]:
    """The residual kept under ``name`` if it has ``size`` elements, else None (none yet, or
    another layout's). Never written in place: a step that is rolled back sets it again."""
    prev = store.get(name)
    if prev is None:
        return None
    # a staged kernel keeps its residuals as host (numpy) arrays in an in-memory store
    ops = HOST_OPS if isinstance(prev, np.ndarray) else ops
    return prev if ops.size(prev) == size else None


def keep_if_finite(ops, name: str, out: Array, before: Iterable[Tuple[Any, Optional[Array]]]) -> None:
    """Put the residuals a step wrote back as they were unless ``out`` (its reduced bucket, the
    same bits on every rank, so every rank decides alike) is finite.

    ``before``: ``(store, previous value or None)`` for each store the step set under
    ``name``; None (no residual before the step) comes back as zeros. Eagerly the check is
    one read of ``out``, and nothing else runs for a finite step. Where the data cannot be
    looked at (a TensorFlow graph being traced: ``all_finite`` answers False) the rollback is
    a select, ``where(finite, new, previous)``, which a graph store assigns to its variable
    like any other value.
    """
    if ops.all_finite(out):
        return
    n = ops.size(out)
    bad = ops.amax_rows(ops.reshape(ops.where(ops.isfinite(out), 0.0, 1.0), (1, n))) > 0  # shape (1,)
    for store, prev in before:
        new = store.get(name)
        if new is None:
            continue
        old = prev if prev is not None else ops.zeros(ops.size(new), "float32", like=new)
        store.set(name, ops.where(bad, old, new))
