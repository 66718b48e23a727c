"""Horovod's torch helpers that need to know hvdp's optimizer."""
import contextlib
import functools
from typing import List, Tuple

import horovod.torch as _hvd
import horovod.torch.optimizer as _hvd_optimizer
import torch

from .tensors import for_copy, write_back


@functools.wraps(_hvd.broadcast_optimizer_state)
def broadcast_optimizer_state(optimizer, root_rank, *args, process_set=_hvd.global_process_set, **kwargs):
    """Horovod's ``broadcast_optimizer_state``; with an hvdp optimizer, the step it may take to
    create the optimizer state is a local one (no gradient reduction, no compression state).
    State tensors of any dtype (bf16) and layout (channels_last) travel. ``process_set`` (hvdp;
    e.g. ``mesh.dp``, with ``root_rank=mesh.dp_root``, a global rank): only inside that set."""
    if process_set is not _hvd.global_process_set and process_set.process_set_id != 0:
        return _broadcast_state_in_set(optimizer, root_rank, process_set, *args, **kwargs)
    if getattr(optimizer, "_hvdp_distributed", False):
        with optimizer.skip_synchronize():
            return _broadcast_state(optimizer, root_rank, *args, **kwargs)
    return _broadcast_state(optimizer, root_rank, *args, **kwargs)


def _broadcast_state(optimizer, root_rank, *args, **kwargs):
    model = args[0] if args else kwargs.get("model")
    if not isinstance(optimizer, torch.optim.LBFGS) and not optimizer.state:
        _create_state(optimizer, model)  # Horovod's own creation would make bf16 state first
    swapped = _stand_ins(optimizer)
    try:
        return _hvd.broadcast_optimizer_state(optimizer, root_rank, *args, **kwargs)
    finally:
        for state, key, t, s in swapped:
            write_back(t, s)
            state[key] = t


def _broadcast_state_in_set(optimizer, root_rank, process_set, model=None):
    """Inside a process set (Horovod's own broadcast has no process_set): the root's state dict
    as one object; each rank keeps its own hvdp residuals (they are per worker)."""
    local = optimizer.skip_synchronize() if getattr(optimizer, "_hvdp_distributed", False) else \
        contextlib.nullcontext()
    with local:  # the state-creating step is a local one
        if not isinstance(optimizer, torch.optim.LBFGS) and not optimizer.state:
            _create_state(optimizer, model)
        sd = optimizer.state_dict()
        own = sd.pop("hvdp", None)
        got = _hvd.broadcast_object(sd, root_rank, name="hvdp.opt_state", process_set=process_set)
        if own is not None:
            got["hvdp"] = own
        optimizer.load_state_dict(got)


def _stand_ins(optimizer) -> List[Tuple[dict, str, torch.Tensor, torch.Tensor]]:
    """Put a tensor Horovod can broadcast in place of each state tensor it cannot take (Horovod
    broadcasts the tensors ``state_dict()`` hands it, in place); -> what to put back."""
    swapped = []
    for state in optimizer.state.values():
        for key, t in list(state.items()):
            if torch.is_tensor(t):
                s = for_copy(t)
                if s is not t:
                    state[key] = s
                    swapped.append((state, key, t, s))
    return swapped


def _create_state(optimizer, model) -> None:
    """Horovod's state creation (zero gradients, one local step), done before the broadcast."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = p.data.new(p.size()).zero_()
                if isinstance(optimizer, torch.optim.SparseAdam) or \
                        (isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    if optimizer.__module__ == _hvd_optimizer.DistributedOptimizer.__module__:
        super(optimizer.__class__, optimizer).step()  # Horovod's own: its step would reduce
    else:
        optimizer.step()
