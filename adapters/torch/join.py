"""``hvd.join()`` for hvdp's torch optimizers, and their per-step join control.

The rules are the core's (``hvdp.reduce.join``); this file supplies the collectives and the tensors.
"""
import gc

import horovod.torch as _hvd
import torch

from hvdp.cluster.flight import RECORDER as FLIGHT
from hvdp.reduce.join import CONTROL_NAME, JoinRefused, Registry, someone_joined

from .comm import synchronize
from .functions import broadcast_optimizer_state
from .tensors import broadcast_

OPTIMIZERS = Registry()  # every hvdp DistributedOptimizer, in creation order
OUTER = Registry()  # every hvd.OuterOptimizer, in creation order


class StepControl:
    """A 1 summed over the ranks once per step (the join control, on by default for two-phase
    codecs; ``uneven_inputs``): a joined rank adds the
    zero Horovod's join gives it, so every active rank learns the same "someone has joined".

    Submitted at the step's first gradient hook; waited on before the first two-phase bucket
    is sent (or at the end of the step), so it overlaps the rest of backward.
    """

    def __init__(self, comm, device=None):
        self._comm, self.device = comm, device  # the gradients' device: a joined rank makes
        self.reset()                             # all its zeros on one device (its join's)

    def reset(self):
        self._flag, self._handle, self._rec, self._joined = None, None, None, None

    @property
    def begun(self) -> bool:
        """Whether this rank's flag is being summed (submitted, not yet waited for)."""
        return self._handle is not None

    def begin(self):
        if self._handle is None and self._joined is None and self._comm.size > 1:
            self._flag = torch.ones(1, device=self.device)
            # scoped per optimizer: two optimizers' controls may be in flight together
            name = self._comm.scope + CONTROL_NAME
            self._handle, self._rec = FLIGHT.submitted(
                lambda: _hvd.allreduce_async_(self._flag, name=name, op=_hvd.Sum,
                                              process_set=self._comm.process_set),
                name, "none", "allreduce (join control)", 4)

    def _wait(self):
        """The control's sum (its flight record ends here: done, or failed where the wait raised)."""
        handle, rec, self._handle, self._rec = self._handle, self._rec, None, None
        FLIGHT.waited(rec, lambda: synchronize(handle, self._comm.scope + CONTROL_NAME))

    def joined(self) -> bool:
        return self.active() < self._comm.size

    def active(self) -> int:
        """How many ranks take part in this step (the size where none has joined)."""
        if self._joined is None:
            if self._comm.size <= 1:
                self._joined, self._active = False, self._comm.size
            else:
                self.begin()
                self._wait()
                self._joined = someone_joined(self._flag.item(), self._comm.size)
                self._active = int(round(self._flag.item()))
        return self._active

    def end_step(self):
        if self._handle is not None:  # every active rank submitted it: wait for it here
            self._wait()
        self.reset()


def _sync_from(opt, root: int) -> None:
    """Parameters, optimizer state and step count of ``root`` (it ran every step) on every rank.
    Residuals stay each rank's own."""
    params = [p for g in opt.param_groups for p in g["params"]]
    broadcast_([(f"hvdp.join.sync.{i}", p.data) for i, p in enumerate(params)], root,
               opt.engine.comm.process_set)  # any dtype (bf16) and layout (channels_last)
    broadcast_optimizer_state(opt, root)
    opt.engine.step = _hvd.broadcast_object(opt.engine.step, root, name="hvdp.join.step")


def join(device: int = -1) -> int:
    """Horovod's ``join`` (this rank has run out of data; the others go on, and this call returns
    once every rank has joined), made safe for hvdp's codecs.

    With hvdp's optimizers as created by default (any codec, a flat reduction), the active ranks
    reduce as Horovod does with joined ranks (sum of the active ranks divided by the size);
    afterwards every optimizer's parameters and state are broadcast from the last rank to join,
    so all ranks are identical. Buffers the optimizer does not hold (e.g. BatchNorm statistics)
    are the caller's to broadcast. An optimizer whose join control is off while it has
    bf16/int8/int4/topk (or powersgd, or two-level) buckets makes this raise
    :class:`hvdp.reduce.join.JoinRefused`, saying why: created with ``uneven_inputs=False``, powersgd,
    or ``hierarchical=True``.

    Example::

        for batch in my_shard:          # ranks have different numbers of batches
            ...; opt.step()
        hvd.join()                      # then all ranks hold the same model

    Args:
        device: where this rank makes its zero contributions (Horovod's argument); by default the
            CUDA device of the optimizers' parameters if they are on one, else the CPU.

    ``hvd.OuterOptimizer``: the syncs after a join average over the ranks that took part, and
    afterwards every rank gets the last rank's parameters and outer state (docs/outer-steps.md).

    Returns:
        the rank that joined last.
    """
    gc.collect()  # an optimizer dropped earlier should not refuse or be synced below
    opts, outers = OPTIMIZERS.alive(), OUTER.alive()
    for opt in opts:
        why = opt.engine.join_refusal("torch")
        if why is not None:
            raise JoinRefused(why)
    for opt in outers:
        why = opt.join_refusal()
        if why is not None:
            raise JoinRefused(why)
    if device == -1:  # Horovod's default is the CPU; the zeros must be where the gradients are
        device = next((p.device.index for o in opts for g in o.param_groups for p in g["params"]
                       if p.device.type == "cuda"), -1)
    last = int(_hvd.join(device))
    # only those alive on every rank: no broadcast on some ranks only
    opts = OPTIMIZERS.alive_on_every_rank(_hvd.allgather_object, "hvdp.join.alive")
    outers = OUTER.alive_on_every_rank(_hvd.allgather_object, "hvdp.join.outer")
    for opt in opts:  # Horovod's join is global: a process set's ranks are not these ranks
        comm = opt.engine.comm
        if comm.size > 1 and comm.process_set.process_set_id == 0:
            _sync_from(opt, last)
    for opt in outers:
        opt.sync_from(last)
    return last
