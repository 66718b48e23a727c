"""Which parameters had a gradient on some rank this step.

Like Horovod, a rank without a gradient for a parameter (unused in its graph, or ``step()``
with no backward) reduces zeros, since another rank may have one. But where no rank had one,
plain torch leaves the gradient ``None`` and the optimizer skips the parameter (no momentum, no
weight decay); zeros would move it. So every rank sums a 0/1 per parameter each step; only a
rank that filled zeros waits for the sum, at once (it decides whether to put ``None`` back);
the others wait for it at the next step, when it is long done, so their step is not delayed.
A rank that had every gradient keeps them all: the sum is >= 1 wherever it had one, so every
rank decides the same.

The sum is in the flight record (``hvdp.cluster.flight``) as ``<scope>hvdp#present``: a rank
killed before it submitted the sum leaves the others waiting there. Its record ends when the sum
is found done (``finish_if_done``: at the end of the step that submitted it and at the next
step's first gradient, a poll that never waits), not only when the next step waits for it;
otherwise a rank that failed between the two would name a sum long finished as the place the
ranks parted.
"""
from typing import List, Optional, Sequence

import horovod.torch as _hvd
import torch

from hvdp.cluster.flight import RECORDER as FLIGHT

from .comm import synchronize


class Presence:
    def __init__(self, comm):
        self._comm = comm
        self._handle = None
        self._counts: Optional[torch.Tensor] = None
        self._rec = None                                 # the sum's flight record
        self._error: Optional[BaseException] = None      # its wait's, found by a poll

    def reset(self) -> None:
        """Drop what a failed step left (its collective is gone with Horovod's reset); a sum
        Horovod had finished before the failure is recorded as done (or failed), one still in
        flight stays so in the record."""
        self.finish_if_done()
        self._handle, self._counts, self._rec, self._error = None, None, None, None

    def submit(self, present: Sequence[bool], device, step: int = -1) -> None:
        self.finish_previous()
        self._counts = torch.tensor([1.0 if x else 0.0 for x in present], device=device)
        if self._comm.size > 1 and len(present):
            # '#' is in no parameter name, so no parameter's allreduce has this name
            name = self._comm.scope + "hvdp#present"
            self._handle, self._rec = FLIGHT.submitted(
                lambda: _hvd.allreduce_async_(self._counts, name=name, op=_hvd.Sum,
                                              process_set=self._comm.process_set),
                name, "none", "allreduce (presence)", 4 * len(present), step)

    def finish_if_done(self) -> None:
        """The sum's wait, where Horovod has finished it (never waits; its error, if any, is
        raised where the wait was: ``finish_previous``)."""
        if self._handle is not None and self._error is None:
            try:
                done = _hvd.poll(self._handle)
            except Exception:  # Horovod already down: finish_previous says so
                return
            if done:
                try:
                    self._finish()
                except BaseException as e:
                    self._error = e

    def _finish(self) -> None:
        handle, rec, self._handle, self._rec = self._handle, self._rec, None, None
        FLIGHT.waited(rec, lambda: synchronize(handle, self._comm.scope + "hvdp#present"))

    def finish_previous(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._handle is not None:  # one name in flight at a time
            self._finish()

    def nobody_had(self, indices: Sequence[int]) -> List[bool]:
        """For parameters (by index) this rank filled with zeros: did no rank have a gradient?"""
        self.finish_previous()
        counts = self._counts.tolist()
        return [counts[i] == 0.0 for i in indices]
