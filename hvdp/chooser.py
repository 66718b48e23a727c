"""``compression="auto"`` in an optimizer: when to probe, the decision it keeps, what it shows.

The optimizer makes one :class:`Chooser` from the ``Auto`` settings and calls :meth:`Chooser.ensure`
before the first collective of a step; it probes (``hvdp.probe``) and decides (``hvdp.auto``)
only when stale: at the first step, after :meth:`invalidate` (an elastic reset, a new bucket
layout). All ranks reach ``ensure`` at the same point of the same step, so the probe's
collectives line up. On one worker, or with a cost table given in the settings, nothing is
probed.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Mapping, Optional

from .auto import Choice, CostTable, decide
from .probe import measure


class Chooser:
    """Settings (an :class:`~hvdp.codecs.auto.Auto`), the current table and choice.

    Example::

        chooser = Chooser(Compression.auto)
        chooser.ensure({"b0": 84480}, reducer, probe=lambda sizes: measure(...))
    """

    __slots__ = ("settings", "table", "choices", "stale", "probes", "probe_wall_s")

    def __init__(self, settings):
        # settings
        self.settings = settings
        # internal state
        self.table: Optional[CostTable] = None
        self.choices: Dict[str, Choice] = {}
        self.stale = True
        # statistics
        self.probes = 0
        self.probe_wall_s = 0.0   # this rank's wall time in probes, all of them

    def invalidate(self) -> None:
        self.stale = True

    def ensure(self, buckets: Mapping[str, int], reducer, world: int,
               probe: Callable[[Mapping[str, int]], CostTable]) -> None:
        """Decide (probing first when needed) and hand the choice to ``reducer.assign``."""
        if not self.stale:
            return
        if self.settings.costs is not None:
            self.table = self.settings.costs
        elif world <= 1:
            self.table = CostTable(world)
        elif buckets:
            t0 = time.perf_counter()
            self.table = probe(buckets)
            self.probe_wall_s += time.perf_counter() - t0
            self.probes += 1
        else:
            self.table = CostTable(world)
        self.choices = decide(buckets, self.settings.candidates, self.table, self.settings.margin)
        reducer.assign({b: c.codec for b, c in self.choices.items()})
        self.stale = False

    def summary(self) -> dict:
        """The decision per bucket and the measured figures behind it."""
        return {"settings": str(self.settings), "decided": not self.stale,
                "buckets": [c.as_dict() for c in self.choices.values()],
                "costs": self.table.as_dict() if self.table is not None else None,
                "probes": self.probes, "probe_wall_s": self.probe_wall_s}


def probe_with(comm, ops, like, candidates, make_reducer, gather, sync=lambda: None):
    """``buckets -> CostTable``: :func:`hvdp.probe.measure` with an adapter's pieces bound."""
    return lambda buckets: measure(comm, ops, like, list(buckets.values()), candidates, make_reducer,
                                   gather, sync=sync)
