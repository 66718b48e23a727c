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
import abc
import copy

import horovod.torch as _hvd
import torch
from horovod.torch.elastic import *  # noqa: F401,F403  (run, TorchState, ObjectState, ...)
from horovod.torch.elastic import TorchState  # noqa: F401
from horovod.torch.elastic import run as _horovod_run
from horovod.torch.elastic.state import (OptimizerStateHandler, StateHandler, get_handler_registry,
                                         set_handler_registry)

from hvdp.cluster.elastic import ElasticOrder, recorded_attempts

from .functions import broadcast_optimizer_state
from .outer import is_outer_class
from .tensors import broadcast_


def run(func):
    """Horovod's ``hvd.elastic.run``; each attempt also starts a new world in the flight record, and
    the state's broadcasts are recorded (``hvdp.cluster.elastic.recorded_attempts``)."""
    return _horovod_run(recorded_attempts(func))


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


class _Outer(abc.ABC):
    """Matches an ``hvd.OuterOptimizer`` (its class is made on the fly from the user's, so it is
    told by a class attribute)."""

    @classmethod
    def __subclasshook__(cls, sub):
        return True if is_outer_class(sub) else NotImplemented


class _OuterHandler(_OptimizerHandler):
    """``hvd.OuterOptimizer`` through a reset (docs/outer-steps.md, "Elastic training").

    ``save``: its ``state_dict`` (global parameters, outer momentum, step counters, this rank's
    residuals, inner state and local parameters); a fragment in flight (``delay > 0``) is saved
    as not synced, so a commit at any step works and a restore drops that one sync. ``restore``:
    each rank's own back. ``sync``: rank 0's outer state and inner optimizer state on every rank,
    every rank's parameters restarted from the global ones (what a lost worker's interval had
    done is lost, nothing before it), each rank's residuals kept where their layout is unchanged
    (the server side only at the same number of workers; a new rank starts from zero).
    """

    def __init__(self, optimizer):
        StateHandler.__init__(self, optimizer)
        self.save()

    def save(self):
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict(drop_in_flight=True))
        self._size = self.value.engines[0].comm.size  # the residuals' number of workers

    def _clear(self):
        self.value.abort_step()  # a failed step's reductions and join control; Horovod's handles are gone

    def restore(self):
        self._clear()
        saved = self._saved_optimizer_state  # a copy: load_state_dict keeps the tensors it is given
        self.value.load_state_dict(copy.deepcopy(saved))
        if "hvdp_outer" not in saved:  # committed before the first step
            self.value.outer = None
        self.value._follow_warmup()

    def sync(self):
        opt = self.value
        self._clear()
        if opt.outer is not None and opt.outer.in_flight:  # a reset right after commit(): its state
            self.restore()
        opt.check_agreement()
        loop, comm = opt.outer, opt.engines[0].comm
        mine = None
        if loop is not None:
            mine = {k: v for k, v in loop.state(drop_in_flight=True).items()
                    if k not in ("globals", "momentum", "engines")}
            mine.update(has_momentum=[m is not None for m in loop.momentum],
                        engine_steps=[e.step for e in opt.every_engine()])
        meta = _hvd.broadcast_object(mine, 0, name="hvdp.outer.elastic.meta")
        inner = _hvd.broadcast_object(super(type(opt), opt).state_dict(), 0, name="hvdp.outer.elastic.inner")
        if meta is None:  # rank 0 has not stepped yet: nor has anyone
            opt.load_state_dict(inner)
            opt.outer = None
            opt._follow_warmup()
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        globs = loop.globals if loop is not None else [torch.zeros_like(p, dtype=torch.float32) for p in params]
        moms = [(loop.momentum[i] if loop is not None and loop.momentum[i] is not None else torch.zeros_like(g))
                if has else None for i, (g, has) in enumerate(zip(globs, meta.pop("has_momentum")))]
        broadcast_([(f"hvdp.outer.elastic.g{i}", g) for i, g in enumerate(globs)] +
                   [(f"hvdp.outer.elastic.m{i}", m) for i, m in enumerate(moms) if m is not None], 0,
                   comm.process_set)
        steps = meta.pop("engine_steps")
        own = [e.state() if loop is not None else {"reducer": None} for e in opt.every_engine()]
        for st, step in zip(own, steps):  # rank 0's count (a policy warm-up must end on every rank at once)
            st["step"] = step
            if isinstance(st.get("reducer"), dict) and "size" in st["reducer"]:
                st["reducer"] = dict(st["reducer"], size=self._size)  # made at that size: kept where it matches
        # no local parameters: every rank starts from the global ones (OuterOptimizer.load_state_dict)
        opt.load_state_dict(dict(inner, hvdp_outer=dict(meta, globals=globs, momentum=moms),
                                 hvdp={"engines": own, "local": None, "inner": inner}))
        self._size = comm.size


def _install_handlers():
    registry = [r for r in get_handler_registry() if r[1] not in (_OrderHandler, _OuterHandler, _OptimizerHandler)]
    set_handler_registry([(ElasticOrder, _OrderHandler), (_Outer, _OuterHandler),
                          (torch.optim.Optimizer, _OptimizerHandler)] + registry)


_install_handlers()
