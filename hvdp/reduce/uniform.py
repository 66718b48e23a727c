"""``compression="auto"`` where a step is traced into a graph (Keras on TensorFlow): one codec
for the whole model, decided when the layout is set (a traced step cannot switch codecs), from
the settings' cost table or a probe run eagerly now.

Example::

    codec, figures = decide_once(get("auto"), comm, ops, {"b0": 4096}, contextlib.nullcontext,
                                 make.two_phase, gather)
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Tuple

from .auto import CostTable, decide_uniform
from .probe import measure


def decide_once(auto, comm, ops, buckets: Dict[str, int], eager: Callable,
                make_two_phase: Callable, gather: Callable[[bytes, str], List[bytes]]) -> Tuple[object, dict]:
    """-> (the codec, the figures ``compression_stats()["auto"]`` shows)."""
    probed, wall = False, 0.0
    if auto.costs is not None:
        table = auto.costs
    elif comm.size <= 1 or not buckets:
        table = CostTable(comm.size)
    else:
        t0 = time.perf_counter()
        with eager():
            table = measure(comm, ops, None, list(buckets.values()), auto.candidates, make_two_phase, gather)
        probed, wall = True, time.perf_counter() - t0
    codec, total = decide_uniform(buckets, auto.candidates, table, auto.margin)
    figures = {"settings": str(auto), "decided": True, "phase": None, "per_bucket": False,
               "codec": str(codec), "buckets": [{"bucket": b, "elements": n, "codec": str(codec)}
                                                for b, n in buckets.items()],
               "proposal": {b: str(codec) for b in buckets}, "trial": None,
               "predicted_ms": {k: 1e3 * v for k, v in total.items()}, "costs": table.as_dict(),
               "probes": int(probed), "probe_wall_s": wall}
    return codec, figures
