"""Checkpoints for data-parallel torch training: rank 0 writes, atomically; every rank resumes.

hvdp's error-feedback residuals differ per rank, so each rank's are gathered into the file and
each rank takes its own back. **At another number of workers** the rule is the core's, the same
as in ``hvdp.keras.checkpoint``: rank r takes what rank r saved, and its reducer's
``load_state_dict`` keeps what still fits (``hvdp.reduce.twophase.TwoPhaseReducer.load_state_dict``:
a worker residual is kept where its padded bucket length is unchanged, the server residual,
which belongs to this rank's chunk, restarts from zero); a rank that did not exist when saving
starts from zero (its step count, the warm-up, is rank 0's: the same on every rank).

Loading is safe by default: ``torch.load(..., weights_only=True)`` only rebuilds tensors and
plain containers (dicts, lists, numbers, strings), so a file from a shared directory cannot run
code. ``load_checkpoint(..., weights_only=False)`` also unpickles other objects (e.g. an ``extra``
value of your own class): only for files you trust.
"""
import os
import pickle

import horovod.torch as _hvd
import torch

from hvdp.checkpoint import atomic_write, rank0_writes
from hvdp.cluster.flight import RECORDER as FLIGHT


def save_checkpoint(path, model, optimizer=None, **extra):
    """Collective: call on every rank. Rank 0 writes ``path`` (temporary file, fsync, rename).
    Where the write fails (a full or read-only disk), the previous file stays and every rank
    raises the same ``hvdp.checkpoint.CheckpointWriteError`` (an ``OSError``: path and cause).

    ``extra`` values made of tensors, numbers, strings, lists and dicts load back with the safe
    default of :func:`load_checkpoint`; other objects need ``weights_only=False`` there.

    Example::

        hvd.save_checkpoint("ckpt.pt", model, opt, epoch=epoch)
    """
    opt_state = optimizer.state_dict() if optimizer is not None else None
    per_rank = None
    if opt_state is not None and "hvdp" in opt_state:
        with FLIGHT.around("hvdp.ckpt.gather", "allgather_object"):
            per_rank = _hvd.allgather_object(opt_state.pop("hvdp"), name="hvdp.ckpt.gather")
    def write():
        state = {"model": model.state_dict(), "optimizer": opt_state, "hvdp_per_rank": per_rank,
                 "size": _hvd.size(), "extra": extra}
        atomic_write(path, lambda f: torch.save(state, f))
    # every rank learns that rank 0 is done writing, or raises its error (CheckpointWriteError)
    rank0_writes(write, _hvd.rank(), _hvd.broadcast_object, str(path))


def own_state(per_rank, rank):
    """What rank ``rank`` loads from the saved ranks' ``per_rank`` states (see the module's rule)."""
    if rank < len(per_rank):
        return per_rank[rank]
    out = dict(per_rank[0], reducer={})  # no codec named: every residual from zero
    if "engines" in out:  # hvd.OuterOptimizer's: residuals from zero, the global parameters
        out["engines"] = out["local"] = None
    return out


def _reason(err):
    """The line of torch's refusal that names what was refused (its first is generic)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Unpickler error" in ln or "Unsupported" in ln]
    return (named or lines or [type(err).__name__])[0]


def load_checkpoint(path, model, optimizer=None, map_location="cpu", weights_only=True):
    """Every rank reads ``path`` and restores model, optimizer and its own residuals.

    ``weights_only=True`` (default) refuses to unpickle anything but tensors and plain
    containers; pass ``weights_only=False`` only for a file you trust.

    Returns the ``extra`` values given to :func:`save_checkpoint`.
    """
    try:
        state = torch.load(path, map_location=map_location, weights_only=weights_only)
    except EOFError as e:  # torch says only "Ran out of input"
        raise EOFError(f"hvd.load_checkpoint('{path}'): the file ends early ({os.path.getsize(path)} bytes): it "
                       "is not a complete checkpoint (a copy or a write that was cut short?); load an earlier "
                       "one. hvd.save_checkpoint writes a temporary file and renames it, so its files are "
                       "whole.") from e
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        raise pickle.UnpicklingError(
            f"hvd.load_checkpoint('{path}'): the safe loader (torch.load(weights_only=True)) refused "
            f"an object in the file ({_reason(e)}). If you trust the file (loading it can run "
            f"code), pass load_checkpoint(..., weights_only=False).") from e
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        opt_state = dict(state["optimizer"])
        per_rank = state.get("hvdp_per_rank")
        if per_rank is not None:
            opt_state["hvdp"] = own_state(per_rank, _hvd.rank())
        optimizer.load_state_dict(opt_state)
    return state.get("extra", {})
