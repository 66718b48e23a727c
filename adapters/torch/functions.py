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
    """Horovod's ``broadcast_optimizer_state``, without its side effects on a fresh optimizer.
    State tensors of any dtype (bf16) and layout (channels_last) travel. ``process_set`` (hvdp;
    e.g. ``mesh.dp``, with ``root_rank=mesh.dp_root``, a global rank): only inside that set.

    Horovod creates missing state by one optimizer step with zero gradients, which applies weight
    decay to the parameters (AdamW, SGD with weight_decay) and counts a step (Adam's bias
    correction): training then differs from one process's. Here, when the root's optimizer has no
    state yet, only its ``param_groups`` settings travel and every rank's optimizer stays fresh;
    when the root has state and a rank has none, that rank creates it by such a step (a local
    one for an hvdp optimizer) and gets its parameters and gradients back before the broadcast
    overwrites the state."""
    model = args[0] if args else kwargs.get("model")
    in_set = process_set is not _hvd.global_process_set and process_set.process_set_id != 0
    from .optimizer import is_distributed  # imported here: optimizer.py imports join.py, which imports this
    local = optimizer.skip_synchronize() if is_distributed(optimizer) else contextlib.nullcontext()
    with local:
        if not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS: Horovod's own handling
            root_has_state = _hvd.broadcast_object(bool(optimizer.state), root_rank, name="hvdp.opt_has_state",
                                                   process_set=process_set)
            if not root_has_state:
                _broadcast_settings(optimizer, root_rank, process_set)
                optimizer.state.clear()  # the root's: none
                return None
            if not optimizer.state:
                _create_state(optimizer, model)
        if in_set:
            return _broadcast_state_in_set(optimizer, root_rank, process_set, model)
        return _broadcast_state(optimizer, root_rank, *args, **kwargs)


def _broadcast_settings(optimizer, root_rank, process_set):
    """The root's ``param_groups`` settings (lr, betas, weight decay, ...), group by group."""
    mine = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    got = _hvd.broadcast_object(mine, root_rank, name="hvdp.opt_settings", process_set=process_set)
    if len(got) != len(mine):
        raise ValueError(f"broadcast_optimizer_state: the root rank's optimizer has {len(got)} parameter "
                         f"groups, this rank's {len(mine)}; build the optimizer the same way on every rank")
    for g, settings in zip(optimizer.param_groups, got):
        g.update(settings)


def _broadcast_state(optimizer, root_rank, *args, **kwargs):
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
    """Horovod's state creation (zero gradients, one local step; the state's values are the
    root's after the broadcast), then this rank's parameters and gradients as they were."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kept = [(p, p.detach().clone(), p.grad) for p in params]
    try:
        _zero_step(optimizer, model)
    finally:
        with torch.no_grad():
            for p, data, grad in kept:
                p.copy_(data)
                p.grad = grad


def _zero_step(optimizer, model) -> None:
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
