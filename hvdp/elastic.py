"""Elastic data order: which samples each worker trains on, surviving resets and resizes.

Every epoch has one shuffled order of the whole data set, the same on every rank (seeded by
``seed + epoch``). A step takes the next block of ``batch_size * size`` samples of that order
and rank r trains on the block's elements r, r + size, ... . The only state is the epoch and how
many samples of its order have been consumed (``processed``): after a reset the rest of the
epoch is re-split over however many workers there are now, none skipped and none repeated. The
last block of an epoch may be short, so a rank may get fewer samples (or none) in that step; it
still takes part in the step.
"""
from __future__ import annotations

import random
from typing import Callable, Iterator, List


class ElasticOrder:
    """Framework-free core of an elastic sampler; ``get_rank`` / ``get_size`` are passed in.

    Example::

        order = ElasticOrder(len(data), batch_size=32, get_rank=hvd.rank, get_size=hvd.size)
        for idx in order:            # this rank's indices of each step (maybe fewer, maybe none)
            train_step(idx)
            order.record_batch()     # the step is done: its whole block counts as processed
    """

    def __init__(self, num_samples: int, batch_size: int, get_rank: Callable[[], int],
                 get_size: Callable[[], int], shuffle: bool = True, seed: int = 0):
        if num_samples <= 0 or batch_size <= 0:
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

    def __iter__(self) -> Iterator[List[int]]:
        order, size, rank = self.order(), self._get_size(), self._get_rank()
        block = self.batch_size * size
        start = self.processed
        while start < self.num_samples:
            chunk = order[start:start + block]
            self._last_block = len(chunk)
            yield chunk[rank::size]
            # the caller records the step; if it did not, do not move past this block
            start = self.processed

    def __len__(self) -> int:
        return self.steps_left()

    def record_batch(self) -> None:
        """The last yielded step is done (committed or about to be): count its whole block."""
        self.processed += self._last_block
        self._last_block = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (call when the previous one is finished)."""
        self.epoch, self.processed, self._last_block = epoch, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed, self._last_block = int(state["epoch"]), int(state["processed"]), 0
