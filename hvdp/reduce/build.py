"""Makes the reducers an engine runs (construction only: which reducer, with which stores,
statistics, kernels wrapper and join control), so every reducer of one optimizer is made the
same way: the fixed codec's, each of auto's per-bucket ones, the loop-back probe's.

Example::

    make = ReducerFactory(settings, NumpyOps(), comm, WireStats())
    red = make.for_codec(get("int8"))            # a TwoPhaseReducer with in-memory stores
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .hierarchy import HierarchicalReducer
from .join import JoinableReducer
from .lowrank import LowRankReducer
from .mixed import MixedReducer
from .reducer import Reducer
from .settings import ReduceSettings, is_low_rank, is_two_phase
from .stats import WireStats
from .twophase import TwoPhaseReducer


class ReducerFactory:
    """The pieces every reducer of one optimizer is made from.

    Args:
        settings, ops, comm, stats: the engine's.
        make_store: ``side -> Store`` ("w": worker, "s": server residuals), or None for
            in-memory stores.
        wrap_codec: applied to each codec a reducer runs (torch.compile'd codecs), or None.
        joined: this step's "has some rank joined?" (the join control of ``uneven_inputs``).
        per_bucket: auto decides per bucket (its two-phase reducers keep in-memory stores: the
            adapter's stores are sized for one codec).
    """

    def __init__(self, settings: ReduceSettings, ops, comm, stats: WireStats, *,
                 make_store: Optional[Callable] = None, wrap_codec: Optional[Callable] = None,
                 joined: Callable[[], bool] = lambda: False, per_bucket: bool = False):
        self.settings, self.ops, self.comm, self.stats = settings, ops, comm, stats
        self._make_store, self._wrap, self._joined = make_store, wrap_codec, joined
        self.per_bucket = per_bucket

    def _stores(self) -> Tuple[Any, Any]:
        if self._make_store is None:
            return None, None
        return self._make_store("w"), self._make_store("s")

    def run(self, codec):
        """The codec as reducers run it (wrapped where the adapter asks)."""
        return self._wrap(codec) if self._wrap is not None else codec

    def two_phase(self, codec, comm) -> Reducer:
        """The reducer of a two-phase codec, as training runs it; on another comm (auto's
        loop-back probe) without statistics, residual stores of the adapter or join control."""
        s, own = self.settings, comm is self.comm
        stores = self._stores() if (own and not self.per_bucket) else (None, None)
        r = TwoPhaseReducer(self.run(codec), self.ops, comm, s.error_feedback(codec), s.op, s.predivide,
                            self.stats if own else None, *stores)
        return JoinableReducer(r, self._joined) if (own and s.uneven_inputs) else r

    def low_rank(self, codec) -> Reducer:
        """powersgd's reducer: allreduce of factors, its state in the adapter's stores
        (residuals: worker side; warm-start Qs: server side)."""
        s = self.settings
        return LowRankReducer(codec, self.ops, self.comm, s.error_feedback(codec), s.op, s.predivide,
                              self.stats, *self._stores())

    def hierarchical(self, codec, levels) -> Reducer:
        """The two-level reducer over ``levels`` = (local, cross) collectives."""
        s, (local, cross) = self.settings, levels
        return HierarchicalReducer(codec, self.ops, local, cross, s.error_feedback(codec), s.op,
                                   s.predivide, self.stats, *self._stores(), wrap=self._wrap)

    def mixed(self) -> Reducer:
        """auto's per-bucket reducer: a two-phase reducer per codec it assigns."""
        s = self.settings
        return MixedReducer(self.ops, self.comm, self.two_phase, s.op, s.predivide, self.stats)

    def for_codec(self, codec) -> Optional[Reducer]:
        """A fixed codec's reducer, or None where Horovod's allreduce does it all (casts)."""
        if is_two_phase(codec):
            return self.two_phase(codec, self.comm)
        if is_low_rank(codec):
            return self.low_rank(codec)
        return None
