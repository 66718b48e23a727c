"""``compression="auto"`` in an optimizer: when to probe, the trial of the first steps, the
decision it keeps, what it shows.

The optimizer makes one :class:`Chooser` from the ``Auto`` settings, calls :meth:`Chooser.ensure`
before the first collective of every step and :meth:`Chooser.step_done` at the end of it:

1. probe (``hvdp.reduce.probe``) and decide (``hvdp.reduce.auto``): a proposal per bucket. It happens at the
   first step and again after :meth:`invalidate` (an elastic reset, a new bucket layout).
2. trial (``Auto.trial_steps`` = K > 0, and a proposal that compresses something): K steps run
   uncompressed, K with the proposal, and K with the runner-up (each compressed bucket with
   the next-best compressing codec of the model, when there is one); each step's time (end to
   end, as the training loop sees it, overlap included) is taken on every rank, the ranks'
   slowest per step kept (one allgather), and the plan of least median step time is kept, an
   earlier one (none, then the proposal) unless a later one beats it by more than the margin.
   This is the guard that auto never loses to none by more than noise: the probe's model
   ignores overlap and load, the trial does not. A plan the model predicts slower than
   ``TRY_WITHIN`` times the proposal (none on a slow link: 5x at 100 Mbit/s) is not tried: K
   such steps would cost more than the guard can win back; with only the proposal left there
   is no trial. The trial steps are training steps (nothing is
   repeated); their cost is at most 2K + 2 steps at a slower choice. The first step of each plan
   is not counted: it pays one-time costs (Horovod negotiating new names, new buffers).
3. final: the kept choice, until invalidated.

All ranks reach ``ensure`` at the same point of the same step, so the probe's collectives and
the trial's allgather line up, and all take the same decisions from the same numbers. On one
worker, or with a cost table given in the settings, nothing is probed and there is no trial.
"""
from __future__ import annotations

import statistics
import struct
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from .auto import Choice, CostTable, decide

TRIAL_NAME = "hvdp.auto.trial"
TRY_WITHIN = 2.0   # plans predicted slower than this x the proposal are not tried


class Chooser:
    """Settings (an :class:`~hvdp.codecs.auto.Auto`), the table, the proposal and the choice.

    Example::

        chooser = Chooser(Compression.auto)
        chooser.ensure({"b0": 84480}, reducer, world=2, probe=..., gather=...)   # each step start
        chooser.step_done()                                                      # each step end
    """

    __slots__ = ("settings", "table", "proposal", "choices", "stale", "phase", "_plans", "_times",
                 "_last", "_skip", "_untried", "trial", "probes", "probe_wall_s")

    def __init__(self, settings):
        # settings
        self.settings = settings
        # internal state
        self.table: Optional[CostTable] = None
        self.proposal: Dict[str, Choice] = {}   # what the probe's model chose
        self.choices: Dict[str, Choice] = {}    # what runs now
        self.stale = True
        self.phase: Optional[int] = None        # while on trial: the plan being timed
        self._plans: List[tuple] = []           # (name, {bucket: codec or "none"}) on trial
        self._times: List[List[float]] = []
        self._last: Optional[float] = None
        self._skip = False                      # the next step is a plan's first: not counted
        self._untried: Dict[str, float] = {}    # plans not tried: their predicted ms
        # statistics
        self.trial: Optional[dict] = None
        self.probes = 0
        self.probe_wall_s = 0.0   # this rank's wall time in probes, all of them

    @property
    def settled(self) -> bool:
        return not self.stale and self.phase is None

    def invalidate(self) -> None:
        self.stale, self.phase, self._last = True, None, None

    def step_done(self, now: Optional[float] = None) -> None:
        """End of a step: its time counts for the trial's current phase."""
        now = time.perf_counter() if now is None else now
        if self.phase is not None and self._last is not None and not self._skip:
            self._times[self.phase].append(now - self._last)
        self._skip = False
        self._last = now

    def ensure(self, buckets: Mapping[str, int], reducer, world: int,
               probe: Callable[[Mapping[str, int]], CostTable],
               gather: Callable[[bytes, str], List[bytes]]) -> None:
        """At a step's start: probe, move the trial on, or nothing (settled)."""
        k = self.settings.trial_steps
        if self.stale:
            self._propose(buckets, world, probe)
            trial = (k > 0 and self.settings.costs is None and world > 1
                     and any(c.codec.name != "none" for c in self.proposal.values()))
            self._plans, self._untried = self._trial_plans() if trial else ([], {})
            if len(self._plans) == 1:  # the others predicted too slow to try
                self.trial = self._figures(0, {}, "proposal")
                self._plans, trial = [], False
            self.phase, self._times = (0 if trial else None), [[] for _ in self._plans]
            self._use(reducer, self._plans[0][1] if trial else self.proposal)
        elif self.phase is not None and len(self._times[self.phase]) >= k:
            if self.phase + 1 < len(self._plans):
                self.phase += 1
                self._skip = True
                self._use(reducer, self._plans[self.phase][1])
            else:
                self._verdict(reducer, gather)

    def _trial_plans(self) -> Tuple[List[tuple], Dict[str, float]]:
        """none everywhere, the proposal, and the runner-up when it differs from both; -> (the
        plans to try, {name: predicted ms} of those predicted too slow to try)."""
        by_name = {str(c): c for c in self.settings.candidates}
        runner = {}
        for b, ch in self.proposal.items():
            others = [k for k in sorted(ch.predicted, key=ch.predicted.get)
                      if k != str(ch.codec) and by_name[k].name != "none"]
            runner[b] = by_name[others[0]] if (ch.codec.name != "none" and others) else ch.codec
        plans = [("none", {b: "none" for b in self.proposal}),
                 ("proposal", {b: c.codec for b, c in self.proposal.items()})]
        if any(runner[b] is not c.codec for b, c in self.proposal.items()):
            plans.append(("runner-up", runner))
        predicted = {name: self._predicted(plan) for name, plan in plans}
        bound = TRY_WITHIN * predicted["proposal"]
        untried = {name: 1e3 * t for name, t in predicted.items() if t > bound}
        return [(name, plan) for name, plan in plans if name not in untried], untried

    def _predicted(self, plan) -> float:
        """The model's seconds for a plan's buckets."""
        return sum(self.proposal[b].predicted.get("none" if c == "none" else str(c), 0.0) for b, c in plan.items())

    def _propose(self, buckets, world, probe):
        if self.settings.costs is not None:
            self.table = self.settings.costs
        elif world <= 1 or not buckets:
            self.table = CostTable(world)
        else:
            t0 = time.perf_counter()
            self.table = probe(buckets)
            self.probe_wall_s += time.perf_counter() - t0
            self.probes += 1
        self.proposal = decide(buckets, self.settings.candidates, self.table, self.settings.margin)
        self.stale, self.trial = False, None

    def _use(self, reducer, choice) -> None:
        """Run ``choice`` (bucket -> Choice, codec or "none") from now on."""
        none = next(c for c in self.settings.candidates if c.name == "none")
        self.choices = {}
        for b, c in choice.items():
            codec = c.codec if isinstance(c, Choice) else none if c == "none" else c
            self.choices[b] = Choice(b, self.proposal[b].elements, codec, self.proposal[b].predicted)
        reducer.assign({b: c.codec for b, c in self.choices.items()})

    def _verdict(self, reducer, gather) -> None:
        k, m = self.settings.trial_steps, len(self._plans)
        mine = [t for times in self._times for t in times[:k]]
        rows = [struct.unpack(f"<{m * k}d", b) for b in gather(struct.pack(f"<{m * k}d", *mine), TRIAL_NAME)]
        slowest = [max(r[i] for r in rows) for i in range(m * k)]  # the slowest rank sets the pace
        med = [statistics.median(slowest[i * k:(i + 1) * k]) for i in range(m)]
        best = min(med)
        keep = next(i for i in range(m) if med[i] <= best * (1.0 + self.settings.margin))
        self.trial = self._figures(k, {name: 1e3 * t for (name, _), t in zip(self._plans, med)}, self._plans[keep][0])
        self.phase = None
        self._use(reducer, self._plans[keep][1])

    def _figures(self, steps: int, ms: Dict[str, float], kept: str) -> dict:
        """What ``summary()["trial"]`` shows of a trial (steps 0: only the proposal was left)."""
        return {"steps": steps, "ms": ms, "kept": kept, "untried": self._untried,
                "plans": {name: {b: str(c) for b, c in plan.items()} for name, plan in self._plans}}

    def summary(self) -> dict:
        """The decision per bucket and the measured figures behind it."""
        return {"settings": str(self.settings), "decided": self.settled, "phase": self.phase,
                "buckets": [c.as_dict() for c in self.choices.values()],
                "proposal": {b: str(c.codec) for b, c in self.proposal.items()},
                "trial": self.trial,
                "costs": self.table.as_dict() if self.table is not None else None,
                "probes": self.probes, "probe_wall_s": self.probe_wall_s}
