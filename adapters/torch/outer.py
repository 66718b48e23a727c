"""``hvd.OuterOptimizer``: outer steps on horovod.torch (``hvdp.outer``). The user's optimizer
takes every inner step alone; every ``sync_every`` steps the pseudo-gradient goes through the
engine and the outer SGD, and every worker continues from the global parameters.

Example::

    opt = hvd.OuterOptimizer(torch.optim.AdamW(model.parameters(), 1e-3),
                             named_parameters=model.named_parameters(), sync_every=8,
                             compression="int8", warmup_steps=96, buffers=model.named_buffers())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
"""
import horovod.torch as _hvd
import torch

from hvdp.config import overlap
from hvdp.outer import HIERARCHICAL_REFUSAL, OuterLoop, OuterSettings, outer_codec, warmup_steps_of
from hvdp.outer.loop import split
from hvdp.outer.stats import stats
from hvdp.reduce.collectives import SUM
from hvdp.reduce.engine import Engine
from hvdp.reduce.settings import ReduceSettings

from .agreement import REPORTER, VERSIONS, allgather_fixed
from .comm import TorchCollectives, next_instance
from .join import OUTER, StepControl
from .compression import resolve
from .layout import agreement_entries, named
from .ops import TorchOps
from .optimizer import _DistributedOptimizer, weak_hook
from .plain import TorchPlain
from .tensors import broadcast_

_OPS = TorchOps()


class _OuterOptimizer(torch.optim.Optimizer):
    """The user's optimizer class with outer steps after its ``step`` (see the module's docstring)."""

    _hvdp_outer = True  # how hvd.elastic tells this class (made on the fly from the user's) apart

    def __init__(self, params, named_parameters, outer, codec, hvd_compressor, policy, buffers, process_set,
                 warmup_codec=(None, None), backward_passes=1):
        super(self.__class__, self).__init__(params)
        self._outer_settings, self._process_set = outer, process_set
        self._names = {id(p): k for k, p in named(self.param_groups, named_parameters)}
        self._buffers = [(k, b) for k, b in (buffers or ()) if b.is_floating_point()]
        self._params = [p for g in self.param_groups for p in g["params"]]
        instance = next_instance(process_set)
        rs = ReduceSettings.from_user(codec, hvd_compressor, policy, instance=instance,
                                      extra=(("outer", outer.describe()),))
        numels = [p.numel() for p in self._params]
        self._fragments = split(numels, outer.fragments)
        comm = TorchCollectives(process_set, scope=f"hvdp.outer{instance}.")
        self._comm = comm
        self._join = StepControl(comm)  # uneven inputs: how many ranks take part in a sync
        self.engines = []
        entries = agreement_entries(self.param_groups, self._names)
        for f, idx in enumerate(self._fragments):
            eng = Engine(rs, _OPS, comm, TorchPlain(comm, rs.op, 1.0, hvd_compressor), allgather_fixed(process_set),
                         versions=VERSIONS, per_bucket_auto=False)
            ps = [self._params[i] for i in idx]
            eng.set_layout([self._names.get(id(p), f"param.{i}") for i, p in zip(idx, ps)],
                           [tuple(p.shape) for p in ps], [p.is_floating_point() for p in ps],
                           tensors=entries if f == 0 else None, at_creation=True)
            self.engines.append(eng)
        # the warm-up steps' reduction: an hvd.DistributedOptimizer of its own (its gradient hooks
        # start each bucket's exchange during backward), with warmup_compression's codec; its
        # residuals travel with the outer state (OuterLoop's warmup_engine) where it has any
        self._warm = self._warmup_reducer(warmup_codec, policy, backward_passes) if outer.warmup else None
        self._warm_engine = self._warm.engine if outer.warmup_compression != "none" else None
        self.outer = None  # made at the first step, from the parameters as broadcast by then
        # from the gradient hooks: a sync's join control, a streaming fragment's next phase
        self._overlap = overlap() and (getattr(process_set, "process_set_id", 0) or 0) == 0
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self, "_progress"))
                       for p in self._params] if self._overlap else []
        REPORTER.install()
        OUTER.add(self)

    def _warmup_reducer(self, codec, policy, backward_passes):
        """The reducer of the warm-up steps: ``hvd.DistributedOptimizer`` over the same parameters
        that never steps; its reductions start from the gradient hooks and finish as the step's
        last backward pass ends (the averages in ``.grad``, as DDP leaves them: a gradient clip
        before ``step()`` sees them); the user's optimizer steps. The ranks agree on its settings
        when it is made."""
        codec, hvd_compressor = codec
        settings = ReduceSettings.from_user(codec, hvd_compressor, policy, backward_passes=backward_passes,
                                            instance=next_instance(self._process_set),
                                            extra=(("outer", self._outer_settings.describe()), ("phase", "warm-up")))
        cls = type("OuterWarmup", (_GradientsOnly,), dict(_DistributedOptimizer.__dict__))
        named_params = [(self._names.get(id(p), f"param.{i}"), p) for i, p in enumerate(self._params)]
        return cls([{"params": list(g["params"])} for g in self.param_groups], named_params, settings, hvd_compressor,
                   None, self._process_set, finish_in_backward=True)

    def _follow_warmup(self) -> None:
        """The warm-up reducer's hooks on while the next step is a warm-up step, off after it (on
        again where a restore goes back into the warm-up)."""
        if self._warm is not None:
            self._warm.set_hooks(self.outer is None or self.outer.warming_up)

    def _progress(self, _param=None):
        """From a gradient hook, while the inner step's backward goes on: where this step ends
        with a sync, its join control is submitted (``step()`` then finds it summed); every
        fragment in flight whose collective is done starts its next phase (``OuterLoop.progress``)."""
        loop = self.outer
        if loop is None:
            return
        begin = not self._join.begun and self._comm.size > 1 and loop.syncs_next()
        if not (begin or loop.in_flight):  # most hooks of most steps: nothing to do
            return
        with torch.no_grad(), REPORTER.explaining():
            if begin:
                self._join.begin()
            if loop.in_flight:
                loop.progress()

    def _new_loop(self):
        return OuterLoop(self._outer_settings, _OPS, self.engines, self._fragments,
                         [p.detach() for p in self._params], active=self._active, warmup_engine=self._warm_engine)

    def _active(self) -> int:
        """The ranks taking part in the sync starting now (a joined rank adds a zero): the join
        control begun in this step's backward (or now), then made ready for the next sync."""
        n = self._join.active()
        self._join.reset()
        return n

    def step(self, closure=None):
        """The inner step (the user's optimizer, local), then the outer loop's syncs due now. A
        warm-up step first averages the gradients (those its ``closure``, where given, makes)."""
        if self.outer is None:
            self.outer = self._new_loop()
        loss = None
        if self.outer.warming_up:
            if closure is not None:  # Lightning's step: forward and backward inside; their gradients
                with torch.enable_grad():
                    loss = closure()
                closure = None
            self._warm.synchronize_once()  # (finished as backward ended, where it ran)
        out = super(self.__class__, self).step(closure)
        with torch.no_grad(), REPORTER.explaining():
            landed = self.outer.after_step([p.detach() for p in self._params])
            for i, value in landed:
                self._params[i].copy_(value)
            if landed and self._buffers and 0 in {self._fragment_of(i) for i, _ in landed}:
                self._average_buffers()
        self._follow_warmup()
        return out if loss is None else loss

    def zero_grad(self, set_to_none=True):
        if self._warm is not None:  # a warm-up step's reductions in flight
            self._warm.check_idle()
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def abort_step(self):
        """Drop every reduction in flight (the fragments', the warm-up's) and the join control:
        a failed step (elastic reset)."""
        for eng in self.engines:
            eng.abort()
        if self._warm is not None:
            self._warm.abort_step()
        self._join.reset()

    def remove_hooks(self) -> None:
        """Stop reducing from the gradient hooks (a training framework calls it when its run ends)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._warm is not None:
            self._warm.remove_hooks()

    def every_engine(self):
        """The fragments' engines and the warm-up's (``warmup_compression``), in the order of
        ``OuterLoop.state()["engines"]``."""
        return self.engines + ([self._warm_engine] if self._warm_engine is not None else [])

    def _fragment_of(self, i):
        return next(f for f, idx in enumerate(self._fragments) if i in idx)

    @torch.no_grad()
    def _average_buffers(self):
        """Batch-norm statistics and other float buffers: averaged with the first fragment (over
        the ranks that took part in its sync)."""
        comm = self.engines[0].comm
        sums = [b.clone() for _, b in self._buffers]  # summed in place
        handles = [comm.allreduce_async(t, f"hvdp.buf.{k}", SUM) for (k, _), t in zip(self._buffers, sums)]
        n = self.outer.took_part[0]
        for (_, b), h in zip(self._buffers, handles):
            b.copy_(comm.wait(h) / n)

    def join_refusal(self):
        """Why ``hvd.join()`` cannot be answered now (None: it can): a fragment in flight, whose
        second phase this rank would never send."""
        if self._join.begun:
            return ("hvd.join() was called between the backward and the step() of an inner step that ends with "
                    "an outer sync (its join control is already sent: the other ranks count this rank in). Fix: "
                    "call hvd.join() after opt.step(), where the training loop runs out of data")
        if self._warm is not None and self._warm.in_step:
            return ("hvd.join() was called between the backward and the step() of a warm-up step (its gradients' "
                    "reduction is already under way: the other ranks count this rank in). Fix: "
                    "call hvd.join() after opt.step(), where the training loop runs out of data")
        if self.outer is not None and self.outer.in_flight:
            return (f"hvd.join() was called while hvd.OuterOptimizer has a fragment in flight (delay="
                    f"{self._outer_settings.delay}): its reduction needs this rank's next step. Fix: call "
                    "hvd.join() at a step where opt.outer.in_flight is False, or use delay=0")
        return None

    @torch.no_grad()
    def sync_from(self, root: int) -> None:
        """After every rank joined: ``root``'s parameters and outer state (global parameters,
        momentum, step counters) on every rank; residuals and the inner optimizer's state stay
        each rank's own."""
        if self._comm.size <= 1 or self._process_set.process_set_id != 0:
            return
        if self.outer is None:
            self.outer = self._new_loop()
        loop = self.outer
        meta = _hvd.broadcast_object({"step": loop.step, "warm": loop.warm, "outer_steps": loop.outer_steps,
                                      "momentum": [m is not None for m in loop.momentum]}, root,
                                     name="hvdp.outer.join.meta")
        loop.step, loop.warm, loop.outer_steps = meta["step"], meta["warm"], list(meta["outer_steps"])
        loop.momentum = [(m if m is not None else torch.zeros_like(g)) if has else None
                         for m, g, has in zip(loop.momentum, loop.globals, meta["momentum"])]
        items = [(f"hvdp.outer.join.p{i}", p.data) for i, p in enumerate(self._params)]
        items += [(f"hvdp.outer.join.g{i}", g) for i, g in enumerate(loop.globals)]
        items += [(f"hvdp.outer.join.m{i}", m) for i, m in enumerate(loop.momentum) if m is not None]
        broadcast_(items, root, self._process_set)
        self._follow_warmup()

    def check_agreement(self):
        """Raise the same error on every rank unless all ranks reduce the same tensors with the
        same outer settings (after an elastic reset: new workers may differ)."""
        self.engines[0].check(agreement_entries(self.param_groups, self._names))

    def compression_stats(self) -> dict:
        """Each fragment's ``compression_stats()`` (per sync) and the bytes one worker sends per
        inner step: every fragment's mean bytes per sync, divided by H."""
        return stats(self._outer_settings, self.engines, self.outer)

    def state_dict(self, drop_in_flight=False):
        """The inner optimizer's state, the outer loop's (``hvdp_outer``: the same on every rank)
        and this rank's own (``hvdp``: its residuals, its inner optimizer's state and, inside an
        interval, its local parameters; ``hvd.save_checkpoint`` keeps every rank's).
        ``drop_in_flight`` (elastic commits): see ``OuterLoop.state``."""
        state = super(self.__class__, self).state_dict()
        if self.outer is not None:
            outer = self.outer.state(drop_in_flight)
            state["hvdp"] = {"engines": outer.pop("engines"), "local": [p.detach().clone() for p in self._params],
                             "inner": super(self.__class__, self).state_dict()}
            state["hvdp_outer"] = outer
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        outer, mine = state_dict.pop("hvdp_outer", None), state_dict.pop("hvdp", None)
        # the inner state is each rank's own (rank 0's in the shared part of a checkpoint)
        super(self.__class__, self).load_state_dict((mine or {}).get("inner") or state_dict)
        if outer is not None:
            self.outer = self._new_loop()
            self.outer.load_state(dict(outer, engines=(mine or {}).get("engines")))
            local = (mine or {}).get("local")  # None: a rank that did not save starts from the global ones
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    p.copy_(local[i] if local is not None else self.outer.globals[i])
        self._follow_warmup()


class _GradientsOnly(torch.optim.Optimizer):
    """The base of the warm-up's reducer: an optimizer over the parameters without a step."""

    def __init__(self, params):
        super().__init__(params, {})


def is_outer_class(cls) -> bool:
    """Whether ``cls`` is an ``hvd.OuterOptimizer``'s class (made on the fly from the user's)."""
    return bool(getattr(cls, "_hvdp_outer", False))


def OuterOptimizer(optimizer, named_parameters=None, sync_every=None, outer_lr=0.7, outer_momentum=0.9,
                   nesterov=True, compression="none", fragments=1, delay=0, mix=0.0, warmup_steps=None, policy=None,
                   buffers=None, hierarchical=False, process_set=_hvd.global_process_set, warmup_compression="none",
                   backward_passes_per_step=1):
    """Outer steps around ``optimizer`` (DiLoCo; local SGD with ``outer_lr=1, outer_momentum=0``).

    Args:
        optimizer: the inner optimizer (its state stays local to each worker).
        named_parameters: ``model.named_parameters()``, as for ``hvd.DistributedOptimizer``.
        sync_every: H, inner steps between syncs (required); ``"auto"``: chosen after a probe of
            6 inner steps from the measured step and exchange (``hvdp.outer.auto``).
        outer_lr, outer_momentum, nesterov: the outer SGD on the averaged pseudo-gradient.
        compression: the pseudo-gradient's codec: "none", "fp16", "bf16", "int8", "int4", "topk"
            (error feedback carried from one outer step to the next).
        fragments, delay, mix: streaming (``hvdp.outer.OuterSettings``).
        warmup_steps: W synchronous steps first (the gradients averaged before each inner step,
            as ``start_localSGD_iter`` of PyTorch's post-local SGD); the intervals start after them.
            Not given: 0, and rank 0 warns (``hvdp.outer.NoWarmupWarning``): from scratch, give one.
        warmup_compression: the warm-up steps' codec: "none" (float32) or "fp16", "bf16", "int8",
            "int4", "topk" (each step as ``hvd.DistributedOptimizer`` with that compression,
            error feedback included); on a slow link the float32 warm-up costs the most.
        policy: an ``hvdp.CompressionPolicy`` (which tensors are compressed).
        buffers: ``model.named_buffers()``: float buffers averaged at the first fragment's syncs.
        hierarchical: refused (True): outer steps reduce over every rank at once.
        backward_passes_per_step: backward passes per ``step()`` in the warm-up (gradient
            accumulation; as ``hvd.DistributedOptimizer``'s: its reduction starts from the hooks
            of the last pass). The intervals' inner steps accumulate as they like.

    Example::

        opt = hvd.OuterOptimizer(opt, named_parameters=model.named_parameters(), sync_every=8)
    """
    if sync_every is None:
        raise ValueError("hvd.OuterOptimizer needs sync_every=H, the inner steps between syncs (e.g. 8)")
    if hierarchical:
        raise ValueError(HIERARCHICAL_REFUSAL)
    codec, hvd_compressor = outer_codec(resolve(compression), "compression", compression)
    warm = outer_codec(resolve(warmup_compression), "warmup_compression", warmup_compression)
    outer = OuterSettings(sync_every, outer_lr, outer_momentum, nesterov, fragments, delay, mix,
                          warmup_steps_of(warmup_steps, _hvd.rank()), warm[0].name)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_OuterOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, outer, codec, hvd_compressor, policy,
               list(buffers) if buffers is not None else None, process_set, warm, backward_passes_per_step)
