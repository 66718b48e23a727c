"""Checkpoints for data-parallel torch training: rank 0 writes, atomically; every rank resumes.

hvdp's error-feedback residuals differ per rank, so each rank's are gathered into the file and
each rank takes its own back (with a different number of workers they restart from zero).
"""
import horovod.torch as _hvd
import torch

from hvdp.checkpoint import atomic_write


def save_checkpoint(path, model, optimizer=None, **extra):
    """Collective: call on every rank. Rank 0 writes ``path`` (temporary file, fsync, rename).

    Example::

        hvd.save_checkpoint("ckpt.pt", model, opt, epoch=epoch)
    """
    opt_state = optimizer.state_dict() if optimizer is not None else None
    per_rank = None
    if opt_state is not None and "hvdp" in opt_state:
        per_rank = _hvd.allgather_object(opt_state.pop("hvdp"), name="hvdp.ckpt.gather")
    if _hvd.rank() == 0:
        state = {"model": model.state_dict(), "optimizer": opt_state, "hvdp_per_rank": per_rank,
                 "size": _hvd.size(), "extra": extra}
        atomic_write(path, lambda f: torch.save(state, f))
    _hvd.broadcast_object(None, root_rank=0, name="hvdp.ckpt.done")  # rank 0 is done writing


def load_checkpoint(path, model, optimizer=None, map_location="cpu"):
    """Every rank reads ``path`` and restores model, optimizer and its own residuals.

    Returns the ``extra`` values given to :func:`save_checkpoint`.
    """
    state = torch.load(path, map_location=map_location, weights_only=False)
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        opt_state = dict(state["optimizer"])
        per_rank = state.get("hvdp_per_rank")
        if per_rank is not None:
            same_world = state["size"] == _hvd.size()
            mine = per_rank[_hvd.rank()] if same_world else dict(per_rank[0], reducer=None)
            opt_state["hvdp"] = mine
        optimizer.load_state_dict(opt_state)
    return state.get("extra", {})
