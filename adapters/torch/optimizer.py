"""``hvd.DistributedOptimizer``: Horovod's semantics, with hvdp's codecs, buckets and metrics.

The returned object is an instance of a class made on the fly as a subclass of the user's
optimizer class (as Horovod does), so ``step``, ``zero_grad``, ``state_dict``, LR schedulers and
``torch.amp.GradScaler`` keep working.
"""
import os
import warnings
from contextlib import contextmanager

import horovod.torch as _hvd
import torch

from hvdp.collectives import AVERAGE, SUM
from hvdp.config import HVDP_COMPILE_CODECS
from hvdp.codecs.auto import Auto
from hvdp.plan import CompressionPolicy
from hvdp.stats import WireStats

from . import plain
from .agreement import REPORTER, check_optimizer
from .autochoice import ensure_decided, make_reducer, step_done
from .comm import TorchCollectives, next_instance
from .compression import Compression, resolve
from .join import OPTIMIZERS, StepControl
from .layout import Layout, kept_buckets, make_layout, named, trainable_ids
from .presence import Presence


class _DistributedOptimizer(torch.optim.Optimizer):
    _hvdp_distributed = True

    def __init__(self, params, named_parameters, codec, hvd_compressor, policy,
                 backward_passes_per_step, op, gradient_predivide_factor, groups,
                 sparse_as_dense, process_set, compile_codecs=False, uneven_inputs=False):
        super(self.__class__, self).__init__(params)
        # settings
        self._codec, self._hvd_compressor, self._policy = codec, hvd_compressor, policy
        self._bpps = backward_passes_per_step
        self._op = SUM if op == _hvd.Sum else AVERAGE
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._instance = next_instance(process_set)
        self._comm = TorchCollectives(process_set, scope=f"hvdp.opt{self._instance}.")
        self._all_names = {id(p): k for k, p in named(self.param_groups, named_parameters)}
        self._groups_arg = groups
        # auto: buckets as for a two-phase codec, each with the codec its probe chose
        two_phase = codec is not None and (isinstance(codec, Auto) or not codec.summable)
        self._layout = None
        self._set_layout(make_layout(self.param_groups, self._all_names, groups, policy, two_phase))
        self.stats = WireStats()
        self._compile_codecs = compile_codecs
        # uneven inputs (hvdp.join): a per-step "has anyone joined?", and buckets that switch to
        # an allreduce in such a step
        self._join = (StepControl(self._comm, self._params[0].device if self._params else None)
                      if (uneven_inputs and two_phase) else None)
        self._reducer, self._auto = make_reducer(self, codec, compile_codecs)
        OPTIMIZERS.add(self)
        self._presence = Presence(self._comm)
        # internal state, reset every step
        self._step_count = 0
        self._fresh = True          # no gradient hook yet in this step
        self._absent = []           # params this rank filled with zeros (no gradient) this step
        self._delay = {p: self._bpps for p in self._params}
        self._handles = {}          # param -> its plain.Pending / plain.SparsePending
        self._bucket_ready = {}     # bucket -> number of its params ready
        self._bucket_pending = {}   # bucket -> two-phase pending
        self._group_ready = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks, self._hooked = [], set()
        REPORTER.install()  # needs the rank, so after hvd.init
        check_optimizer(self, at_creation=True)
        # Like Horovod, a single worker skips the hooks, except that a real codec still applies
        # (so its effect can be seen and tested on one worker).
        if (self._comm.size > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"
                or (codec is not None and codec.name != "none")):
            self._register_hooks()

    # --- set-up -----------------------------------------------------------------------------
    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self._params, self._name, self._groups = layout.params, layout.name, layout.groups
        self._plan, self._bucket_of, self._plain_groups = layout.plan, layout.bucket_of, layout.plain_groups
        self._index = {p: i for i, p in enumerate(layout.params)}

    def _register_hooks(self):
        for p in self._params:
            if p not in self._hooked:
                self._hooked.add(p)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _follow_requires_grad(self) -> None:
        """A parameter unfrozen since the plan was made is reduced from this step on; a frozen
        one leaves it (its gradient stays None, as in plain torch). Called before anything of
        the step is launched; every rank must change the same parameters (checked)."""
        if trainable_ids(self.param_groups) == [id(p) for p in self._params]:
            return
        old = self._layout
        self._set_layout(make_layout(self.param_groups, self._all_names, self._groups_arg,
                                     self._policy, self._reducer is not None, strict=False))
        if self._reducer is not None:  # a residual belongs to its bucket's tensors
            keep = set(kept_buckets(old, self._layout))
            for store in (self._reducer.worker, self._reducer.server):
                store.restore({k: v for k, v in store.snapshot().items() if k in keep})
        self._delay = {p: self._bpps for p in self._params}
        if self._auto is not None:  # new buckets: a new decision
            self._auto.invalidate()
        if self._hooks:
            self._register_hooks()
        check_optimizer(self)

    # --- per-gradient path ------------------------------------------------------------------
    def _compressing(self):
        return self._step_count >= self._policy.warmup_steps

    def _hook(self, p):
        if self._fresh:  # the step's first gradient: nothing launched yet
            self._fresh = False
            self._follow_requires_grad()
            ensure_decided(self)
        if p not in self._delay:  # frozen since: not reduced (its gradient is the user's)
            return
        if self._join is not None:
            self._join.begin()
        if self._delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step="
                                 f"{self._bpps} times before step(); raise backward_passes_per_step "
                                 "to accumulate more passes locally")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            with REPORTER.explaining():  # once Horovod is down, launching fails first
                self._launch(p)

    def _launch(self, p):
        if p.grad is None:  # another rank may have one: reduce zeros (Presence decides after)
            self._absent.append(p)
            p.grad = torch.zeros_like(p)
        b = self._bucket_of.get(p)
        if b is not None and self._compressing():
            self._bucket_ready[b] = self._bucket_ready.get(b, 0) + 1
            if self._bucket_ready[b] == len(self._plan.buckets[b]):
                self._start_bucket(b)
            return
        if p.grad.is_sparse and not self._sparse_as_dense:
            self._handles[p] = plain.submit_sparse(p.grad, self._comm.scope + self._name[p],
                                                   self._op, self._comm)
            return
        group = (self._plain_groups if self._compressing() else self._groups).get(p)
        if group is None:
            self._handles[p] = self._allreduce_plain([p])[0]
            return
        self._group_ready[group] = self._group_ready.get(group, 0) + 1
        if self._group_ready[group] == len(group):
            for q, hc in zip(group, self._allreduce_plain(list(group))):
                self._handles[q] = hc

    def _dense_grad(self, p):
        if p.grad.is_sparse:
            p.grad = p.grad.to_dense()
        return p.grad

    def _allreduce_plain(self, ps):
        """Horovod's contract: compress (a cast), sum/average, decompress. One handle per tensor."""
        codec = self._codec if (getattr(self._codec, "summable", False)
                                and self._compressing()) else Compression.none
        wire = None if (self._hvd_compressor is not None or codec.wire_dtype == "float32") \
            else getattr(torch, codec.wire_dtype)
        name = self._comm.scope + ("group#" if len(ps) > 1 else "") + self._name[ps[0]]
        return plain.submit([self._dense_grad(p) for p in ps], name, wire, self._hvd_compressor,
                            self._op, self._predivide, self._comm, self.stats,
                            codec.name if self._hvd_compressor is None else "horovod")

    def _start_bucket(self, b):
        for i in self._plan.buckets[b]:
            p = self._params[i]
            if p.grad.is_sparse and not self._sparse_as_dense:
                raise ValueError(f"parameter {self._name[p]!r} has a sparse gradient, which "
                                 f"{self._codec.name} compression cannot take: pass sparse_as_dense=True, "
                                 f"or keep it uncompressed with CompressionPolicy(exclude=({self._name[p]!r},))")
        grads = [self._dense_grad(self._params[i]) for i in self._plan.buckets[b]]
        # one gradient: its flat view (the reducer only reads it), not a copy
        flat = grads[0].reshape(-1).float() if len(grads) == 1 else \
            torch.cat([g.reshape(-1).float() for g in grads])
        if self._predivide != 1.0:
            flat = flat / self._predivide
        self._bucket_pending[b] = self._reducer.start(f"b{b}", flat)

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
                self._synchronize()
        except BaseException:
            # a failed collective (a worker died: elastic reset) must not leave this step's
            # half-done reductions behind for the restored state to trip over
            self._clear_pending()
            raise

    def _clear_pending(self):
        """Drop a failed step's reductions (also called by elastic restore/sync)."""
        if self._auto is not None:  # after a reset the link and the workers may differ: probe again
            self._auto.invalidate()
        self._presence.reset()
        self._end_step()

    def _end_step(self):
        self._handles.clear()
        self._bucket_pending.clear()
        self._bucket_ready.clear()
        self._group_ready.clear()
        self._delay = {p: self._bpps for p in self._params}
        self._fresh, self._absent = True, []
        if self._join is not None:
            self._join.reset()

    def _synchronize(self):
        if self._fresh:  # step() without backward
            self._fresh = False
            self._follow_requires_grad()
            ensure_decided(self)
        for p in self._params:  # unused in this step's graph, or fewer passes than configured
            if self._delay[p] > 0 and (p not in self._handles):
                self._delay[p] = 0
                self._launch(p)
        absent = set(self._absent)
        self._presence.submit([p not in absent for p in self._params],
                              self._params[0].device if self._params else None)
        for b in range(len(self._plan.buckets)):  # a bucket with params never reaching a hook
            if self._compressing() and b not in self._bucket_pending:
                self._start_bucket(b)
        for pend in self._bucket_pending.values():
            self._reducer.exchange(pend)
        waited = set()  # a grouped allreduce has one handle for all its tensors
        for p, pend in self._handles.items():
            plain.finish(p, pend, self._hvd_compressor, waited)
        for b, pend in self._bucket_pending.items():
            flat, off = self._reducer.finish(pend), 0
            for i in self._plan.buckets[b]:
                g = self._params[i].grad
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        if self._absent:  # no rank had a gradient: None, as plain torch leaves it
            for p, none in zip(self._absent, self._presence.nobody_had([self._index[p] for p in self._absent])):
                if none:
                    p.grad = None
        if self._join is not None:
            self._join.end_step()
        self._end_step()
        self._step_count += 1
        self.stats.end_step()
        step_done(self)
        self._synchronized = True

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
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if self._handles or self._bucket_pending:
            raise AssertionError("optimizer.zero_grad() between loss.backward() and optimizer.step() "
                                 "(or synchronize()) would race with the gradient reduction; call it "
                                 "before backward or after step")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # --- hvdp additions ---------------------------------------------------------------------
    def check_agreement(self):
        """Raise the same error on every rank unless all ranks reduce the same tensors the same
        way (run at creation and after every elastic reset; ``HVDP_CHECK_AGREEMENT=0``: never)."""
        check_optimizer(self)

    def compression_stats(self):
        """Bytes handed to collectives per step by codec vs a float32 ring (see WireStats); with
        ``compression="auto"`` also ``"auto"``: the codec per bucket and the costs behind it."""
        out = dict(self.stats.summary(), codec=str(self._codec) if self._codec else "horovod",
                   compressed_tensors=sum(len(b) for b in self._plan.buckets),
                   plain_tensors=len(self._plan.plain))
        if self._auto is not None:
            out["auto"] = self._auto.summary()
        return out

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd["hvdp"] = {"step": self._step_count,
                      "reducer": self._reducer.state_dict() if self._reducer else None}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("hvdp", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra:
            self._step_count = int(extra.get("step", 0))
            if self._reducer is not None and extra.get("reducer"):
                self._reducer.load_state_dict(extra["reducer"])


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=_hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=_hvd.global_process_set, policy=None, compile_codecs=None,
                         uneven_inputs=False):
    """Wrap a torch optimizer so each step averages gradients across workers first.

    Horovod's arguments keep Horovod's meaning. ``compression`` also takes a codec name
    ("none", "fp16", "bf16", "int8", "topk"), an ``hvd.Compression`` member, or "auto"
    (``hvd.Compression.auto``: hvdp probes the link and codecs at the first step and picks a
    codec per bucket, see ``hvdp.auto``); ``policy`` an
    :class:`hvdp.CompressionPolicy` (size threshold, name patterns, warm-up, fusion, error feedback);
    ``compile_codecs`` fuses the codec with torch.compile (default: env ``HVDP_COMPILE_CODECS=1``);
    ``uneven_inputs=True`` lets ranks with fewer batches call ``hvd.join()`` with any codec (one
    tiny allreduce per step tells the ranks whether someone has joined; see ``hvdp.join``).

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression="int8")
    """
    codec, hvd_compressor = resolve(compression)
    auto = isinstance(codec, Auto)
    if policy is None:
        policy = CompressionPolicy()
    elif not isinstance(policy, CompressionPolicy):
        raise TypeError("policy must be an hvdp.CompressionPolicy")
    if gradient_predivide_factor != 1.0 and op != _hvd.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if op == _hvd.Adasum:
        if codec is not None and (auto or not codec.summable):
            raise ValueError(f"op=hvd.Adasum cannot combine with {codec.name} compression (Adasum "
                             "needs whole tensors); use compression 'none' or 'fp16'")
        hc = hvd_compressor or (_hvd.Compression.fp16 if codec.name == "fp16" else _hvd.Compression.none)
        return _hvd.DistributedOptimizer(optimizer, named_parameters, hc, backward_passes_per_step,
                                         op, gradient_predivide_factor, num_groups, groups,
                                         sparse_as_dense, process_set)
    if op not in (_hvd.Average, _hvd.Sum):
        raise ValueError("op must be hvd.Average, hvd.Sum or hvd.Adasum")
    if num_groups:
        warnings.warn("num_groups is deprecated (as in Horovod): use groups=", DeprecationWarning)
        groups = groups if groups is not None else num_groups
    if compile_codecs is None:
        compile_codecs = os.environ.get(HVDP_COMPILE_CODECS, "0") == "1"
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, codec, hvd_compressor, policy,
               backward_passes_per_step, op, gradient_predivide_factor, groups, sparse_as_dense,
               process_set, compile_codecs, uneven_inputs)
