"""Elastic data order: which samples each worker trains on, surviving resets and resizes.

Every epoch has one shuffled order of the whole data set, the same on every rank (seeded by
``seed + epoch``). A step takes the next block of ``batch_size * size`` samples of that order
and rank r trains on the block's elements r, r + size, ... . The only state is the epoch and how
many samples of its order have been consumed (``processed``): after a reset the rest of the
epoch is re-split over however many workers there are now, none skipped and none repeated. The
last block of an epoch may be short, so a rank may get fewer samples (or none) in that step; it
still takes part in the step.

Without a batch size it is Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``: a sampler
for ``DataLoader(sampler=...)`` that yields this rank's sample indices of the rest of the epoch
(elements r, r + size, ... of it), padded as Horovod pads, by repeating its first samples, so
every rank has the same number (with the data loader's batches unknown, the ranks' step counts
must match); ``record_batch(batch_idx, batch_size)`` counts ``batch_size * size`` samples.

Also :func:`recorded_attempts`, what the adapters' ``hvd.elastic.run`` wraps around each attempt
for the flight record (``hvdp.cluster.flight``).
"""
from __future__ import annotations

import functools
import os
import random
import traceback
from typing import Callable, Iterator, List, Optional, Union

from . import flight as _flight


class ElasticOrder:
    """Framework-free core of an elastic sampler; ``get_rank`` / ``get_size`` are passed in.

    Example::

        order = ElasticOrder(len(data), batch_size=32, get_rank=hvd.rank, get_size=hvd.size)
        for idx in order:            # this rank's indices of each step (maybe fewer, maybe none)
            train_step(idx)
            order.record_batch()     # the step is done: its whole block counts as processed

        order = ElasticOrder(len(data), None, hvd.rank, hvd.size)   # Horovod's sampler
        loader = DataLoader(data, batch_size=32, sampler=order)
        for i, batch in enumerate(loader):
            train_step(batch)
            order.record_batch(i, 32)
    """

    def __init__(self, num_samples: int, batch_size: Optional[int], get_rank: Callable[[], int],
                 get_size: Callable[[], int], shuffle: bool = True, seed: int = 0):
        if isinstance(batch_size, bool):
            raise TypeError(f"ElasticSampler's second argument is hvdp's batch_size, not Horovod's "
                            f"shuffle: pass ElasticSampler(dataset, shuffle={batch_size}) by keyword")
        if num_samples <= 0 or (batch_size is not None and batch_size <= 0):
            raise ValueError(f"num_samples and batch_size must be positive, got {num_samples}, {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed = shuffle, seed
        self._get_rank, self._get_size = get_rank, get_size
        self.epoch = 0
        self.processed = 0
        self._last_block = 0

    def order(self) -> List[int]:
        idx = list(range(self.num_samples))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(idx)
        return idx

    def steps_left(self) -> int:
        block = self.batch_size * self._get_size()
        return -(-(self.num_samples - self.processed) // block)

    def __iter__(self) -> Iterator[Union[List[int], int]]:
        order, size, rank = self.order(), self._get_size(), self._get_rank()
        if self.batch_size is None:  # Horovod's sampler: this rank's samples, the same count everywhere
            yield from self._padded(order[self.processed:], size)[rank::size]
            return
        block = self.batch_size * size
        start = self.processed
        while start < self.num_samples:
            chunk = order[start:start + block]
            self._last_block = len(chunk)
            yield chunk[rank::size]
            # the caller records the step; if it did not, do not move past this block
            start = self.processed

    @staticmethod
    def _padded(rest: List[int], size: int) -> List[int]:
        """``rest`` made a multiple of ``size`` long by repeating its first samples (Horovod's rule)."""
        total = -(-len(rest) // size) * size
        out = list(rest)
        while rest and len(out) < total:
            out += rest[:total - len(out)]
        return out

    def __len__(self) -> int:
        if self.batch_size is None:
            return -(-(self.num_samples - self.processed) // self._get_size())
        return self.steps_left()

    def record_batch(self, batch_idx: Optional[int] = None, batch_size: Optional[int] = None) -> None:
        """A step is done. ``record_batch()``: the last yielded block counts as processed;
        Horovod's ``record_batch(batch_idx, batch_size)``: ``batch_size`` samples on every rank."""
        if batch_size is not None:
            self.processed = min(self.num_samples, self.processed + batch_size * self._get_size())
        elif self.batch_size is None:
            raise ValueError("an ElasticSampler made without batch_size counts what the data loader "
                             "took: call record_batch(batch_idx, batch_size), as with Horovod's")
        else:
            self.processed += self._last_block
        self._last_block = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (call when the previous one is finished)."""
        self.epoch, self.processed, self._last_block = epoch, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed, self._last_block = int(state["epoch"]), int(state["processed"]), 0


def raised_at(e: BaseException, frames: int = 3) -> str:
    """Where ``e`` was raised: its traceback's innermost ``frames`` frames, innermost first, each
    called from the next (``file:line in function``; the file's last two path parts)."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    return " <- ".join(f"{os.sep.join(f.filename.split(os.sep)[-2:])}:{f.lineno} in {f.name}"
                       for f in reversed(tb)) or "where no traceback says"


def recorded_attempts(func: Callable) -> Callable:
    """``func`` as an elastic ``run`` calls it, once per attempt (after the reset and the state's
    sync, on every rank): each attempt starts a new world in the flight record
    (``FlightRecorder.new_world``), and the state's own broadcasts (its sync, the host check of
    every ``commit``) are recorded as ``hvd.elastic.broadcast_object``; an attempt that ends with an
    error (a collective failed: the state rolls back) dumps the record. The adapters' ``run``."""
    @functools.wraps(func)
    def attempt(state, *args, **kwargs):
        _flight.RECORDER.new_world()
        bcast = getattr(state, "_bcast_object", None)  # Horovod's State keeps its broadcast there
        if bcast is not None and not getattr(bcast, "_hvdp_recorded", False):
            def recorded(obj, *a, **k):
                with _flight.RECORDER.around("hvd.elastic.broadcast_object", "broadcast_object"):
                    return bcast(obj, *a, **k)
            recorded._hvdp_recorded = True
            state._bcast_object = recorded
        try:
            return func(state, *args, **kwargs)
        except BaseException as e:  # a failed collective (the state rolls back): dumped, whatever
            if type(e).__name__ != "HostsUpdatedInterrupt":  # raised it (not a host added)
                _flight.RECORDER.dump(f"elastic attempt ended: {type(e).__name__}: {str(e)[:300]} "
                                      f"(raised {raised_at(e)})")
            raise
    return attempt
