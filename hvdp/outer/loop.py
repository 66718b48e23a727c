"""The outer loop, framework-free: an adapter calls :meth:`OuterLoop.after_step` after every
inner step with the worker's current parameters and writes back what it returns.

Per fragment (a group of the parameters, each with its own engine: one layout, its buckets,
codec and residuals), at its sync step:

1. the pseudo-gradient of each tensor, ``global - local`` in float32, is submitted to the
   fragment's engine (every collective's first phase started, nothing waited for);
2. ``delay`` inner steps later (the second phase started one step after the sync where
   ``delay >= 2``, or sooner by :meth:`OuterLoop.progress`) the average is waited for and
   the outer SGD moves the global parameters: ``buf = momentum * buf + g`` (``buf = g`` the
   first time), ``d = g + momentum * buf`` (Nesterov) or ``buf``, ``global -= lr * d``;
3. the worker continues from ``mix * local + (1 - mix) * global`` (``global`` itself with the
   default ``mix=0``), the same bits on every rank.

Example::

    loop = OuterLoop(OuterSettings(sync_every=4), NumpyOps(), [engine], [[0, 1]], [w, b])
    for step in range(100):
        w, b = inner_step(w, b)
        for i, value in loop.after_step([w, b]):
            (w, b)[i][...] = value          # the adapter writes into its parameters
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import auto
from .settings import OuterSettings

Array = Any


def split(numels: Sequence[int], k: int) -> List[List[int]]:
    """Tensor indices in ``k`` contiguous fragments of about equal elements (each non-empty).

    Example::

        split([100, 10, 100, 10], 2)      # [[0, 1], [2, 3]]
    """
    if not 1 <= k <= len(numels):
        raise ValueError(f"fragments={k}: the model has {len(numels)} tensors to split; use 1..{len(numels)}")
    total, out, acc = sum(numels), [[] for _ in range(k)], 0
    for i, n in enumerate(numels):
        f = min(k - 1, int(acc * k // max(total, 1)))
        f = max(f, k - (len(numels) - i))  # leave one tensor for each later fragment
        f = min(f, max((j for j in range(k) if out[j]), default=-1) + 1)  # no gap
        out[f].append(i)
        acc += n
    return out


class OuterLoop:
    """Outer steps over parameters split in fragments (see the module's docstring).

    Args:
        settings: H, the outer optimizer, fragments, delay, mix.
        ops: the framework's array ops (``hvdp.ops``).
        engines: one :class:`~hvdp.reduce.engine.Engine` per fragment, its layout set to that
            fragment's tensors in the order of ``fragments[k]``.
        fragments: the tensor indices of each fragment (together every index once).
        params: the starting parameters, the same on every rank (broadcast first): the global
            parameters start as a float32 copy of them.
        active: the number of ranks taking part in the sync starting now (uneven inputs: the
            adapter's join control, a collective every active rank calls at each sync; a rank
            that has called ``hvd.join()`` takes no part). None: every rank always. Where fewer
            than all take part, the engine reduces in float32 (a joined rank adds zeros) and the
            average is over the ranks that took part.
        clock: seconds (``sync_every="auto"`` times its probe with it; tests pass their own).
        warmup_engine: the engine the adapter averages the warm-up steps' gradients with
            (``warmup_compression`` other than "none"); the loop only carries its residuals in
            :meth:`state` (after the fragments' engines), so a checkpoint taken during the
            warm-up resumes with them.
    """

    def __init__(self, settings: OuterSettings, ops, engines: Sequence[Any], fragments: Sequence[Sequence[int]],
                 params: Sequence[Array], active: Optional[Callable[[], int]] = None,
                 clock: Callable[[], float] = time.perf_counter, warmup_engine: Any = None):
        if len(engines) != len(fragments) or len(fragments) != settings.fragments:
            raise ValueError(f"{settings.fragments} fragments need as many engines and index lists, got "
                             f"{len(engines)} and {len(fragments)}")
        every = sorted(i for f in fragments for i in f)
        if every != list(range(len(params))):
            raise ValueError("the fragments must hold every parameter index exactly once")
        self.settings, self.ops, self._active, self._clock = settings, ops, active, clock
        # the schedule: the settings with H chosen (sync_every="auto": None while probing)
        self.schedule: Optional[OuterSettings] = None if settings.auto else settings
        self.auto: Optional[dict] = None  # what sync_every="auto" measured and chose
        self._probe: List[float] = []  # the clock at each inner step of the probe
        self.engines, self.fragments = list(engines), [list(f) for f in fragments]
        self.warmup_engine = warmup_engine
        # internal state: the global parameters, the outer optimizer's momentum, the inner step
        self.globals: List[Array] = [self._copy(p) for p in params]
        self.momentum: List[Optional[Array]] = [None] * len(params)
        self.step = 0  # inner steps since the warm-up
        self.warm = 0  # warm-up steps taken
        self.outer_steps = [0] * len(fragments)
        self._inflight: Dict[int, Tuple[int, Any, int]] = {}  # fragment -> (lands at, submitted, took part)
        self.took_part: List[int] = [0] * len(fragments)  # ranks in each fragment's last sync

    def _copy(self, x: Array) -> Array:
        return self.ops.cast(x, "float32") * 1.0  # a new float32 array (a cast may return x itself)

    def syncs_at(self, fragment: int, step: int) -> bool:
        """Whether ``fragment`` starts a sync after inner step ``step`` (1-based)."""
        s = self.schedule
        return s is not None and step > 0 and step % s.sync_every == s.offset(fragment)

    @property
    def sync_every(self) -> Optional[int]:
        """H in use (None while ``sync_every="auto"`` probes)."""
        return None if self.schedule is None else self.schedule.sync_every

    @property
    def in_flight(self) -> bool:
        return bool(self._inflight)

    @property
    def warming_up(self) -> bool:
        """Whether the next inner step is a synchronous warm-up step (the adapter averages its
        gradients first)."""
        return self.warm < self.settings.warmup

    def syncs_next(self) -> bool:
        """Whether the next :meth:`after_step` starts a sync (hvdp.torch then starts the sync's
        join control during that inner step's backward, so the sync does not wait for it)."""
        if self.warming_up:
            return False
        s = self.step + 1
        if self.schedule is None:
            return s in (auto.PROBE_STEPS // 2, auto.PROBE_STEPS)
        return any(self.syncs_at(f, s) for f in range(len(self.fragments)))

    def progress(self) -> None:
        """Start the next phase of every fragment in flight whose previous collective is done,
        without waiting (``Engine.progress``; hvdp.torch calls it from its gradient hooks, so a
        streaming fragment's second phase goes on during the inner steps before it lands). The
        same work on the same values as at landing, only sooner: the same bits."""
        for f in self._inflight:
            self.engines[f].progress()

    def drain(self) -> None:
        """Wait for every fragment in flight and drop its average: the end of a streaming run
        (``opt.outer.drain()`` on every rank after the last step), whose last fragments are still
        in flight; without it a rank that exits at once may shut Horovod down under a slower rank
        still sending them. The global parameters stay those of the last landing."""
        for f in sorted(self._inflight):
            _, sub, _ = self._inflight.pop(f)
            self.engines[f].complete(sub)
            self.engines[f].end_step()

    def after_step(self, params: Sequence[Array]) -> List[Tuple[int, Array]]:
        """After an inner step: start the syncs due now, advance and land those in flight.
        -> ``(index, new value)`` of every parameter to write back (most steps: none)."""
        if self.warming_up:  # a synchronous step (every rank the same): nothing to reduce
            self.warm += 1
            if not self.warming_up:  # the first interval starts from here
                self.globals = [self._copy(p) for p in params]
            return []
        self.step += 1
        if self.schedule is None:
            return self._probe_step(params)
        out: List[Tuple[int, Array]] = []
        for f, (lands, _, _) in sorted(self._inflight.items()):
            if lands == self.step:
                out += self._land(f, params)
            elif self.step == lands - self.settings.delay + 1:
                self.engines[f].exchange_all()  # second phase, one step after the sync
        for f in range(len(self.fragments)):
            if self.syncs_at(f, self.step):
                self._start(f, params)
                if self.settings.delay == 0:
                    out += self._land(f, params)
        return out

    def _probe_step(self, params: Sequence[Array]) -> List[Tuple[int, Array]]:
        """``sync_every="auto"``: time the probe's inner steps; at its end sync every fragment at
        once, each timed alone, agree on the slowest rank's figures and choose H."""
        self._probe.append(self._clock())
        if self.step not in (auto.PROBE_STEPS // 2, auto.PROBE_STEPS):
            return []
        out: List[Tuple[int, Array]] = []
        exchange = 0.0
        for f in range(len(self.fragments)):
            t0 = self._clock()
            self._start(f, params)
            out += self._land(f, params)
            exchange = max(exchange, self._clock() - t0)
        if self.step < auto.PROBE_STEPS:  # the first sync: the engines' first use, not timed
            self._probe.append(self._clock())
            return out
        # the inner steps' intervals, without the one holding the first sync
        times = self._probe
        half = auto.PROBE_STEPS // 2
        step_s = statistics.median([b - a for a, b in zip(times[:half], times[1:half])] +
                                   [b - a for a, b in zip(times[half + 1:], times[half + 2:])])
        step_s, exchange = auto.agree(step_s, exchange, self.engines[0].gather)
        s = self.settings
        h = auto.choose(step_s, exchange, s.fragments, s.delay)
        self.schedule = dataclasses.replace(s, sync_every=h)
        self.auto = {"sync_every": h, "step_s": step_s, "exchange_s": exchange, "probe_steps": self.step,
                     "rule": (f"{s.fragments} x ceil(exchange / " + ("step)" if s.delay else
                                                                   f"({auto.OVERHEAD:g} x step))"))}
        self.step, self._probe = 0, []
        return out

    def _start(self, f: int, params: Sequence[Array]) -> None:
        eng = self.engines[f]
        size = eng.comm.size
        n = self._active() if (self._active is not None and size > 1) else size
        deltas = [self.globals[i] - self.ops.cast(params[i], "float32") for i in self.fragments[f]]
        eng.begin_step(deltas[0] if deltas else None)
        sub = eng.submit(deltas, compress=eng.compressing, joined=n < size)
        self._inflight[f] = (self.step + self.settings.delay, sub, n)

    def _land(self, f: int, params: Sequence[Array]) -> List[Tuple[int, Array]]:
        s, ops, eng = self.settings, self.ops, self.engines[f]
        _, sub, n = self._inflight.pop(f)
        avg = eng.complete(sub)
        eng.end_step()
        if n < eng.comm.size:  # Horovod's average with joined ranks' zeros: over those that took part
            avg = [g * (eng.comm.size / n) for g in avg]
        self.took_part[f] = n
        self.outer_steps[f] += 1
        out = []
        for i, g in zip(self.fragments[f], avg):
            d = g
            if s.momentum:
                buf = g * 1.0 if self.momentum[i] is None else self.momentum[i] * s.momentum + g
                self.momentum[i] = buf
                d = g + buf * s.momentum if s.nesterov else buf
            self.globals[i] = self.globals[i] - d * s.lr
            new = self.globals[i]
            if s.mix:
                new = ops.cast(params[i], "float32") * s.mix + new * (1 - s.mix)
            out.append((i, new))
        return out

    # --- what a checkpoint carries ------------------------------------------------------------
    def state(self, drop_in_flight: bool = False) -> dict:
        """The global parameters, the outer momentum, the step within the interval (the same on
        every rank) and every fragment's engine state (``engines``: this rank's residuals; the
        warm-up engine's last, where there is one). A
        fragment in flight cannot be saved: checkpoint where :attr:`in_flight` is False (always,
        with ``delay=0``). ``drop_in_flight`` (an elastic commit, which must not fail): saved as
        if a fragment in flight had not synced (its global parameters, momentum and count are
        still those before its sync; its engine's residuals as they are), so loading this state
        drops that sync."""
        if self._inflight and not drop_in_flight:
            raise RuntimeError(f"outer steps: fragment(s) {sorted(self._inflight)} are being reduced (delay="
                               f"{self.settings.delay}); save the checkpoint at a step where none is in "
                               "flight (OuterLoop.in_flight is False)")
        return {"settings": self.settings.describe(), "step": self.step, "warm": self.warm, "auto": self.auto,
                "outer_steps": list(self.outer_steps), "globals": list(self.globals), "momentum": list(self.momentum),
                "engines": [e.state() for e in self._all_engines()]}

    def _all_engines(self) -> List[Any]:
        return self.engines + ([self.warmup_engine] if self.warmup_engine is not None else [])

    def load_state(self, state: dict) -> None:
        if state.get("settings") != self.settings.describe():
            raise ValueError(f"this checkpoint's outer steps were {state.get('settings')!r}, the optimizer's are "
                             f"{self.settings.describe()!r}: resume with the same sync_every, outer optimizer, "
                             "fragments and delay")
        if len(state["globals"]) != len(self.globals):
            raise ValueError(f"the checkpoint holds {len(state['globals'])} global parameters, the optimizer "
                             f"{len(self.globals)}")
        self._inflight.clear()
        self.step = int(state["step"])
        self.warm = int(state.get("warm", self.settings.warmup))
        if self.settings.auto:  # H as chosen; saved while probing: the probe starts again
            self.auto = state.get("auto")
            h = (self.auto or {}).get("sync_every")
            self.schedule = dataclasses.replace(self.settings, sync_every=h) if h else None
            self._probe = []
            if h is None:
                self.step = 0
        self.outer_steps = list(state["outer_steps"])
        self.globals = [self._copy(g) for g in state["globals"]]
        self.momentum = [None if m is None else self._copy(m) for m in state["momentum"]]
        every = self._all_engines()
        for e, st in zip(every, state.get("engines") or [None] * len(every)):
            e.load_state(st)  # None (a rank that did not save): residuals from zero
