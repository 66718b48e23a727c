"""The optimizer ``hvd.DistributedOptimizer`` returns (``distributed.py`` makes it): Horovod's
semantics (hooks, delay counters, skip_synchronize) driving hvdp's engine (``hvdp.reduce.engine``:
plan, codecs, buckets, auto, statistics, residuals).

The returned object is an instance of a class made on the fly as a subclass of the user's
optimizer class (as Horovod does), so ``step``, ``zero_grad``, ``state_dict``, LR schedulers and
``torch.amp.GradScaler`` keep working.
"""
import warnings
import weakref
from contextlib import contextmanager

import torch

from hvdp.config import elastic_mode, overlap
from hvdp.reduce.engine import Engine

from .agreement import REPORTER, VERSIONS, allgather_fixed
from .comm import TorchCollectives
from .compiled import CompiledCodec
from .join import OPTIMIZERS, StepControl
from .layout import agreement_entries, make_layout, named, trainable_ids
from .mesh import levels
from .ops import TorchOps
from .plain import TorchPlain
from .presence import Presence

_OPS = TorchOps()


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is an ``hvd.DistributedOptimizer`` of hvdp's (its class is made on
    the fly from the user's, so it is told by a class attribute, not by ``isinstance``)."""
    return getattr(type(optimizer), "_hvdp_distributed", False)


def _made(optimizer) -> type:
    """The class DistributedOptimizer made for ``optimizer``: ``super()`` starts above it even for
    an instance of a subclass of it (Lightning's LightningOptimizer is one: with
    ``super(self.__class__, self)`` its ``zero_grad`` recursed without end)."""
    return next(c for c in type(optimizer).__mro__ if c.__dict__.get("_hvdp_distributed"))


class _DistributedOptimizer(torch.optim.Optimizer):
    _hvdp_distributed = True

    def __init__(self, params, named_parameters, settings, hvd_compressor, groups, process_set,
                 compile_codecs=False, finish_in_backward=False):
        super(_made(self), self).__init__(params)
        comm = TorchCollectives(process_set, scope=f"hvdp.opt{settings.instance}.")
        self._comm, self._groups_arg = comm, groups
        self._all_names = {id(p): k for k, p in named(self.param_groups, named_parameters)}
        # uneven inputs (hvdp.reduce.join): a per-step "has anyone joined?" for the two-phase buckets
        self._join = StepControl(comm) if (settings.uneven_inputs and settings.two_phase) else None
        ctl = weakref.ref(self._join) if self._join is not None else None  # the hooks must not keep self
        self.engine = Engine(settings, _OPS, comm, TorchPlain(comm, settings.op, settings.predivide, hvd_compressor),
                             allgather_fixed(process_set), versions=VERSIONS,
                             wrap_codec=CompiledCodec if compile_codecs else None,
                             joined=(lambda: ctl().joined()) if ctl is not None else None,
                             levels=(lambda: levels(process_set, settings.instance)) if settings.hierarchical else None)
        self._presence = Presence(comm)
        # HVDP_OVERLAP: buckets' next phases from the hooks; the global process set only (inside
        # a mesh's DP group one CI run of the Gloo mesh job failed with it on: not yet checked there)
        self._overlap = overlap() and (getattr(process_set, "process_set_id", 0) or 0) == 0
        self._hooks, self._hooked = [], set()
        REPORTER.install()  # needs the rank, so after hvd.init
        self._set_layout(make_layout(self.param_groups, self._all_names, groups, self.engine, at_creation=True))
        self._end_step()
        self._synchronized, self._should_synchronize = False, True
        # hvd.OuterOptimizer's warm-up: the step's reductions finished as its last backward pass
        # ends (as DDP's), so whatever runs between backward and step() sees the averages
        self._finish_in_backward, self._queued, self._passes = finish_in_backward, False, 0
        OPTIMIZERS.add(self)
        # Like Horovod, a single worker skips the hooks, except that a real codec still applies
        # (so its effect can be seen and tested on one worker).
        self._wants_hooks = comm.size > 1 or elastic_mode() or settings.codec_name not in ("none", "horovod")
        if self._wants_hooks:
            self._register_hooks()

    # --- set-up -----------------------------------------------------------------------------
    def _set_layout(self, layout) -> None:
        self._layout = layout
        self._params, self._name = layout.params, layout.name
        self._index = {p: i for i, p in enumerate(layout.params)}
        # auto's probe arrays go where the gradients are; its trial waits for their device
        self._like = self._params[0].detach() if self._params else torch.zeros(0)
        self._sync = torch.cuda.synchronize if self._like.is_cuda else (lambda: None)
        if self._join is not None:
            self._join.device = self._params[0].device if self._params else None

    def _register_hooks(self):
        hook = weak_hook(self)
        for p in self._params:
            if p not in self._hooked:
                self._hooked.add(p)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _begin_step(self) -> None:
        """Before anything of the step is launched: a parameter unfrozen since the plan was made
        is reduced from now on, a frozen one leaves it (its gradient stays None, as in plain
        torch; every rank must change the same parameters: checked); auto's decision."""
        self._fresh = False
        self._presence.finish_if_done()  # the last step's sum, in the flight record as done
        if trainable_ids(self.param_groups) != [id(p) for p in self._params]:
            self._set_layout(make_layout(self.param_groups, self._all_names, self._groups_arg,
                                         self.engine, strict=False))
            self._delay = {p: self.engine.settings.backward_passes for p in self._params}
            if self._hooks:
                self._register_hooks()
        self.engine.begin_step(self._like, self._sync)

    # --- per-gradient path ------------------------------------------------------------------
    def _hook(self, p):
        if self._finish_in_backward and not self._queued:  # this backward pass's first gradient
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self._fresh:  # the step's first gradient: nothing launched yet
            self._begin_step()
        if p not in self._delay:  # frozen since: not reduced (its gradient is the user's)
            return
        if self._join is not None:
            self._join.begin()
        if self._delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step="
                                 f"{self.engine.settings.backward_passes} times before step(); raise "
                                 "backward_passes_per_step to accumulate more passes locally")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            with REPORTER.explaining():  # once Horovod is down, launching fails first
                self._launch(p)
        if self._overlap and self.engine.in_flight:
            self._progress()

    def _backward_done(self):
        """At the end of a backward pass (``finish_in_backward``): after the step's last pass,
        its reductions finished and the averages in ``p.grad``."""
        self._queued = False
        self._passes += 1
        if self._passes >= self.engine.settings.backward_passes:
            self._passes = 0
            with torch.no_grad():
                self.synchronize()

    def synchronize_once(self):
        """``synchronize()`` unless this step's averages are already in ``p.grad`` (finished at
        the end of backward); the next step starts afresh."""
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False

    def _progress(self):
        """Every bucket in flight whose collective is done starts its next phase now, while
        backward goes on (``Engine.progress``); a failed collective fails the step as in
        :meth:`synchronize`."""
        try:
            with REPORTER.explaining():
                self.engine.progress()
        except BaseException:
            self.abort_step()
            raise

    def _launch(self, p):
        eng, lay = self.engine, self._layout
        if p.grad is None:  # another rank may have one: reduce zeros (Presence decides after)
            self._absent.append(p)
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and eng.settings.sparse_as_dense:
            p.grad = p.grad.to_dense()
            self._densified.append(p)  # handed back sparse, as Horovod does (SparseAdam needs it)
        b = lay.bucket_of.get(p)
        if b is not None and eng.packs(b):
            self._bucket_ready[b] = self._bucket_ready.get(b, 0) + 1
            if self._bucket_ready[b] == len(eng.plan.buckets[b]):
                self._start_bucket(b)
            return
        group = (lay.plain_groups if eng.compressing else lay.groups).get(p)
        if group is None or p.grad.is_sparse:
            self._handles[p] = eng.start_plain([p.grad], self._name[p])[0]
            return
        self._group_ready[group] = self._group_ready.get(group, 0) + 1
        if self._group_ready[group] == len(group):
            for q, pend in zip(group, self.engine.start_plain([q.grad for q in group], self._name[group[0]])):
                self._handles[q] = pend

    def _start_bucket(self, b):
        self.engine.start_bucket(b, [self._params[i].grad for i in self.engine.plan.buckets[b]])

    # --- synchronize / step -----------------------------------------------------------------
    def synchronize(self):
        """Finish every reduction of this step and write the averaged gradients into ``p.grad``."""
        if not self._hooks:
            self._synchronized = True
            return
        try:
            # this rank's own error is reported to the others; Horovod's bare shut-down
            # becomes the same exception type naming the rank that failed and why
            with REPORTER.explaining():
                try:
                    self._synchronize()
                except BaseException:
                    self._presence.reset()  # before the failure's dump: a sum Horovod finished reads done
                    raise
        except BaseException:
            # a failed collective (a worker died: elastic reset) must not leave this step's
            # half-done reductions behind for the restored state to trip over
            self.abort_step()
            raise

    def abort_step(self):
        """Drop this step's reductions in flight (a failed step; elastic restore and sync)."""
        self._queued, self._passes = False, 0
        self.engine.abort()
        self._presence.reset()
        self._end_step()

    def _end_step(self):
        self._handles, self._bucket_ready, self._group_ready = {}, {}, {}
        self._delay = {p: self.engine.settings.backward_passes for p in self._params}
        self._fresh, self._absent, self._densified = True, [], []
        if self._join is not None:
            self._join.reset()

    def _synchronize(self):
        eng = self.engine
        if self._fresh:  # step() without backward
            self._begin_step()
        for p in self._params:  # unused in this step's graph, or fewer passes than configured
            if self._delay[p] > 0 and (p not in self._handles):
                self._delay[p] = 0
                self._launch(p)
        absent = set(self._absent)
        self._presence.submit([p not in absent for p in self._params],
                              self._params[0].device if self._params else None, eng.step)
        for b in range(len(eng.plan.buckets)):  # a bucket with params never reaching a hook
            if eng.packs(b) and not eng.started(b):
                self._start_bucket(b)
        eng.exchange_all()
        for p, pend in self._handles.items():
            out = eng.plain.finish(pend)
            if out.is_sparse or p.grad.is_sparse:
                p.grad = out
            elif out is not p.grad:
                p.grad.copy_(out)
        for b, flat in eng.finish_buckets():
            for i, piece in eng.pieces(b, flat):
                g = self._params[i].grad
                g.copy_(piece.view_as(g))
        self._presence.finish_if_done()
        if eng.compressing and eng.keeps_residuals:
            self._discard_if_not_finite()
        for p in self._densified:
            p.grad = p.grad.to_sparse()
        if self._absent:  # no rank had a gradient: None, as plain torch leaves it
            for p, none in zip(self._absent, self._presence.nobody_had([self._index[p] for p in self._absent])):
                if none:
                    p.grad = None
        if self._join is not None:
            self._join.end_step()
        self._end_step()
        eng.end_step(self._sync)
        self._synchronized = True

    def _discard_if_not_finite(self):
        """A step with a non-finite reduced gradient anywhere (plain tensors included) is one a
        loss scaler skips: its error-feedback residuals are undone (``Engine.discard_step``).
        Every rank reads the same reduced values, so all decide alike; one device sync."""
        grads = [p.grad for p in self._params if p.grad is not None and not p.grad.is_sparse]
        if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
            self.engine.discard_step()

    @contextmanager
    def skip_synchronize(self):
        """Let ``step()`` skip its synchronize (already called by hand, e.g. for GradScaler)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() after optimizer.synchronize() reduces the gradients "
                              "again; wrap the step in `with optimizer.skip_synchronize():`")
            self.synchronize()
        self._synchronized = False
        return super(_made(self), self).step(closure)

    def zero_grad(self, set_to_none=True):
        self.check_idle()
        return super(_made(self), self).zero_grad(set_to_none=set_to_none)

    def check_idle(self) -> None:
        """Raise where this step's reductions are in flight (``zero_grad`` would race with them)."""
        if self._handles or self.engine.in_flight:
            raise AssertionError("optimizer.zero_grad() between loss.backward() and optimizer.step() "
                                 "(or synchronize()) would race with the gradient reduction; call it "
                                 "before backward or after step")

    @property
    def in_step(self) -> bool:
        """Whether this step's reduction has begun (a gradient hook ran since the last step)."""
        return not self._fresh

    # --- hvdp additions ---------------------------------------------------------------------
    def remove_hooks(self) -> None:
        """Stop reducing: the gradient hooks leave the parameters (a training framework calls it
        when its run ends, so a later optimizer over the same parameters is the only one reducing)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self._hooked = [], set()

    def set_hooks(self, on: bool) -> None:
        """Reduce from the gradient hooks (``on``; where this optimizer reduces at all: more than
        one worker, elastic, or a codec) or not (``hvd.OuterOptimizer``'s warm-up reducer after
        the warm-up; ``synchronize`` then does nothing)."""
        if not on:
            self.remove_hooks()
        elif self._wants_hooks and not self._hooks:
            self._register_hooks()

    def check_agreement(self):
        """Raise the same error on every rank unless all ranks reduce the same tensors the same
        way (run at creation and after every elastic reset; ``HVDP_CHECK_AGREEMENT=0``: never)."""
        self.engine.check(agreement_entries(self.param_groups, self._all_names))

    def compression_stats(self):
        """Bytes handed to collectives per step by codec vs a float32 ring (see WireStats); with
        ``compression="auto"`` also ``"auto"``: the codec per bucket and the costs behind it."""
        return self.engine.summary()

    def state_dict(self):
        sd = super(_made(self), self).state_dict()
        sd["hvdp"] = self.engine.state()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdp", None)
        super(_made(self), self).load_state_dict(state_dict)
        self.engine.load_state(extra)


def weak_hook(opt, method="_hook"):
    """A gradient hook calling ``opt.<method>(p)``, holding the optimizer weakly: a dropped
    optimizer is freed."""
    ref = weakref.ref(opt)

    def hook(p):
        o = ref()
        if o is not None:
            getattr(o, method)(p)
    return hook
