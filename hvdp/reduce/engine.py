"""The gradient-reduction engine: one owner of everything between "here are the gradients" and
"here are their averages", for every adapter.

An adapter builds one :class:`Engine` per optimizer from frozen :class:`~hvdp.reduce.settings.ReduceSettings`,
its framework's array ops (``hvdp.ops``), collectives (``hvdp.reduce.collectives``), plain path and
residual stores (``hvdp.reduce.settings``), and then only *drives* it:

- ``set_layout``: the tensors to reduce (again when the trainable set changes): the plan
  (buckets and plain tensors), residuals kept where a bucket holds the same tensors, auto's
  decision invalidated, the ranks-agree check;
- per step, eagerly (hvdp.torch's hooks): ``begin_step`` (auto's probe and trial),
  ``start_plain`` / ``start_bucket`` as gradients arrive, ``exchange_all``, ``finish_buckets``,
  ``end_step``; or at once (Keras's step, also while traced): ``reduce``;
- ``summary`` (``compression_stats()``, one shape), ``residual_state`` / ``load_residual_state``,
  ``check`` (the ranks-agree check), ``abort`` (an elastic reset).

``compression="auto"`` decides per bucket, with the probe and the trial of ``hvdp.reduce.chooser``,
wherever the step runs eagerly; a driver whose step is traced into a graph (Keras on
TensorFlow) asks for ``per_bucket_auto=False``: one codec for the model, measured when the
layout is set (``hvdp.reduce.uniform``), since a traced step cannot switch codecs.

The engine drives; it does not make: reducers come from ``hvdp.reduce.build`` and follow the
contract of ``hvdp.reduce.reducer``; a traced step's statistics are ``hvdp.reduce.stats.TracedSteps``.

Example::

    eng = Engine(ReduceSettings(get("int8"), CompressionPolicy()), NumpyOps(), comm, plain, gather)
    eng.set_layout(["w", "b"], [(1024, 64), (64,)], [True, True])
    out = eng.reduce([gw, gb])          # every gradient averaged over the workers
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cluster import agreement
from ..config import elastic_mode
from .build import ReducerFactory
from .chooser import Chooser
from .drive import StepDrive
from .join import refusal
from .plan import Plan, make_plan
from .recorded import Recorded, RecordedPlain, recorded_gather
from .reducer import PlainPath
from .settings import ReduceSettings, is_low_rank, is_two_phase
from .stats import TracedSteps, WireStats
from .uniform import decide_once

Array = Any


class Engine(StepDrive):
    """One optimizer's gradient reduction (see the module's docstring).

    Args:
        settings: what to reduce with (checked, frozen).
        ops, comm: the framework's array ops and collectives.
        plain: the framework's whole-tensor allreduce (:class:`~hvdp.reduce.reducer.PlainPath`).
        allgather_fixed: ``(bytes, name) -> [every rank's bytes]`` (the ranks-agree check,
            auto's shared table and trial).
        versions: library versions every rank must share (checked).
        make_store: ``side -> Store`` ("w": worker, "s": server residuals) for a fixed codec;
            default an in-memory dict.
        wrap_codec: applied to each codec the reducers run (torch.compile'd codecs).
        joined: this step's "has some rank joined?" (uneven inputs, eager drivers); without
            it, ``reduce(..., joined=)`` says.
        per_bucket_auto: auto decides per bucket with a trial (eager steps) or once (traced).
        eager_scope: a context in which collectives run eagerly (a traced step's probe).
        tracing: whether the current call is being traced into a graph (its statistics are
            then the step's template, counted by ``summary(steps=)``).
        tensor_word: how the ranks-agree check's messages name one tensor.
        levels: for ``settings.hierarchical`` (``hvdp.reduce.hierarchy``): ``() -> (local, cross)``,
            the collectives over this rank's node and over the ranks with its local rank; called
            once, after the first ranks-agree check (it is a collective: a rank that does not
            reduce in two levels must fail that check, not wait in it).
    """

    def __init__(self, settings: ReduceSettings, ops, comm, plain: PlainPath,
                 allgather_fixed: Callable[[bytes, str], List[bytes]], *,
                 versions: Optional[Mapping[str, str]] = None, make_store: Optional[Callable] = None,
                 wrap_codec: Optional[Callable] = None, joined: Optional[Callable[[], bool]] = None,
                 per_bucket_auto: bool = True, eager_scope: Optional[Callable] = None,
                 tracing: Optional[Callable[[], bool]] = None, tensor_word: str = "parameter",
                 levels: Optional[Callable[[], Tuple[Any, Any]]] = None):
        # settings and framework pieces; every collective is written into the flight record
        self._tracing = tracing or (lambda: False)
        self._flight = dict(codec=self.reducer_codec_name, step=lambda: self.step, tracing=self._tracing)
        self.settings, self.ops, self.comm = settings, ops, Recorded(comm, ops, **self._flight)
        self.plain = RecordedPlain(plain, ops, scope=getattr(comm, "scope", ""), **self._flight)
        self.gather = recorded_gather(allgather_fixed, step=lambda: self.step)  # eager even when traced
        self.versions = dict(versions or {})
        self._joined = joined
        self._eager = eager_scope or contextlib.nullcontext
        self.tensor_word = tensor_word
        if settings.hierarchical and levels is None:
            raise ValueError("hierarchical=True: the adapter must pass levels=() -> (local, cross)")
        self._make_levels = levels if settings.hierarchical else None
        self.levels: Optional[Tuple[Any, Any]] = None  # made with the first layout
        self._levels_word: Optional[str] = None
        # the codec run now: the fixed one, or auto's single choice once made (None before;
        # per-bucket auto keeps None: its MixedReducer holds a codec per bucket)
        self.codec = None if settings.auto else settings.codec
        self.chooser = Chooser(settings.codec) if (settings.auto and per_bucket_auto) else None
        self.uniform: Optional[dict] = None   # auto decided once for the model: the figures
        # layout
        self.names: List[str] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.numels: List[int] = []
        self.groups: Tuple[Tuple[str, ...], ...] = ()
        self.plan = Plan((), ())
        # internal state of a step
        self.step = 0                          # reductions completed (eager drivers)
        self._pending: Dict[int, Any] = {}     # bucket -> its reduction in flight
        self._join_flag = False
        self._before: Optional[Tuple[dict, dict]] = None  # the residuals as this step found them
        # statistics: recorded by the reducers and the plain path; a traced step's as a template
        self.stats = WireStats()
        self.traced = TracedSteps()
        # the reducers (the two-level one is made with the first layout: its levels are collectives)
        self.make = ReducerFactory(settings, ops, self.comm, self.stats, make_store=make_store, wrap_codec=wrap_codec,
                                   joined=self._is_joined, per_bucket=self.chooser is not None)
        self.reducer = None
        if self._make_levels is None:
            self.reducer = self.make.mixed() if self.chooser is not None else self.make.for_codec(self.codec)

    def _is_joined(self) -> bool:
        return self._joined() if self._joined is not None else self._join_flag

    @property
    def bucketed(self) -> bool:
        """Whether compressible tensors go to the reducer in buckets (two-phase, low-rank or two-level)."""
        return self.settings.hierarchical or self.two_phase or is_low_rank(self.codec)

    @property
    def two_phase(self) -> bool:
        """Whether compressed buckets go through the two-phase reduction: the codec run now
        (auto's uniform choice once made), else the setting."""
        return is_two_phase(self.codec) if self.codec is not None else self.settings.two_phase

    @property
    def uses_two_phase(self) -> bool:
        """Whether a step sends alltoall/allgather (what Horovod's join cannot answer)."""
        return self.reducer is not None and bool(self.plan.buckets) and self.comm.size > 1

    @property
    def compressing(self) -> bool:
        """Past the policy's warm-up (eager drivers count their steps here)."""
        return self.step >= self.settings.policy.warmup_steps

    # --- layout ---------------------------------------------------------------------------------
    def bucket_members(self) -> Dict[str, Tuple[str, ...]]:
        """Bucket name (as the residuals are keyed) -> names of its tensors."""
        return {f"b{b}": tuple(self.names[i] for i in idx) for b, idx in enumerate(self.plan.buckets)}

    def bucket_sizes(self) -> Dict[str, int]:
        return {f"b{b}": sum(self.numels[i] for i in idx) for b, idx in enumerate(self.plan.buckets)}

    def set_layout(self, names: Sequence[str], shapes: Sequence[Sequence[int]], floating: Sequence[bool],
                   tensors: Optional[Sequence[agreement.Tensor]] = None, groups=(),
                   at_creation: bool = False) -> Plan:
        """Plan the reduction of these tensors (in the order the adapter will hand them over).

        A bucket keeps its residuals where it holds the same tensors as before; the others
        start from zero. Auto decides again. With ``tensors`` (every tensor of the optimizer,
        frozen ones included, for the ranks-agree check) the ranks are checked to agree.
        """
        before = self.bucket_members()
        self.names, self.shapes = list(names), [tuple(int(d) for d in s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.groups = tuple(sorted(tuple(g) for g in groups))
        pol, checked = self.settings.policy, False
        if self.settings.auto and self.chooser is None:  # one codec for the model, measured now
            self.plan = make_plan(self.names, self.numels, floating, pol, True)
            if tensors is not None:  # before the probe's collectives: a rank with another codec
                self.check(tensors, at_creation)  # would not probe, and the others would wait
                checked = True
            self._decide_uniform()
        self.plan = make_plan(self.names, self.numels, floating, pol, self.bucketed)
        if tensors is not None and not checked:
            self.check(tensors, at_creation)
        if self._make_levels is not None and self.reducer is None:
            self.levels = tuple(Recorded(c, self.ops, **self._flight) for c in self._make_levels())
            local, cross = self.levels
            self._levels_word = f"{cross.size} nodes x {local.size} ranks"
            self.reducer = self.make.hierarchical(self.codec, self.levels)
        if self.reducer is not None:
            keep = {b for b, m in self.bucket_members().items() if before.get(b) == m}
            for store in (self.reducer.worker, self.reducer.server):
                store.restore({k: v for k, v in store.snapshot().items() if k in keep})
            self.reducer.set_shapes({f"b{b}": [self.shapes[i] for i in idx]
                                     for b, idx in enumerate(self.plan.buckets)})
            self.relayout()
        if self.chooser is not None:
            self.chooser.invalidate()
        return self.plan

    def relayout(self) -> None:
        """Residual stores sized for the buckets at the current number of workers (a graph
        store makes its variables now, before a step is traced)."""
        red = self.reducer
        if red is None or self.chooser is not None or not red.error_feedback:
            return
        for b, n in self.bucket_sizes().items():
            c, padded = red.store_sizes(b, n)
            red.worker.create(b, padded)
            red.server.create(b, c)

    def _decide_uniform(self) -> None:
        codec, self.uniform = decide_once(self.settings.codec, self.comm, self.ops, self.bucket_sizes(),
                                          self._eager, self.make.two_phase, self.gather)
        if self.codec is None or str(codec) != str(self.codec):
            self.codec = codec
            self.reducer = self.make.two_phase(codec, self.comm) if is_two_phase(codec) else None

    # --- the ranks-agree check ------------------------------------------------------------------
    def describe(self, tensors: Sequence[agreement.Tensor]) -> dict:
        """What every rank must share, for ``hvdp.cluster.agreement`` (the same keys in every adapter)."""
        s = self.settings
        return agreement.describe(
            tensors, self.plan.buckets, self.versions, compression=s.compression, policy=repr(s.policy),
            op=s.op, gradient_predivide_factor=s.predivide, backward_passes_per_step=s.backward_passes,
            sparse_as_dense=s.sparse_as_dense, uneven_inputs=s.uneven_inputs, groups=list(self.groups),
            size=self.comm.size, instance=s.instance, hierarchical=s.hierarchical, **dict(s.extra))

    def levels_word(self) -> Optional[str]:
        """The node layout of a two-level reduction ("2 nodes x 2 ranks"), else None (read once,
        when the levels were made: ``compression_stats()`` must not need Horovod running)."""
        return self._levels_word

    def check(self, tensors: Sequence[agreement.Tensor], at_creation: bool = False) -> None:
        """Raise the same :class:`~hvdp.cluster.agreement.DisagreementError` on every rank unless all
        reduce the same tensors the same way. In an elastic job a worker that joins later makes
        its optimizer alone, so the check at creation waits for the state's ``sync``."""
        if self.comm.size <= 1 or (at_creation and elastic_mode()):
            return
        agreement.check(self.describe(tensors), self.gather, "the DistributedOptimizer",
                        what=self.tensor_word, name="hvdp.agree.optimizer")

    def join_refusal(self, adapter: str, why: Optional[str] = None, planned: bool = False) -> Optional[str]:
        """Why ``hvd.join()`` cannot be answered by this optimizer (``hvdp.reduce.join.refusal``),
        or None: its step sends alltoall/allgather (or, ``planned``, will: before the first
        layout) and the join control is off (``why``: the reason where the settings do not
        say it, e.g. "tape": a gradient tape has no join control)."""
        s = self.settings
        if s.uneven_inputs:
            return None
        sends = ((self.two_phase or s.hierarchical) and self.comm.size > 1) if planned else self.uses_two_phase
        return refusal(self.reducer_codec_name(), adapter, why or s.join_off) if sends else None

    # --- what the user sees and what is saved ---------------------------------------------------
    def summary(self, steps: Optional[int] = None) -> dict:
        """``compression_stats()``: bytes handed to the collectives per step by codec, against a
        float32 ring (recorded as each step ran; a traced step's record counted ``steps`` times,
        split at the warm-up), phase times, kernel paths, and auto's decision."""
        stats = self.stats
        if self.traced and steps is not None:
            stats = self.traced.expand(self.stats, steps, self.settings.policy.warmup_steps)
        out = dict(stats.summary(), codec=self.settings.compression,
                   compressed_tensors=sum(len(b) for b in self.plan.buckets),
                   plain_tensors=len(self.plan.plain), hierarchical=self.levels_word())
        if self.chooser is not None:
            out["auto"] = dict(self.chooser.summary(), per_bucket=True)
        elif self.uniform is not None:
            out["auto"] = self.uniform
        return out

    def state(self) -> dict:
        """What a checkpoint carries: the step count (the warm-up) and the residuals."""
        return {"step": self.step, "reducer": self.residual_state()}

    def load_state(self, state: Optional[Mapping[str, Any]]) -> None:
        if state:
            self.step = int(state.get("step", 0))
            self.load_residual_state(state.get("reducer"))

    def residual_state(self) -> Optional[dict]:
        return None if self.reducer is None else self.reducer.state_dict()

    def load_residual_state(self, state: Optional[dict]) -> None:
        if self.reducer is not None and state is not None:
            self.reducer.load_state_dict(state)
