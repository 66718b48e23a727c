"""``sync_every="auto"``: H chosen from the measured inner step and exchange.

The first interval (after any warm-up) is a probe of :data:`PROBE_STEPS` inner steps with two
syncs of every fragment at once: one halfway (the engines' first use, whose one-time costs are
not timed) and one at its end, each fragment's reduction timed on its own (submit to result,
nothing else in flight); the inner step is the median time between two steps' ends, the steps
holding a sync left out. Every rank's figures are gathered and the slowest rank's taken, so every rank
chooses the same H:

- ``delay > 0`` (the exchange overlaps the inner steps): the K fragments' exchanges, one after
  the other on the link, must fit in the H inner steps between two syncs of a fragment:
  ``H = K * ceil(exchange / step)``;
- ``delay = 0`` (each sync waits for its exchange): the syncs may cost at most
  :data:`OVERHEAD` of the compute: ``H = K * ceil(exchange / (OVERHEAD * step))``;

then at least K and above ``delay``, at most :data:`MOST` (DiLoCo's published runs use 500).
The intervals count from the probe's sync.

Example::

    choose(step_s=0.2, exchange_s=0.5, fragments=1, delay=0)   # 25: 0.5 s per 25 x 0.2 s = 10%
"""
from __future__ import annotations

import math
import struct
from typing import Callable, List

PROBE_STEPS = 6
OVERHEAD = 0.1
MOST = 500


def choose(step_s: float, exchange_s: float, fragments: int, delay: int) -> int:
    """H from the inner step's and one fragment's exchange's seconds (see the module's rules)."""
    if not step_s > 0:
        raise ValueError(f"sync_every='auto': the inner step took {step_s!r} s; cannot choose H")
    budget = step_s if delay > 0 else OVERHEAD * step_s
    h = fragments * max(1, math.ceil(exchange_s / budget - 1e-9))
    return int(min(MOST, max(h, fragments, delay + 1)))


def agree(step_s: float, exchange_s: float, gather: Callable[[bytes, str], List[bytes]]) -> tuple:
    """The slowest rank's (step, exchange) seconds, the same on every rank."""
    every = [struct.unpack("<dd", b) for b in gather(struct.pack("<dd", step_s, exchange_s), "hvdp.outer.auto")]
    return max(s for s, _ in every), max(e for _, e in every)
