"""The LightningModule's optimizers made hvdp ``DistributedOptimizer`` s, with their schedulers
pointed at the new objects."""
import functools
from typing import Any, List

import hvdp.torch as hvd
import torch


def wrap_optimizers(module: torch.nn.Module, optimizers: List[torch.optim.Optimizer], schedulers: list,
                    backward_passes: int, kwargs: dict) -> List[torch.optim.Optimizer]:
    """One ``hvd.DistributedOptimizer`` per optimizer (``hvd.OuterOptimizer`` where ``kwargs`` has
    ``sync_every``; the module's float buffers averaged with the first one's syncs), each knowing
    its parameters' names; the ``schedulers`` built on one of ``optimizers`` drive its replacement."""
    names = {p: n for n, p in module.named_parameters()}
    owner = {}
    for i, opt in enumerate(optimizers):
        for p in (q for g in opt.param_groups for q in g["params"]):
            if p in owner and owner[p] != i:
                raise ValueError(f"HorovodStrategy: parameter {names.get(p, '?')} is in optimizers {owner[p]} and "
                                 f"{i}; its gradient would be averaged twice. Give each parameter to one optimizer")
            owner[p] = i
    wrapped = []
    for i, opt in enumerate(optimizers):
        named = [(names.get(p, f"opt{i}.param{j}"), p)
                 for j, p in enumerate(q for g in opt.param_groups for q in g["params"])]
        if kwargs.get("sync_every") is not None:  # outer steps: local inner steps, a sync every H
            new = hvd.OuterOptimizer(opt, named_parameters=named, buffers=module.named_buffers() if i == 0 else None,
                                     backward_passes_per_step=backward_passes, **kwargs)
        else:
            new = hvd.DistributedOptimizer(opt, named_parameters=named, backward_passes_per_step=backward_passes,
                                           **kwargs)
        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is opt:
                _rebind(scheduler, new)
        wrapped.append(new)
    return wrapped


def _rebind(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """The scheduler drives the wrapped optimizer (the same param_groups dicts, so learning rates
    it sets reach the step either way); its step counter marks ``optimizer.step`` calls, as
    torch's schedulers do for the optimizer they were built with."""
    scheduler.optimizer = optimizer
    step = optimizer.step

    @functools.wraps(step)
    def counted(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True
    optimizer.step = counted
