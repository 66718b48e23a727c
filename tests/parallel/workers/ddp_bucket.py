"""A stand-in for DDP's GradBucket, enough for PowerSGD's hook (torch's powerSGD_hook reads these
methods only); shared by tests/unit/test_powersgd_torch.py and powersgd_ddp_checks.py."""
import numpy as np


class FakeBucket:
    """What the hook reads of DDP's GradBucket: one flat buffer and per-tensor views of it."""

    def __init__(self, flat, shapes):
        self._buffer, self._views, off = flat, [], 0
        for s in shapes:
            k = int(np.prod(s))
            self._views.append(flat[off:off + k].view(s))
            off += k

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._views

    def index(self):
        return 0

    def is_last(self):
        return True
