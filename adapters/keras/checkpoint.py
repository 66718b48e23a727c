"""Keras checkpoints that keep hvdp's error-feedback residuals.

A ``.keras`` file is a zip archive; rank 0 writes the model (with its optimizer state) as Keras
does, adds every rank's residuals beside it (``hvdp/residuals.json`` + ``hvdp/residuals.npz``,
ignored by stock ``keras.models.load_model``; an ``hvd.OuterOptimizer``'s outer state and its
engines' residuals in ``hvdp/outer.json`` + ``hvdp/outer.npz``) and renames the whole into
place atomically. On
load (``saving``: ``hvd.load_model``, ``hvd.load_checkpoint``; it imports this module, not the
other way round) each rank takes its own residuals back. Nothing is unpickled: ``extra`` is
JSON, the arrays are read with ``allow_pickle=False``, the model by Keras in its safe mode.

**At another number of workers** the rule is the core's, the same as in ``hvdp.torch.checkpoint``:
rank r takes what rank r saved, and its reducer's ``load_state_dict`` keeps what still fits
(``hvdp.reduce.twophase.TwoPhaseReducer.load_state_dict``: a worker residual is kept where its padded
bucket length is unchanged, the server residual, which belongs to this rank's chunk, restarts
from zero); a rank that did not exist when saving starts from zero.
"""
import io
import json
import zipfile

import keras
import numpy as np

from hvdp.checkpoint import atomic_save, rank0_writes
from hvdp.cluster.flight import RECORDER as FLIGHT

from .backend import BACKEND as B
from .state import outer_of, state_of

_META, _DATA = "hvdp/residuals.json", "hvdp/residuals.npz"
_OUTER_META, _OUTER_DATA = "hvdp/outer.json", "hvdp/outer.npz"


def _reducer(model):
    return state_of(getattr(model, "optimizer", None))


def gather_residuals(model):
    """Collective: every rank's residual state (rank order), or None without residuals."""
    red = _reducer(model)
    state = red.residual_state() if red is not None else None
    if state is None:  # the same on every rank: the ranks-agree check compared the codecs
        return None
    with FLIGHT.around("hvdp.ckpt.residuals", "allgather_object"):
        return B.hvd.allgather_object(state, name="hvdp.ckpt.residuals")


def _append(path, per_rank, extra):
    meta = {"format": 1, "size": len(per_rank or ()), "extra": extra, "ranks": []}
    arrays = {}
    for r, st in enumerate(per_rank or ()):
        meta["ranks"].append({"codec": st["codec"], "size": st["size"],
                              "worker": sorted(st["worker"]), "server": sorted(st["server"])})
        for side in ("worker", "server"):
            for name, v in st[side].items():
                arrays[f"r{r}.{side}.{name}"] = np.asarray(v, np.float32)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(_META, json.dumps(meta))
        z.writestr(_DATA, buf.getvalue())


def read_residuals(path):
    """-> (per-rank residual states or [], the ``extra`` values) from a ``.keras`` file."""
    if not zipfile.is_zipfile(path):
        return [], {}
    with zipfile.ZipFile(path) as z:
        if _META not in z.namelist():
            return [], {}
        meta = json.loads(z.read(_META))
        data = np.load(io.BytesIO(z.read(_DATA)), allow_pickle=False)
        per_rank = [{"codec": m["codec"], "size": m["size"],
                     **{side: {n: data[f"r{r}.{side}.{n}"] for n in m[side]} for side in ("worker", "server")}}
                    for r, m in enumerate(meta["ranks"])]
    return per_rank, meta.get("extra", {})


def restore_residuals(model, path):
    """This rank's residuals from ``path`` into the model's hvdp optimizer (see the module's rule)."""
    red = _reducer(model)
    if red is None or red.plan is None:
        return
    per_rank, _ = read_residuals(path)
    r = B.hvd.rank()
    red.load_residual_state(per_rank[r] if r < len(per_rank) else {})


def gather_outer(model):
    """Collective: an ``hvd.OuterOptimizer``'s outer state (the same on every rank) and every
    rank's residuals of its fragments' engines, or None (no outer steps, or none taken yet)."""
    outer = outer_of(getattr(model, "optimizer", None))
    if outer is None or outer.loop is None:
        return None
    shared = outer.loop.state()  # raises, saying so, while a fragment is in flight
    engines = shared.pop("engines")
    with FLIGHT.around("hvdp.ckpt.outer", "allgather_object"):
        return shared, B.hvd.allgather_object(engines, name="hvdp.ckpt.outer")


def _append_outer(path, outer):
    shared, per_rank = outer
    arrays = {f"g{i}": np.asarray(keras.ops.convert_to_numpy(g), np.float32) for i, g in enumerate(shared["globals"])}
    arrays.update({f"m{i}": np.asarray(keras.ops.convert_to_numpy(m), np.float32)
                   for i, m in enumerate(shared["momentum"]) if m is not None})
    meta = {k: shared[k] for k in ("settings", "step", "warm", "auto", "outer_steps")}
    meta.update(format=1, tensors=len(shared["globals"]), momentum=[m is not None for m in shared["momentum"]],
                ranks=[])
    for r, engines in enumerate(per_rank):
        rows = []
        for f, st in enumerate(engines):
            red = st.get("reducer") or {}
            rows.append({"step": st.get("step", 0), "codec": red.get("codec"), "size": red.get("size"),
                         **{side: sorted(red.get(side) or {}) for side in ("worker", "server")}})
            for side in ("worker", "server"):
                for name, v in (red.get(side) or {}).items():
                    arrays[f"r{r}.e{f}.{side}.{name}"] = np.asarray(v, np.float32)
        meta["ranks"].append(rows)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(_OUTER_META, json.dumps(meta))
        z.writestr(_OUTER_DATA, buf.getvalue())


def read_outer(path):
    """-> (the outer state, every rank's engine states) from a ``.keras`` file, or None."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        if _OUTER_META not in z.namelist():
            return None
        meta = json.loads(z.read(_OUTER_META))
        data = np.load(io.BytesIO(z.read(_OUTER_DATA)), allow_pickle=False)
        shared = {k: meta[k] for k in ("settings", "step", "warm", "auto", "outer_steps")}
        shared["globals"] = [data[f"g{i}"] for i in range(meta["tensors"])]
        shared["momentum"] = [data[f"m{i}"] if has else None for i, has in enumerate(meta["momentum"])]
        def engine(r, f, row):
            if row["codec"] is None:
                return {"step": row["step"], "reducer": None}
            sides = {side: {n: data[f"r{r}.e{f}.{side}.{n}"] for n in row[side]} for side in ("worker", "server")}
            return {"step": row["step"], "reducer": {"codec": row["codec"], "size": row["size"], **sides}}
        per_rank = [[engine(r, f, row) for f, row in enumerate(rows)] for r, rows in enumerate(meta["ranks"])]
    return shared, per_rank


def restore_outer(model, path):
    """An ``hvd.OuterOptimizer``'s outer state and this rank's residuals from ``path``, taken up at
    its next step (a rank that did not exist when saving starts its residuals from zero)."""
    outer = outer_of(getattr(model, "optimizer", None))
    got = read_outer(path) if outer is not None else None
    if got is None:
        return
    shared, per_rank = got
    r = B.hvd.rank()
    outer.restore(dict(shared, engines=per_rank[r] if r < len(per_rank) else None))


class CheckpointWriter:
    """Gathers the residuals (and an outer-step optimizer's state) when made (collective: every
    rank); rank 0 then writes."""

    def __init__(self, model, gather=True, extra=None):
        self.model, self.extra = model, dict(extra or {})
        self.per_rank = gather_residuals(model) if gather else None
        self.outer = gather_outer(model) if gather else None
        try:
            json.dumps(self.extra)
        except TypeError as e:
            raise TypeError(f"hvd.save_checkpoint keeps extra values as JSON: {e}; pass numbers, "
                            f"strings, lists or dicts (e.g. epoch=3)") from None

    def save(self, path, *args, **kwargs):
        def write(tmp):
            type(self.model).save(self.model, tmp, *args, **kwargs)
            if str(path).endswith(".keras"):
                _append(tmp, self.per_rank, self.extra)
                if self.outer is not None:
                    _append_outer(tmp, self.outer)
        atomic_save(str(path), write)

    def save_weights(self, path, *args, **kwargs):
        atomic_save(str(path), lambda tmp: type(self.model).save_weights(self.model, tmp, *args, **kwargs))


def save_checkpoint(path, model, **extra):
    """Collective: call on every rank. Rank 0 writes ``path`` (a ``.keras`` file: the model, its
    optimizer state, every rank's residuals and ``extra``), atomically. Where the write fails
    (a full or read-only disk), the previous file stays and every rank raises the same
    ``hvdp.checkpoint.CheckpointWriteError`` (an ``OSError``: path and cause).

    Example::

        hvd.save_checkpoint("ckpt.keras", model, epoch=epoch)
    """
    if not str(path).endswith(".keras"):
        raise ValueError(f"hvd.save_checkpoint writes a .keras file; got '{path}': name it '<name>.keras'")
    writer = CheckpointWriter(model, True, extra)
    # every rank learns that rank 0 is done writing, or raises its error (CheckpointWriteError)
    rank0_writes(lambda: writer.save(path), B.hvd.rank(), B.hvd.broadcast_object, str(path))
