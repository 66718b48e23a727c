"""The gradient-reduction engine: one owner of everything between "here are the gradients" and
"here are their averages", for every adapter.

An adapter builds one :class:`Engine` per optimizer from frozen :class:`~hvdp.settings.ReduceSettings`,
its framework's array ops (``hvdp.ops``), collectives (``hvdp.collectives``), plain path and
residual stores (``hvdp.settings``), and then only *drives* it:

- ``set_layout``: the tensors to reduce (again when the trainable set changes): the plan
  (buckets and plain tensors), residuals kept where a bucket holds the same tensors, auto's
  decision invalidated, the ranks-agree check;
- per step, eagerly (hvdp.torch's hooks): ``begin_step`` (auto's probe and trial),
  ``start_plain`` / ``start_bucket`` as gradients arrive, ``exchange_all``, ``finish_buckets``,
  ``end_step``; or at once (Keras's step, also while traced): ``reduce``;
- ``summary`` (``compression_stats()``, one shape), ``residual_state`` / ``load_residual_state``,
  ``check`` (the ranks-agree check), ``abort`` (an elastic reset).

``compression="auto"`` decides per bucket, with the probe and the trial of ``hvdp.chooser``,
wherever the step runs eagerly; a driver whose step is traced into a graph (Keras on
TensorFlow) asks for ``per_bucket_auto=False``: one codec for the model, measured when the
layout is set, since a traced step cannot switch codecs.

Example::

    eng = Engine(ReduceSettings(get("int8"), CompressionPolicy()), NumpyOps(), comm, plain, gather)
    eng.set_layout(["w", "b"], [(1024, 64), (64,)], [True, True])
    out = eng.reduce([gw, gb])          # every gradient averaged over the workers
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from . import agreement
from .auto import CostTable, decide_uniform
from .chooser import Chooser
from .config import elastic_mode
from .join import JoinableReducer
from .mixed import MixedReducer
from .plan import Plan, make_plan
from .probe import measure
from .settings import PlainPath, ReduceSettings, is_low_rank, is_two_phase
from .hierarchy import HierarchicalReducer
from .lowrank import LowRankReducer
from .stats import WireStats
from .twophase import TwoPhaseReducer

Array = Any


class Engine:
    """One optimizer's gradient reduction (see the module's docstring).

    Args:
        settings: what to reduce with (checked, frozen).
        ops, comm: the framework's array ops and collectives.
        plain: the framework's whole-tensor allreduce (:class:`~hvdp.settings.PlainPath`).
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
        levels: for ``settings.hierarchical`` (``hvdp.hierarchy``): ``() -> (local, cross)``,
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
        # settings and framework pieces
        self.settings, self.ops, self.comm, self.plain = settings, ops, comm, plain
        self.gather, self.versions = allgather_fixed, dict(versions or {})
        self._make_store, self._wrap_codec, self._joined = make_store, wrap_codec, joined
        self._eager = eager_scope or contextlib.nullcontext
        self._tracing = tracing or (lambda: False)
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
        self.reducer = None
        # internal state of a step
        self.step = 0                          # reductions completed (eager drivers)
        self._pending: Dict[int, Any] = {}     # bucket -> its reduction in flight
        self._join_flag = False
        self._before: Optional[Tuple[dict, dict]] = None  # the residuals as this step found them
        # statistics: recorded by the reducers and the plain path; a traced step's record is
        # kept as a template, by (compressed, joined)
        self.stats = WireStats()
        self._templates: Dict[Tuple[bool, bool], dict] = {}
        if self._make_levels is not None:
            pass  # the two-level reducer is made with the first layout (its levels are collectives)
        elif self.chooser is not None:
            self.reducer = MixedReducer(ops, comm, self._make_two_phase, settings.op, settings.predivide, self.stats)
        elif is_two_phase(self.codec):
            self.reducer = self._make_two_phase(self.codec, comm)
        elif is_low_rank(self.codec):
            self.reducer = self._make_low_rank()

    # --- reducers -------------------------------------------------------------------------------
    def _is_joined(self) -> bool:
        return self._joined() if self._joined is not None else self._join_flag

    def _make_two_phase(self, codec, comm):
        """The reducer of a two-phase codec, as training runs it; on another comm (auto's
        loop-back probe) without statistics, residual stores of the adapter or join control."""
        s, own = self.settings, comm is self.comm
        stores = ((self._make_store("w"), self._make_store("s"))
                  if (own and self._make_store is not None and self.chooser is None) else (None, None))
        run = self._wrap_codec(codec) if self._wrap_codec is not None else codec
        r = TwoPhaseReducer(run, self.ops, comm, s.error_feedback(codec), s.op, s.predivide,
                            self.stats if own else None, *stores)
        return JoinableReducer(r, self._is_joined) if (own and s.uneven_inputs) else r

    def _make_low_rank(self):
        """The reducer of a low-rank codec (powersgd): allreduce of factors, its state in the
        adapter's stores (residuals: worker side; warm-start Qs: server side)."""
        s = self.settings
        stores = (self._make_store("w"), self._make_store("s")) if self._make_store is not None else (None, None)
        return LowRankReducer(self.codec, self.ops, self.comm, s.error_feedback(self.codec), s.op, s.predivide,
                              self.stats, *stores)

    def _make_hierarchical(self):
        s = self.settings
        self.levels = self._make_levels()
        local, cross = self.levels
        self._levels_word = f"{cross.size} nodes x {local.size} ranks"
        stores = (self._make_store("w"), self._make_store("s")) if self._make_store is not None else (None, None)
        local, cross = self.levels
        return HierarchicalReducer(self.codec, self.ops, local, cross, s.error_feedback(self.codec), s.op,
                                   s.predivide, self.stats, *stores, wrap=self._wrap_codec)

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
            checked = True
        if self._make_levels is not None and self.reducer is None:
            self.reducer = self._make_hierarchical()
        if self.reducer is not None:
            keep = {b for b, m in self.bucket_members().items() if before.get(b) == m}
            for store in (self.reducer.worker, self.reducer.server):
                store.restore({k: v for k, v in store.snapshot().items() if k in keep})
            if hasattr(self.reducer, "set_shapes"):  # low-rank: the matrices of each bucket
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
        sizes = getattr(red, "store_sizes", None)  # a low-rank reducer's depend on the shapes
        for b, n in self.bucket_sizes().items():
            c, padded = sizes(b, n) if sizes is not None else red.layout(n)
            red.worker.create(b, padded)
            red.server.create(b, c)

    def _decide_uniform(self) -> None:
        auto, buckets = self.settings.codec, self.bucket_sizes()
        probed, wall = False, 0.0
        if auto.costs is not None:
            table = auto.costs
        elif self.comm.size <= 1 or not buckets:
            table = CostTable(self.comm.size)
        else:
            t0 = time.perf_counter()
            with self._eager():
                table = measure(self.comm, self.ops, None, list(buckets.values()), auto.candidates,
                                self._make_two_phase, self.gather)
            probed, wall = True, time.perf_counter() - t0
        codec, total = decide_uniform(buckets, auto.candidates, table, auto.margin)
        if self.codec is None or str(codec) != str(self.codec):
            self.codec = codec
            self.reducer = self._make_two_phase(codec, self.comm) if is_two_phase(codec) else None
        self.uniform = {"settings": str(auto), "decided": True, "phase": None, "per_bucket": False,
                        "codec": str(codec), "buckets": [{"bucket": b, "elements": n, "codec": str(codec)}
                                                         for b, n in buckets.items()],
                        "proposal": {b: str(codec) for b in buckets}, "trial": None,
                        "predicted_ms": {k: 1e3 * v for k, v in total.items()}, "costs": table.as_dict(),
                        "probes": int(probed), "probe_wall_s": wall}

    # --- the ranks-agree check ------------------------------------------------------------------
    def describe(self, tensors: Sequence[agreement.Tensor]) -> dict:
        """What every rank must share, for ``hvdp.agreement`` (the same keys in every adapter)."""
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
        """Raise the same :class:`~hvdp.agreement.DisagreementError` on every rank unless all
        reduce the same tensors the same way. In an elastic job a worker that joins later makes
        its optimizer alone, so the check at creation waits for the state's ``sync``."""
        if self.comm.size <= 1 or (at_creation and elastic_mode()):
            return
        agreement.check(self.describe(tensors), self.gather, "the DistributedOptimizer",
                        what=self.tensor_word, name="hvdp.agree.optimizer")

    # --- one step, driven piece by piece ------------------------------------------------------
    def begin_step(self, like=None, sync: Callable[[], None] = lambda: None) -> None:
        """Before the step's first collective: auto's probe, its trial's next phase, or nothing
        (also while traced: a traced step's auto decided when the layout was set). Remembers the
        residuals as the step finds them, for :meth:`discard_step`."""
        self._before = self._residual_refs()
        ch = self.chooser
        if ch is None or ch.settled or self._tracing():
            return

        def probe(sizes):
            return measure(self.comm, self.ops, like, list(sizes.values()), ch.settings.candidates,
                           self._make_two_phase, self.gather, sync=sync)
        ch.ensure(self.bucket_sizes(), self.reducer, self.comm.size, probe, self.gather)

    def _residual_refs(self) -> Optional[Tuple[dict, dict]]:
        """References to every bucket's residuals (never written in place: a step sets new ones),
        or None where there are none to keep or the step is being traced."""
        red = self.reducer
        if red is None or self._tracing() or not getattr(red, "error_feedback", True):
            return None
        return red.worker.snapshot(), red.server.snapshot()

    @property
    def keeps_residuals(self) -> bool:
        """Whether a step leaves error-feedback residuals behind (what :meth:`discard_step` undoes)."""
        red = self.reducer
        return red is not None and bool(self.plan.buckets) and getattr(red, "error_feedback", True)

    def discard_step(self) -> None:
        """The step just reduced will not be applied (a loss scaler found a non-finite gradient
        and skips it): every bucket's residuals go back to what the step found, so the skipped
        step leaves no trace (one decision for the whole step, by the driver, from the reduced
        values every rank shares; a non-finite bucket also rolls itself back, see hvdp.twophase)."""
        if self._before is not None:
            worker, server = self._before
            self.reducer.worker.restore(worker)
            self.reducer.server.restore(server)

    def start_plain(self, grads: Sequence[Array], name: str, compress: Optional[bool] = None) -> list:
        """Horovod's allreduce of whole tensors (grouped when several), cast to the codec's wire
        dtype where it is summable and compressing. -> one pending per tensor."""
        s, codec = self.settings, self.codec
        compress = self.compressing if compress is None else compress
        if codec is None and not s.auto:
            label, wire = "horovod", None
        elif compress and codec is not None and codec.summable:
            label, wire = codec.name, codec.wire_dtype
        else:
            label, wire = "none", "float32"
        out = self.plain.submit(grads, name, wire)
        for (_, nbytes), g in zip(out, grads):
            self.stats.record_allreduce(label, math.prod(tuple(g.shape)), nbytes, self.comm.size)
        return [pend for pend, _ in out]

    def start_bucket(self, b: int, grads: Sequence[Array]) -> None:
        """Encode bucket ``b`` from its gradients (in the plan's order) and start its exchange."""
        ops, s = self.ops, self.settings
        for i, g in zip(self.plan.buckets[b], grads):
            if self.plain.is_sparse(g) and not s.sparse_as_dense:
                raise ValueError(f"{self.tensor_word} {self.names[i]!r} has a sparse gradient, which "
                                 f"{self.reducer_codec_name()} compression cannot take: pass "
                                 f"sparse_as_dense=True, or keep it uncompressed with "
                                 f"hvdp.CompressionPolicy(exclude=({self.names[i]!r},))")
        flats = [ops.cast(ops.reshape(self.plain.dense(g), [-1]), "float32") for g in grads]
        # one gradient: its flat view (the reducer only reads it), not a copy
        flat = flats[0] if len(flats) == 1 else ops.cat(flats)
        if s.predivide != 1.0:
            flat = flat / s.predivide
        self._pending[b] = self.reducer.start(f"b{b}", flat)

    def reducer_codec_name(self) -> str:
        return self.codec.name if self.codec is not None else self.settings.codec_name

    def started(self, b: int) -> bool:
        return b in self._pending

    @property
    def in_flight(self) -> bool:
        return bool(self._pending)

    def exchange_all(self) -> None:
        for pend in self._pending.values():
            self.reducer.exchange(pend)
        advance = getattr(self.reducer, "advance", None)  # a reducer with a third phase (two levels)
        if advance is not None:
            for pend in self._pending.values():
                advance(pend)

    def finish_buckets(self) -> Iterator[Tuple[int, Array]]:
        """Every started bucket's averaged flat float32 values, in start order."""
        pending, self._pending = self._pending, {}
        for b, pend in pending.items():
            yield b, self.reducer.finish(pend)

    def pieces(self, b: int, flat: Array) -> Iterator[Tuple[int, Array]]:
        """(tensor index, its 1-D slice) of a finished bucket."""
        off = 0
        for i in self.plan.buckets[b]:
            yield i, flat[off:off + self.numels[i]]
            off += self.numels[i]

    def end_step(self, sync: Callable[[], None] = lambda: None) -> None:
        """A step's reduction is complete (eager drivers; nothing while being traced)."""
        if self._tracing():
            return
        self.stats.end_step()
        self.step += 1
        if self.chooser is not None and not self.chooser.settled:
            sync()  # the device's queue drained: the trial times whole steps
            self.chooser.step_done()

    def abort(self) -> None:
        """Drop a failed step's reductions (an elastic reset); auto measures again."""
        self._pending.clear()
        if self.chooser is not None:
            self.chooser.invalidate()

    # --- one step at once (Keras, also while traced) -------------------------------------------
    def reduce(self, grads: Sequence[Array], compress: bool = True, joined: bool = False) -> List[Array]:
        """Every gradient of a step (the layout's order): every collective is submitted before
        the first wait. ``joined``: some rank has joined (uneven inputs; buckets by allreduce)."""
        ops, out = self.ops, list(grads)
        self._join_flag = joined
        buckets = self.plan.buckets if compress else ()
        in_bucket = {i for idx in buckets for i in idx}
        plain = {i: self.start_plain([g], self.names[i], compress)[0]
                 for i, g in enumerate(grads) if i not in in_bucket}
        for b, idx in enumerate(buckets):
            self.start_bucket(b, [grads[i] for i in idx])
        self.exchange_all()
        for i, pend in plain.items():
            out[i] = self.plain.finish(pend)
        for b, flat in self.finish_buckets():
            for i, piece in self.pieces(b, flat):
                out[i] = ops.cast(ops.reshape(piece, self.shapes[i]), ops.dtype(grads[i]))
        if self._tracing():
            self._templates[(bool(compress), bool(joined))] = self.stats.take_step()
        return out

    # --- what the user sees and what is saved ---------------------------------------------------
    def summary(self, steps: Optional[int] = None) -> dict:
        """``compression_stats()``: bytes handed to the collectives per step by codec, against a
        float32 ring (recorded as each step ran; a traced step's record counted ``steps`` times,
        split at the warm-up), phase times, kernel paths, and auto's decision."""
        stats = self.stats
        if self._templates and steps is not None:
            stats = WireStats()
            stats.paths.update(self.stats.paths)
            stats.paths_why.update(self.stats.paths_why)
            warm = self.settings.policy.warmup_steps
            plain_steps = min(int(steps), warm) if (False, False) in self._templates else 0
            for key, n in (((False, False), plain_steps), ((True, False), int(steps) - plain_steps)):
                if key in self._templates and n > 0:
                    stats.add_step(self._templates[key], n)
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
