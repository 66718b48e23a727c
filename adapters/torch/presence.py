"""Which parameters had a gradient on some rank this step.

Like Horovod, a rank without a gradient for a parameter (unused in its graph, or ``step()``
with no backward) reduces zeros, since another rank may have one. But where no rank had one,
plain torch leaves the gradient ``None`` and the optimizer skips the parameter (no momentum, no
weight decay); zeros would move it. So every rank sums a 0/1 per parameter each step; only a
rank that filled zeros waits for the sum, at once (it decides whether to put ``None`` back);
the others wait for it at the next step, when it is long done, so their step is not delayed.
A rank that had every gradient keeps them all: the sum is >= 1 wherever it had one, so every
rank decides the same.
"""
from typing import List, Optional, Sequence

import horovod.torch as _hvd
import torch

from .comm import synchronize


class Presence:
    def __init__(self, comm):
        self._comm = comm
        self._handle = None
        self._counts: Optional[torch.Tensor] = None

    def reset(self) -> None:
        """Drop what a failed step left (its collective is gone with Horovod's reset)."""
        self._handle, self._counts = None, None

    def submit(self, present: Sequence[bool], device) -> None:
        self.finish_previous()
        self._counts = torch.tensor([1.0 if x else 0.0 for x in present], device=device)
        if self._comm.size > 1 and len(present):
            # '#' is in no parameter name, so no parameter's allreduce has this name
            self._handle = _hvd.allreduce_async_(self._counts, name=self._comm.scope + "hvdp#present",
                                                 op=_hvd.Sum, process_set=self._comm.process_set)

    def finish_previous(self) -> None:
        if self._handle is not None:  # one name in flight at a time
            synchronize(self._handle, self._comm.scope + "hvdp#present")
            self._handle = None

    def nobody_had(self, indices: Sequence[int]) -> List[bool]:
        """For parameters (by index) this rank filled with zeros: did no rank have a gradient?"""
        self.finish_previous()
        counts = self._counts.tolist()
        return [counts[i] == 0.0 for i in indices]
