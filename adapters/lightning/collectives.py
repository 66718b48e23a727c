"""Lightning's collectives (``reduce``, ``all_gather``, ``broadcast``, ``barrier``) over Horovod's,
for every rank of the job (Lightning's ``group`` argument: None only).

Each is synchronous, so one fixed Horovod name per kind is enough: Horovod needs a name to be
unique only among the operations in flight."""
from typing import Any, Optional, Union

import hvdp.torch as hvd
import torch
from lightning.fabric.utilities.types import ReduceOp

# Horovod's collectives take these dtypes; others travel as the nearest one and come back cast
_CARRIER = {torch.bfloat16: torch.float32, torch.bool: torch.uint8}

_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
        "product": hvd.Product}
_TORCH_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.PRODUCT: "product"}
if hasattr(ReduceOp, "AVG"):
    _TORCH_OPS[ReduceOp.AVG] = "mean"


def _no_group(group: Optional[Any], what: str) -> None:
    if group is not None:
        raise ValueError(f"HorovodStrategy.{what}(group={group!r}): only the whole job (group=None) is "
                         "supported; reduce inside a subset with hvdp.torch's process sets "
                         "(hvd.allreduce(t, process_set=...)) instead")


def op_of(reduce_op: Optional[Union[ReduceOp, str]]):
    """Horovod's op for Lightning's ``reduce_op`` (None, a name or a ``ReduceOp``)."""
    if reduce_op is None:
        return hvd.Average
    name = reduce_op.lower() if isinstance(reduce_op, str) else _TORCH_OPS.get(reduce_op)
    if name not in _OPS:
        raise ValueError(f"HorovodStrategy.reduce: unsupported reduce_op {reduce_op!r}; use one of "
                         f"{sorted(_OPS)} or the matching ReduceOp")
    return _OPS[name]


def reduce(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
    """The tensor reduced over every rank (a non-tensor comes back unchanged, as in Lightning)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    _no_group(group, "reduce")
    op = op_of(reduce_op)
    carrier = _CARRIER.get(tensor.dtype, tensor.dtype)
    if op is hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
        carrier = torch.float32  # a mean of integers is not an integer
    out = hvd.allreduce(tensor.detach().to(carrier), op=op, name="hvdp.lightning.reduce")
    if op is hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
        return out
    return out.to(tensor.dtype)


def all_gather(tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` stacked on a new first dimension (size: the number of ranks)."""
    _no_group(group, "all_gather")
    carrier = _CARRIER.get(tensor.dtype, tensor.dtype)
    if sync_grads:  # Horovod's allgather is differentiable: each rank gets its slice's gradient
        return hvd.allgather(tensor.to(carrier).unsqueeze(0), name="hvdp.lightning.gather").to(tensor.dtype)
    with torch.no_grad():
        return hvd.allgather(tensor.detach().to(carrier).unsqueeze(0), name="hvdp.lightning.gather").to(tensor.dtype)


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (any picklable object)."""
    return hvd.broadcast_object(obj, root_rank=src, name="hvdp.lightning.broadcast")


def barrier() -> None:
    hvd.barrier()
