"""How an :class:`~hvdp.reduce.engine.Engine` runs one step: piece by piece as gradients arrive
(hvdp.torch's hooks: ``begin_step``, ``start_plain`` / ``start_bucket``, ``exchange_all``,
``finish_buckets``, ``end_step``) or at once (Keras's step, also while traced: ``reduce``).

:class:`StepDrive` is the engine's half that runs steps; it reads what the other half set up
(the plan, the reducer, the plain path, the statistics) and changes only a step's state.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .probe import measure

Array = Any


class StepDrive:
    """The per-step methods of :class:`~hvdp.reduce.engine.Engine` (see the module's docstring)."""

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
                           self.make.two_phase, self.gather, sync=sync)
        ch.ensure(self.bucket_sizes(), self.reducer, self.comm.size, probe, self.gather)

    def _residual_refs(self) -> Optional[Tuple[dict, dict]]:
        """References to every bucket's residuals (never written in place: a step sets new ones),
        or None where there are none to keep or the step is being traced."""
        red = self.reducer
        if red is None or self._tracing() or not red.error_feedback:
            return None
        return red.worker.snapshot(), red.server.snapshot()

    @property
    def keeps_residuals(self) -> bool:
        """Whether a step leaves error-feedback residuals behind (what :meth:`discard_step` undoes)."""
        red = self.reducer
        return (red is not None and red.error_feedback
                and any(self.packs(b) for b in range(len(self.plan.buckets))))

    def packs(self, b: int, compress: Optional[bool] = None) -> bool:
        """Whether bucket ``b``'s tensors go to the reducer as one flat bucket this step: when
        compressing, unless auto gave the bucket float32 none; then its tensors take the plain
        path one by one, as ``compression="none"`` sends them (no copy into a flat bucket, no
        wait for the bucket's last gradient, no residuals to check). The choice changes only in
        :meth:`begin_step`, so a step routes every tensor one way on every rank."""
        if not (self.compressing if compress is None else compress):
            return False
        ch = self.chooser
        choice = ch.choices.get(f"b{b}") if ch is not None else None
        return choice is None or choice.codec.name != "none"

    def discard_step(self) -> None:
        """The step just reduced will not be applied (a loss scaler found a non-finite gradient
        and skips it): every bucket's residuals go back to what the step found, so the skipped
        step leaves no trace (one decision for the whole step, by the driver, from the reduced
        values every rank shares; a non-finite bucket also rolls itself back, see hvdp.reduce.twophase)."""
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

    def progress(self) -> None:
        """Start the next phase of every bucket in flight whose previous collective is done,
        without waiting (hvdp.torch calls it from its gradient hooks, so a bucket's exchange
        goes on while backward still produces later buckets). The same work on the same
        values as :meth:`exchange_all`, only sooner: the results are the same bits."""
        for pend in self._pending.values():
            self.reducer.progress(pend)

    def exchange_all(self) -> None:
        """Every started bucket's second phase, then (two levels) every bucket's third; a phase
        already started (by :meth:`progress` or an earlier call) is not started again: the
        reducers' ``exchange`` and ``advance`` do nothing for it."""
        for pend in self._pending.values():
            self.reducer.exchange(pend)
        for pend in self._pending.values():
            self.reducer.advance(pend)

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

    def reduce(self, grads: Sequence[Array], compress: bool = True, joined: bool = False) -> List[Array]:
        """Every gradient of a step at once (the layout's order; Keras, also while traced): every
        collective is submitted before the first wait. ``joined``: some rank has joined (uneven
        inputs; buckets by allreduce)."""
        return self.complete(self.submit(grads, compress, joined))

    def submit(self, grads: Sequence[Array], compress: bool = True, joined: bool = False) -> "Submitted":
        """The first half of :meth:`reduce`: every collective's first phase started, nothing
        waited for. Outer steps submit at a sync and :meth:`complete` steps later."""
        self._join_flag = joined
        packed = [b for b in range(len(self.plan.buckets)) if self.packs(b, compress)]
        in_bucket = {i for b in packed for i in self.plan.buckets[b]}
        plain = {i: self.start_plain([g], self.names[i], compress)[0]
                 for i, g in enumerate(grads) if i not in in_bucket}
        for b in packed:
            self.start_bucket(b, [grads[i] for i in self.plan.buckets[b]])
        return Submitted(list(grads), plain, bool(compress), bool(joined))

    def complete(self, sub: "Submitted") -> List[Array]:
        """Wait for what :meth:`submit` started: every gradient averaged, in the layout's order."""
        ops, out, grads = self.ops, list(sub.grads), sub.grads
        self.exchange_all()
        for i, pend in sub.plain.items():
            out[i] = self.plain.finish(pend)
        for b, flat in self.finish_buckets():
            for i, piece in self.pieces(b, flat):
                out[i] = ops.cast(ops.reshape(piece, self.shapes[i]), ops.dtype(grads[i]))
        if self._tracing():
            self.traced.keep(sub.compress, sub.joined, self.stats.take_step())
        return out


class Submitted(NamedTuple):
    """A reduction :meth:`StepDrive.submit` started: the inputs, the plain tensors' pendings."""
    grads: List[Array]
    plain: Dict[int, Any]
    compress: bool
    joined: bool
