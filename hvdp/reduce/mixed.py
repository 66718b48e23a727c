"""A reducer whose buckets each have their own codec (``compression="auto"``'s decision).

A bucket assigned a summable codec (none, fp16) goes through one Horovod allreduce of the
flat bucket, cast to the codec's wire dtype; a bucket assigned a two-phase codec (bf16, int8,
topk) goes through that codec's :class:`~hvdp.reduce.twophase.TwoPhaseReducer` (one per codec, made by
the adapter's factory exactly as a fixed codec's reducer, so residuals, kernels and the
uneven-inputs wrapper are the same). It has the two-phase reducer's interface (start,
exchange, finish, residual stores, state), so the optimizers drive it unchanged.

When the decision changes (a new probe after an elastic reset, a new bucket layout), a bucket
keeps its residuals only if it keeps its codec; the others start from zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from .collectives import AVERAGE, allreduce_recorded
from .reducer import Reducer
from .stats import WireStats


@dataclass
class _Summed:
    name: str
    n: int
    codec: Any
    handle: Any


@dataclass
class _Routed:
    key: str
    inner: Any


class _Stores:
    """One view over the sub-reducers' residual stores of one side (worker or server)."""

    def __init__(self, owner: "MixedReducer", side: Callable[[Reducer], Any]):
        self.owner, self.side = owner, side  # side: a sub-reducer -> its store of this side

    def _all(self):
        return [self.side(r) for r in self.owner.reducers.values()]

    def create(self, name, n):
        """Nothing to make ahead: the sub-reducers' stores are made when a codec is assigned."""

    def set(self, name, value):
        self.side(self.owner.reducers[self.owner.key_of(name)]).set(name, value)

    def get(self, name):
        key = self.owner.key_of(name)
        r = self.owner.reducers.get(key) if key else None
        return self.side(r).get(name) if r is not None else None

    def snapshot(self) -> dict:
        out = {}
        for s in self._all():
            out.update(s.snapshot())
        return out

    def restore(self, data: dict) -> None:
        for key, r in self.owner.reducers.items():
            self.side(r).restore({k: v for k, v in data.items() if self.owner.key_of(k) == key})


class MixedReducer(Reducer):
    """Reduces named flat float32 buckets, each with the codec ``assign`` gave it.

    Example::

        r = MixedReducer(ops, comm, lambda codec, comm: TwoPhaseReducer(codec, ops, comm, True))
        r.assign({"b0": get("none"), "b1": get("int8")})
        pend = r.start("b1", flat); r.exchange(pend); out = r.finish(pend)
    """

    def __init__(self, ops, comm, make_two_phase: Callable[[Any, Any], Any], op: str = AVERAGE,
                 postscale: float = 1.0, stats: Optional[WireStats] = None):
        self.ops, self.comm, self.make_two_phase = ops, comm, make_two_phase
        self.op, self.postscale, self.stats = op, postscale, stats
        self.codec = None                         # no single codec; see ``choice``
        self.choice: Dict[str, Any] = {}          # bucket name -> codec
        self.reducers: Dict[str, Any] = {}        # str(codec) -> two-phase reducer
        self.worker, self.server = _Stores(self, lambda r: r.worker), _Stores(self, lambda r: r.server)

    error_feedback = True  # a bucket's two-phase codec may keep residuals (its reducer says)

    def key_of(self, bucket: str) -> Optional[str]:
        c = self.choice.get(bucket)
        return str(c) if c is not None and not c.summable else None

    def assign(self, choice: Mapping[str, Any]) -> None:
        """Set the codec of every bucket; residuals stay only where a bucket keeps its codec."""
        self.choice = dict(choice)
        for c in self.choice.values():
            if not c.summable and str(c) not in self.reducers:
                self.reducers[str(c)] = self.make_two_phase(c, self.comm)
        for key, r in self.reducers.items():  # each keeps what still belongs to it
            for store in (r.worker, r.server):
                store.restore({k: v for k, v in store.snapshot().items() if self.key_of(k) == key})

    def layout(self, n: int):
        raise TypeError("a bucket's residual sizes under compression='auto' depend on the codec "
                        "it was given: ask store_sizes(name, n)")

    def store_sizes(self, name: str, n: int):
        key = self.key_of(name)
        return self.reducers[key].store_sizes(name, n) if key is not None else (0, 0)

    # --- the reduction ------------------------------------------------------------------------
    def start(self, name: str, flat):
        codec = self.choice.get(name)
        if codec is None:
            raise RuntimeError(f"bucket {name!r} has no codec: the auto decision was not made "
                               f"for this layout (known: {', '.join(sorted(self.choice)) or 'none'})")
        if not codec.summable:
            return _Routed(str(codec), self.reducers[str(codec)].start(name, flat))
        n = self.ops.size(flat)
        x = flat if codec.wire_dtype == "float32" else self.ops.cast(flat, codec.wire_dtype)
        handle = allreduce_recorded(self.comm, x, f"hvdp.ar.{name}", self.op, self.postscale, self.stats,
                                    codec.name, n, codec.payload_nbytes(n))
        return _Summed(name, n, codec, handle)

    def exchange(self, pend) -> None:
        if isinstance(pend, _Routed):
            self.reducers[pend.key].exchange(pend.inner)

    def progress(self, pend) -> None:
        if isinstance(pend, _Routed):
            self.reducers[pend.key].progress(pend.inner)

    def finish(self, pend):
        if isinstance(pend, _Routed):
            return self.reducers[pend.key].finish(pend.inner)
        out = self.comm.wait(pend.handle) if self.comm.size > 1 else pend.handle
        return out if pend.codec.wire_dtype == "float32" else self.ops.cast(out, "float32")

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"codec": "auto", "size": self.comm.size,
                "choice": {k: str(c) for k, c in self.choice.items()},
                "reducers": {k: r.state_dict() for k, r in self.reducers.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Residuals of a bucket come back where its codec is the same as when saved."""
        saved = state.get("choice", {})
        for key, r in self.reducers.items():
            sub = state.get("reducers", {}).get(key)
            if sub is None:
                r.load_state_dict({"codec": None})
                continue
            def keep(d, key=key):
                return {k: v for k, v in d.items() if saved.get(k) == key == self.key_of(k)}
            r.load_state_dict(dict(sub, worker=keep(sub.get("worker", {})),
                                   server=keep(sub.get("server", {}))))
