"""``compression="auto"``: which codec makes each bucket cheapest, as a pure function of measured
costs. Measuring is ``hvdp.reduce.probe``'s job; this module only decides (and is unit-tested with
fake tables).

The cost model, per bucket of n float32 elements on P workers (every line fitted as A + B·x
from a probe of the job's own collectives and codecs, see :class:`CostTable`):

- ``none``: one Horovod allreduce of the 4n-byte bucket: ``allreduce.float32(4n)``;
- ``fp16``: the same of 2n bytes, plus the casts: ``allreduce.float16(2n) + compute[fp16](n)``;
- a two-phase codec (bf16, int8 + error feedback, a listed topk): chunks of c = ceil(n/P)
  (aligned), a payload of b(c) bytes each: ``alltoall(P·b) + allgather(b) + compute[codec](n)``,
  where ``compute`` is this rank's whole codec work for the bucket (encode with the residual,
  the owner's decode-sum and re-encode, the final decode) as the reducer runs it.

Each bucket gets the candidate of least predicted time; a candidate that does more work wins
only by more than ``margin`` (ties go to less work: none first, then by measured codec cost,
then by name), so the choice is deterministic. On one worker nothing travels: every bucket is
``none``. The model adds the parts of one bucket and ignores the overlap of buckets with each
other and with backward, so it errs towards less compression; a bucket's own collectives are
sequential (the allgather waits for the alltoall), which the sum describes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Sequence, Tuple

from .twophase import chunk_length

LINKS = ("allreduce.float32", "allreduce.float16", "alltoall", "allgather")


@dataclass(frozen=True)
class Line:
    """t(x) = fixed + slope · x seconds (x: bytes for a collective, elements for a codec)."""

    fixed: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.fixed + self.slope * x

    @staticmethod
    def fit(points: Sequence[Tuple[float, float]]) -> "Line":
        """Least squares through (x, seconds) points, clamped to non-negative terms (a noisy
        probe must not predict a negative cost)."""
        xs, ts = [float(x) for x, _ in points], [float(t) for _, t in points]
        if not xs:
            raise ValueError("Line.fit needs at least one point")
        mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
        if slope < 0:
            slope = 0.0
        fixed = mt - slope * mx
        if fixed < 0:  # through the origin instead
            fixed, slope = 0.0, sum(x * t for x, t in zip(xs, ts)) / max(sum(x * x for x in xs), 1e-30)
        return Line(fixed, max(slope, 0.0))


@dataclass(frozen=True)
class CostTable:
    """What a probe measured, the same on every rank.

    Args:
        world: the number of workers the links were measured with (P).
        links: ``"allreduce.float32"``, ``"allreduce.float16"``: seconds vs the bytes of the
            buffer each rank reduces; ``"alltoall"``: vs each rank's send buffer (P chunks);
            ``"allgather"``: vs each rank's own part.
        compute: by ``str(codec)``: seconds of this rank's codec work vs bucket elements.
        probe_s: the probe's own wall time (its cost to the job).

    Example::

        CostTable(2, {"allreduce.float32": Line(1e-4, 8e-9), ...}, {"int8(block_size=256)": Line(2e-4, 3e-9)})
    """

    world: int
    links: Mapping[str, Line] = field(default_factory=dict)
    compute: Mapping[str, Line] = field(default_factory=dict)
    probe_s: float = 0.0

    def as_dict(self) -> dict:
        line = lambda ln: {"fixed_ms": ln.fixed * 1e3, "ns_per_unit": ln.slope * 1e9}  # noqa: E731
        return {"world": self.world, "probe_s": self.probe_s,
                "links_per_byte": {k: line(v) for k, v in sorted(self.links.items())},
                "compute_per_element": {k: line(v) for k, v in sorted(self.compute.items())}}

    @staticmethod
    def from_dict(d: Mapping) -> "CostTable":
        """The inverse of :meth:`as_dict` (a table saved from ``compression_stats()``)."""
        line = lambda v: Line(v["fixed_ms"] / 1e3, v["ns_per_unit"] / 1e9)  # noqa: E731
        return CostTable(int(d["world"]), {k: line(v) for k, v in d["links_per_byte"].items()},
                         {k: line(v) for k, v in d["compute_per_element"].items()},
                         float(d.get("probe_s", 0.0)))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _line(table: Mapping[str, Line], key: str, what: str) -> Line:
    try:
        return table[key]
    except KeyError:
        have = ", ".join(sorted(table)) or "none"
        raise ValueError(f"the cost table has no {what} {key!r} (it has {have}); "
                         "probe with the same candidates, or pass a table that measured it") from None


def predict(codec, n: int, table: CostTable) -> float:
    """Predicted seconds to reduce an n-element bucket with ``codec`` on ``table.world`` workers."""
    p = table.world
    if p <= 1:
        return 0.0
    if codec.summable:
        wire = _line(table.links, f"allreduce.{codec.wire_dtype}", "link")(codec.payload_nbytes(n))
        return wire + (0.0 if codec.name == "none" else _line(table.compute, str(codec), "codec")(n))
    nb = codec.payload_nbytes(chunk_length(n, p, codec.align))
    return (_line(table.links, "alltoall", "link")(p * nb) + _line(table.links, "allgather", "link")(nb)
            + _line(table.compute, str(codec), "codec")(n))


@dataclass(frozen=True)
class Choice:
    """One bucket's decision and the predictions behind it (seconds by ``str(codec)``)."""

    bucket: str
    elements: int
    codec: object
    predicted: Mapping[str, float]

    def as_dict(self) -> dict:
        return {"bucket": self.bucket, "elements": self.elements, "codec": str(self.codec),
                "predicted_ms": {k: v * 1e3 for k, v in self.predicted.items()}}


def _work(codec, n: int, table: CostTable) -> Tuple[int, float, str]:
    """Sort key: less codec work first (none has none), then the name (deterministic)."""
    if codec.name == "none":
        return (0, 0.0, str(codec))
    ln = table.compute.get(str(codec))
    return (1, ln(n) if ln is not None else float("inf"), str(codec))


def decide(buckets: Mapping[str, int], candidates: Sequence, table: CostTable,
           margin: float = 0.05) -> Dict[str, Choice]:
    """Codec per bucket (name -> element count) of least predicted time.

    Example::

        decide({"b0": 1 << 20}, [get("none"), get("int8")], table)["b0"].codec
    """
    if not candidates:
        raise ValueError("auto needs at least one candidate codec")
    out: Dict[str, Choice] = {}
    for name, n in buckets.items():
        if table.world <= 1:
            none = next((c for c in candidates if c.name == "none"), candidates[0])
            out[name] = Choice(name, int(n), none, {})
            continue
        order: List = sorted(candidates, key=lambda c: _work(c, n, table))
        pred = {str(c): predict(c, n, table) for c in order}
        best = min(pred.values())
        pick = next(c for c in order if pred[str(c)] <= best * (1.0 + margin))
        out[name] = Choice(name, int(n), pick, pred)
    return out


def decide_uniform(buckets: Mapping[str, int], candidates: Sequence, table: CostTable,
                   margin: float = 0.05) -> Tuple[object, Dict[str, float]]:
    """One codec for every bucket (an adapter that runs a single codec, e.g. hvdp.keras): the
    candidate of least predicted total time, with the same margin and tie rule as :func:`decide`.
    Returns the codec and the predicted seconds per candidate (summed over the buckets)."""
    if not candidates:
        raise ValueError("auto needs at least one candidate codec")
    none = next((c for c in candidates if c.name == "none"), candidates[0])
    if table.world <= 1 or not buckets:
        return none, {}
    total = {str(c): sum(predict(c, n, table) for n in buckets.values()) for c in candidates}
    largest = max(buckets.values())
    order: List = sorted(candidates, key=lambda c: _work(c, largest, table))
    best = min(total.values())
    return next(c for c in order if total[str(c)] <= best * (1.0 + margin)), total
