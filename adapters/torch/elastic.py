"""``hvd.elastic``: Horovod's elastic API, with state that carries hvdp's compression state and
a sampler that never skips or repeats a sample across resets.

Error feedback through a reset: ``commit`` saves the optimizer's ``state_dict`` (residuals
included), ``restore`` puts each rank's own back, and after a resize a residual is kept only
where its layout is unchanged (worker side: same padded bucket length; server side: same
number of workers), reset to zero otherwise -- the same rule on every rank.

Example::

    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            for idx in state.sampler:
                ...; opt.step(); state.sampler.record_batch(); state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
"""
import copy

import horovod.torch as _hvd
import torch
from horovod.torch.elastic import *  # noqa: F401,F403  (run, TorchState, ObjectState, ...)
from horovod.torch.elastic import TorchState, run  # noqa: F401
from horovod.torch.elastic.state import (OptimizerStateHandler, StateHandler, get_handler_registry,
                                         set_handler_registry)

from hvdp.cluster.elastic import ElasticOrder

from .functions import broadcast_optimizer_state


class ElasticSampler(ElasticOrder, torch.utils.data.Sampler):
    """Yields this rank's indices of every step; see :class:`hvdp.cluster.elastic.ElasticOrder`.

    With ``batch_size`` (hvdp's form), unlike Horovod's ``ElasticSampler``, it never pads the
    last step with repeated samples, and it counts what was processed per step block, so the
    rest of an epoch is re-split exactly. Without it, Horovod's ``ElasticSampler(dataset,
    shuffle=True, seed=0)``: a ``DataLoader`` sampler of this rank's sample indices, padded as
    Horovod's, with ``record_batch(batch_idx, batch_size)``.

    Example::

        sampler = hvd.elastic.ElasticSampler(dataset)               # as in Horovod
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    """

    def __init__(self, dataset, batch_size=None, shuffle=True, seed=0):
        n = dataset if isinstance(dataset, int) else len(dataset)
        super().__init__(n, batch_size, _hvd.rank, _hvd.size, shuffle, seed)


class _OrderHandler(StateHandler):
    def __init__(self, sampler):
        super().__init__(sampler)
        self._saved = copy.deepcopy(sampler.state_dict())

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)

    def sync(self):
        self.value.load_state_dict(_hvd.broadcast_object(self.value.state_dict(), root_rank=0))


class _OptimizerHandler(OptimizerStateHandler):
    """Drops the reductions a failed step left in flight (a worker died during backward, with
    some gradient hooks already launched), and syncs with hvdp's broadcast (its state-creating
    step is local, not a reduction)."""

    def _clear(self):
        clear = getattr(self.value, "abort_step", None)
        if clear is not None:
            clear()

    def restore(self):
        self._clear()
        super().restore()

    def sync(self):
        self._clear()
        check = getattr(self.value, "check_agreement", None)
        if check is not None:  # new workers may differ from the old ones (versions, settings)
            check()
        broadcast_optimizer_state(self.value, root_rank=0)


def _install_handlers():
    registry = [r for r in get_handler_registry() if r[1] not in (_OrderHandler, _OptimizerHandler)]
    set_handler_registry([(ElasticOrder, _OrderHandler), (torch.optim.Optimizer, _OptimizerHandler)] + registry)


_install_handlers()
