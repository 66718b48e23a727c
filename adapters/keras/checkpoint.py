"""Keras checkpoints that keep hvdp's error-feedback residuals.

A ``.keras`` file is a zip archive; rank 0 writes the model (with its optimizer state) as Keras
does, adds every rank's residuals beside it (``hvdp/residuals.json`` + ``hvdp/residuals.npz``,
ignored by stock ``keras.models.load_model``) and renames the whole into place atomically. On
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

import numpy as np

from hvdp.checkpoint import atomic_save

from .backend import BACKEND as B
from .state import state_of

_META, _DATA = "hvdp/residuals.json", "hvdp/residuals.npz"


def _reducer(model):
    return state_of(getattr(model, "optimizer", None))


def gather_residuals(model):
    """Collective: every rank's residual state (rank order), or None without residuals."""
    red = _reducer(model)
    state = red.residual_state() if red is not None else None
    if state is None:  # the same on every rank: the ranks-agree check compared the codecs
        return None
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


class CheckpointWriter:
    """Gathers the residuals when made (collective: every rank); rank 0 then writes."""

    def __init__(self, model, gather=True, extra=None):
        self.model, self.extra = model, dict(extra or {})
        self.per_rank = gather_residuals(model) if gather else None
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
        atomic_save(str(path), write)

    def save_weights(self, path, *args, **kwargs):
        atomic_save(str(path), lambda tmp: type(self.model).save_weights(self.model, tmp, *args, **kwargs))


def save_checkpoint(path, model, **extra):
    """Collective: call on every rank. Rank 0 writes ``path`` (a ``.keras`` file: the model, its
    optimizer state, every rank's residuals and ``extra``), atomically.

    Example::

        hvd.save_checkpoint("ckpt.keras", model, epoch=epoch)
    """
    if not str(path).endswith(".keras"):
        raise ValueError(f"hvd.save_checkpoint writes a .keras file; got '{path}': name it '<name>.keras'")
    writer = CheckpointWriter(model, True, extra)
    if B.hvd.rank() == 0:
        writer.save(path)
    B.hvd.broadcast_object(None, root_rank=0, name="hvdp.ckpt.done")  # rank 0 is done writing
