"""Do the ranks agree on what they are about to reduce? One digest exchange tells; a mismatch
becomes the same clear error on every rank instead of a hang in the first collective.

A rank with one more parameter submits a tensor nobody else ever submits (Horovod waits for it
forever); a rank with another codec calls alltoall where the others call allreduce (also a
hang). Both are known the moment the optimizer is made, so every rank describes its plan, the
ranks allgather a 32-byte digest of it, and only if the digests differ do they exchange the full
descriptions to say what differs and where. Every rank computes the message from the same
gathered list, so every rank raises the same words.

The adapters pass in one collective, ``allgather_fixed(data, name) -> [bytes of rank 0, ...]``
(equal lengths on every rank), as they pass collectives to the reducer.

Example::

    desc = describe([("0.weight", (10, 20), "float32", True)], compression="int8", op="average")
    check(desc, allgather_fixed, what="DistributedOptimizer")   # raises DisagreementError
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import HVDP_CHECK_AGREEMENT, check_agreement

DIGEST_BYTES = 32
MAX_SHOWN = 5  # differences named in the error; the rest are counted

AllgatherFixed = Callable[[bytes, str], List[bytes]]
Tensor = Tuple[str, Sequence[int], str, bool]


class DisagreementError(RuntimeError):
    """The ranks differ in something every rank must share (parameters, codec, settings)."""


def enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """``HVDP_CHECK_AGREEMENT=0`` turns the check off (it must be the same on every rank); a value
    that is not a boolean raises ValueError (``hvdp.config``)."""
    return check_agreement(environ)


def describe(tensors: Sequence[Tensor], buckets: Sequence[Sequence[int]] = (),
             versions: Optional[Mapping[str, str]] = None, **settings: Any) -> Dict[str, Any]:
    """A JSON-able description of what a rank is about to reduce.

    Args:
        tensors: (name, shape, dtype, requires_grad) of each tensor, in the rank's order.
        buckets: the compressed buckets (tuples of tensor indices), compared only when nothing
            else differs (another tensor list changes them anyway).
        versions: library versions, e.g. ``{"hvdp": "0.1.0", "horovod": "0.28.1"}``.
        **settings: anything else every rank must share (compression, policy, op, ...);
            values are compared by their ``str``.
    """
    return {"versions": {k: str(v) for k, v in (versions or {}).items()},
            "settings": {k: str(v) for k, v in settings.items()},
            "tensors": [[str(n), [int(d) for d in s], str(dt), bool(rg)] for n, s, dt, rg in tensors],
            "buckets": [[int(i) for i in b] for b in buckets]}


def encode(desc: Mapping[str, Any]) -> bytes:
    return json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()


def digest(desc: Mapping[str, Any]) -> bytes:
    return hashlib.sha256(encode(desc)).digest()


# --- the explanation --------------------------------------------------------------------------
def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def _has(rs: Sequence[int]) -> str:
    return "has" if len(rs) == 1 else "have"


def _tensor_str(t: Sequence[Any]) -> str:
    return f"{t[1]} {t[2]}" + ("" if t[3] else " (requires_grad=False)")


def _add(found: Dict[Any, List[int]], key: Any, rank: int) -> None:
    found.setdefault(key, []).append(rank)


def _tensor_differences(ref: List[list], other: List[list], r: int, found: Dict[Any, List[int]],
                        what: str) -> None:
    mine = {t[0]: t for t in ref}
    theirs = {t[0]: t for t in other}
    for t in other:
        if t[0] not in mine:
            _add(found, ("extra", t[0], _tensor_str(t)), r)
    for t in ref:
        if t[0] not in theirs:
            _add(found, ("lacks", t[0], _tensor_str(t)), r)
    for t in ref:
        u = theirs.get(t[0])
        if u is None:
            continue
        for i, field in ((1, "shape"), (2, "dtype"), (3, "requires_grad")):
            if t[i] != u[i]:
                _add(found, ("field", t[0], field, str(t[i]), str(u[i])), r)
    if [t[0] for t in ref] != [t[0] for t in other] and set(mine) == set(theirs):
        i = next(i for i, (a, b) in enumerate(zip(ref, other)) if a[0] != b[0])
        _add(found, ("order", i, ref[i][0], other[i][0]), r)


def _render(key: Any, rs: List[int], what: str) -> str:
    kind = key[0]
    if kind == "extra":
        return f"{_ranks(rs)} {_has(rs)} {what} '{key[1]}' {key[2]} that rank 0 lacks"
    if kind == "lacks":
        return f"rank 0 has {what} '{key[1]}' {key[2]} that {_ranks(rs)} {'lack' if len(rs) > 1 else 'lacks'}"
    if kind == "field":
        return f"{what} '{key[1]}' has {key[2]} {key[3]} on rank 0 but {key[4]} on {_ranks(rs)}"
    if kind == "order":
        return (f"the {what}s come in another order on {_ranks(rs)} than on rank 0 (position {key[1]}: "
                f"'{key[2]}' on rank 0, '{key[3]}' on {_ranks(rs)})")
    if kind == "setting":
        return f"{key[1]} is {key[2]!r} on rank 0 but {key[3]!r} on {_ranks(rs)}"
    if kind == "buckets":
        return (f"the compressed buckets differ on {_ranks(rs)} from rank 0's (bucket {key[1]}: "
                f"{key[2]} on rank 0, {key[3]} on {_ranks(rs)})")
    raise ValueError(kind)


def differences(descs: Sequence[Mapping[str, Any]], what: str = "parameter") -> List[str]:
    """Every difference between rank 0's description and the others', grouped by the ranks that
    share it: versions first, then settings, then tensors; buckets only when nothing else differs.
    ``what`` names a tensor in the messages ("parameter", "variable", ...)."""
    found: Dict[Any, List[int]] = {}
    ref = descs[0]
    for section in ("versions", "settings"):
        keys = list(ref.get(section, {}))
        keys += [k for d in descs[1:] for k in d.get(section, {}) if k not in keys]
        for k in keys:
            a = ref.get(section, {}).get(k, "<unset>")
            for r, d in enumerate(descs[1:], 1):
                b = d.get(section, {}).get(k, "<unset>")
                if a != b:
                    _add(found, ("setting", k, a, b), r)
    for r, d in enumerate(descs[1:], 1):
        _tensor_differences(ref.get("tensors", []), d.get("tensors", []), r, found, what)
    if not found:
        for r, d in enumerate(descs[1:], 1):
            a, b = ref.get("buckets", []), d.get("buckets", [])
            if a != b:  # name the first bucket that differs: a whole plan can be long
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                _add(found, ("buckets", i, str(a[i] if i < len(a) else None),
                             str(b[i] if i < len(b) else None)), r)
    return [_render(k, rs, what) for k, rs in found.items()]


def explain(descs: Sequence[Mapping[str, Any]], context: str, what: str = "parameter") -> str:
    """The error message: the first ``MAX_SHOWN`` differences, how many more, and the fix."""
    diffs = differences(descs, what) or ["the descriptions differ in a way not itemised (an hvdp bug)"]
    lines = [f"hvdp: the {len(descs)} ranks do not agree on {context}; reducing now would hang or "
             "mix different tensors. Differences:"]
    lines += [f"  - {d}" for d in diffs[:MAX_SHOWN]]
    if len(diffs) > MAX_SHOWN:
        lines.append(f"  ... and {len(diffs) - MAX_SHOWN} more")
    lines.append("Build the same model and pass the same optimizer settings on every rank (and "
                 f"install the same versions); {HVDP_CHECK_AGREEMENT}=0 turns this check off.")
    return "\n".join(lines)


# --- the exchange -----------------------------------------------------------------------------
def allgather_bytes(data: bytes, allgather_fixed: AllgatherFixed, name: str) -> List[bytes]:
    """Variable-length allgather from the fixed-length one: lengths first, then padded data."""
    lengths = [struct.unpack("<q", b)[0] for b in allgather_fixed(struct.pack("<q", len(data)), f"{name}.len")]
    width = max(lengths)
    got = allgather_fixed(data + b"\0" * (width - len(data)), f"{name}.data")
    return [g[:n] for g, n in zip(got, lengths)]


def check(desc: Mapping[str, Any], allgather_fixed: AllgatherFixed, context: str,
          what: str = "parameter", name: str = "hvdp.agree") -> None:
    """Raise :class:`DisagreementError` on every rank when the ranks' descriptions differ.

    Costs one allgather of ``DIGEST_BYTES`` bytes when they agree; two more (the full
    descriptions) when they do not. Does nothing when ``HVDP_CHECK_AGREEMENT=0``.

    Args:
        desc: this rank's :func:`describe`.
        allgather_fixed: ``(data, name) -> [every rank's data]``, equal lengths, in rank order.
        context: what is checked, for the message ("the DistributedOptimizer", ...).
        what: the word for one tensor in the message.
        name: collective name prefix, the same on every rank.
    """
    if not enabled():
        return
    digests = allgather_fixed(digest(desc), f"{name}.digest")
    if len(set(digests)) <= 1:
        return
    descs = [json.loads(b) for b in allgather_bytes(encode(desc), allgather_fixed, f"{name}.full")]
    raise DisagreementError(explain(descs, context, what))
