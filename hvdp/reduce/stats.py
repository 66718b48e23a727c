"""Wire-byte accounting: what each step handed to the collectives, against the fp32 ring; and
where a compressed step's time goes (encode, wire wait, owner work, final decode)."""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Dict, Optional

# What ``sent`` does not count, per worker, fitted on the loopback counter of an isolated
# namespace (``python benchmarks/wire_bytes.py``: 2 workers, Gloo, the 5 ms cycle hvd.init() sets
# without a GPU): Horovod's per-cycle coordination, Gloo's framing and TCP/IP headers together
# grow with wall time, ~0.24 MB/s per worker (the median over codecs and runs of 2026-12-06;
# 0.15-0.32 MB/s; at Horovod's default 1 ms cycle 0.06-0.43 MB/s). An estimate, not a count.
UNCOUNTED_BYTES_PER_S = 240e3


def ring_allreduce_bytes(nbytes: int, p: int) -> float:
    """Bytes one worker sends in a ring allreduce of an ``nbytes`` buffer: 2(P-1)/P * nbytes."""
    return 2.0 * (p - 1) / p * nbytes if p > 1 else 0.0


def two_phase_bytes(payload_nbytes: int, p: int) -> float:
    """Bytes one worker sends in hvdp's alltoall + allgather of P payloads of ``payload_nbytes``."""
    return 2.0 * (p - 1) * payload_nbytes if p > 1 else 0.0


class WireStats:
    """Per-codec totals for the last completed step and since the start.

    ``sent`` is the bytes leaving this worker (ring / pairwise formulas applied to the buffers
    actually handed to the collectives); ``fp32`` what a float32 ring allreduce of the same
    gradients would send; ``handed`` the raw size of those buffers.

    Phase times (seconds, ``time.perf_counter``) of the two-phase reductions: ``encode`` (worker
    side, residual included), ``wire_wait`` (blocked in ``comm.wait``), ``owner`` (decode, sum,
    re-encode of the chunk this rank reduces), ``final_decode``; shown as mean ms per step.
    ``paths`` says which implementation ran each codec ("cpu-c", "array ops", ...) and
    ``paths_why`` why no kernel served a codec that runs on the array ops.
    """

    __slots__ = ("_step", "_last", "_total", "steps", "_t_step", "_t_last", "_t_total", "paths", "paths_why",
                 "_ended", "_interval")

    PHASES = ("encode", "wire_wait", "owner", "final_decode")

    def __init__(self):
        self._step: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._last: Dict[str, Dict[str, float]] = {}
        self._total: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps = 0
        # phase -> seconds: this step so far, the last completed step, since the start
        self._t_step: Dict[str, float] = defaultdict(float)
        self._t_last: Dict[str, float] = {}
        self._t_total: Dict[str, float] = defaultdict(float)
        self.paths: Dict[str, str] = {}
        self.paths_why: Dict[str, str] = {}
        self._ended: Optional[float] = None     # perf_counter at the last end_step
        self._interval: Optional[float] = None  # seconds between the last two end_steps

    def time(self, phase: str, seconds: float) -> None:
        self._t_step[phase] += seconds

    def path(self, codec: str, path: str, why: str = "") -> None:
        self.paths[codec] = path
        if why:
            self.paths_why[codec] = why
        else:
            self.paths_why.pop(codec, None)

    def record(self, codec: str, elements: int, handed: int, sent: float, fp32: float,
               cross: Optional[float] = None) -> None:
        """``cross``: of ``sent``, the bytes that leave this rank's node (a two-level reduction)."""
        row = self._step[codec]
        row["tensors"] += 1
        row["elements"] += elements
        row["handed"] += handed
        row["sent"] += sent
        row["fp32"] += fp32
        if cross is not None:
            row["cross"] += cross

    def record_allreduce(self, codec: str, elements: int, nbytes: int, p: int) -> None:
        """One allreduce of an ``nbytes`` buffer holding ``elements`` gradient elements."""
        self.record(codec, elements, nbytes, ring_allreduce_bytes(nbytes, p), ring_allreduce_bytes(4 * elements, p))

    def end_step(self) -> None:
        self._last = {k: dict(v) for k, v in self._step.items()}
        for k, v in self._step.items():
            for f, x in v.items():
                self._total[k][f] += x
        self._step.clear()
        self._t_last = dict(self._t_step)
        for k, v in self._t_step.items():
            self._t_total[k] += v
        self._t_step.clear()
        self.steps += 1
        now = time.perf_counter()
        self._interval = None if self._ended is None else now - self._ended
        self._ended = now

    def take_step(self) -> Dict[str, Dict[str, float]]:
        """The rows recorded since the last step ended, removed (a traced step's template:
        recorded once when traced, counted per executed step with :meth:`add_step`)."""
        rows = {k: dict(v) for k, v in self._step.items()}
        self._step.clear()
        self._t_step.clear()
        return rows

    def add_step(self, rows: Dict[str, Dict[str, float]], repeat: int = 1) -> None:
        """``repeat`` completed steps that each handed ``rows`` (no phase times: not measured)."""
        if repeat <= 0:
            return
        self._last = {k: dict(v) for k, v in rows.items()}
        for k, v in rows.items():
            for f, x in v.items():
                self._total[k][f] += x * repeat
        self._t_last = {}
        self.steps += repeat
        self._interval = None  # a traced step's time is not measured

    @staticmethod
    def _summary(rows: Dict[str, Dict[str, float]]) -> dict:
        out = {k: dict(v, ratio=(v["sent"] / v["fp32"] if v["fp32"] else 1.0)) for k, v in rows.items()}
        sent = sum(v["sent"] for v in rows.values())
        fp32 = sum(v["fp32"] for v in rows.values())
        out["all"] = {"sent": sent, "fp32": fp32, "ratio": sent / fp32 if fp32 else 1.0}
        if any("cross" in v for v in rows.values()):
            out["all"]["cross"] = sum(v.get("cross", 0.0) for v in rows.values())
        return out

    def phase_ms(self, last: bool = False) -> Dict[str, float]:
        """Mean ms per step of each phase since the start (``last``: of the last step)."""
        if last:
            return {k: 1e3 * self._t_last.get(k, 0.0) for k in self.PHASES}
        return {k: 1e3 * self._t_total.get(k, 0.0) / max(self.steps, 1) for k in self.PHASES}

    def not_counted(self) -> dict:
        """What ``sent`` leaves out, for the last step interval (end of step to end of step):
        an estimate of Horovod's coordination + Gloo framing + TCP/IP headers, time-proportional
        (:data:`UNCOUNTED_BYTES_PER_S`); None where the interval was not measured."""
        s = self._interval
        return {"interval_s": s, "estimate": None if s is None else s * UNCOUNTED_BYTES_PER_S,
                "bytes_per_s": UNCOUNTED_BYTES_PER_S,
                "what": "Horovod's per-cycle coordination, Gloo framing, TCP/IP headers (estimate, fitted "
                        "at 2 workers over Gloo); hvdp's control collectives are in sent"}

    def summary(self) -> dict:
        """``{"last_step": {codec: {...}, "all": {...}}, "total": {...}, "steps": n,
        "phase_ms": {phase: mean ms per step}, "phase_ms_last_step": {...}, "paths": {codec: path},
        "paths_why": {codec: why no kernel}}``."""
        return {"last_step": self._summary(self._last), "total": self._summary(self._total),
                "steps": self.steps, "phase_ms": self.phase_ms(), "phase_ms_last_step": self.phase_ms(True),
                "paths": dict(self.paths), "paths_why": dict(self.paths_why), "not_counted": self.not_counted()}


class TracedSteps:
    """The statistics of a step traced into a graph (Keras on TensorFlow): its collectives run
    without Python, so the record made while tracing is kept as a template, by (compressed,
    joined), and counted once per executed step.

    Example::

        traced.keep(True, False, stats.take_step())    # while tracing
        per_run = traced.expand(stats, steps=100, warmup=10)
    """

    def __init__(self):
        self.templates: Dict[tuple, Dict[str, Dict[str, float]]] = {}

    def __bool__(self) -> bool:
        return bool(self.templates)

    def keep(self, compressed: bool, joined: bool, record: Dict[str, Dict[str, float]]) -> None:
        self.templates[(bool(compressed), bool(joined))] = record

    def expand(self, live: WireStats, steps: int, warmup: int) -> WireStats:
        """``steps`` executed steps: the uncompressed template for the warm-up's, the compressed
        one after it; kernel paths from the live record."""
        out = WireStats()
        out.paths.update(live.paths)
        out.paths_why.update(live.paths_why)
        plain_steps = min(int(steps), warmup) if (False, False) in self.templates else 0
        for key, n in (((False, False), plain_steps), ((True, False), int(steps) - plain_steps)):
            if key in self.templates and n > 0:
                out.add_step(self.templates[key], n)
        return out
