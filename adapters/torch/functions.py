"""Horovod's torch helpers that need to know hvdp's optimizer."""
import functools

import horovod.torch as _hvd


@functools.wraps(_hvd.broadcast_optimizer_state)
def broadcast_optimizer_state(optimizer, root_rank, *args, **kwargs):
    """Horovod's ``broadcast_optimizer_state``; with an hvdp optimizer, the step it may take to
    create the optimizer state is a local one (no gradient reduction, no compression state)."""
    if getattr(optimizer, "_hvdp_distributed", False):
        with optimizer.skip_synchronize():
            return _hvd.broadcast_optimizer_state(optimizer, root_rank, *args, **kwargs)
    return _hvd.broadcast_optimizer_state(optimizer, root_rank, *args, **kwargs)
