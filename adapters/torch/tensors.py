"""Tensors Horovod's torch ops refuse as they are: a dtype it lacks (bfloat16 for every op; bool
and complex for broadcast) or a non-contiguous layout (channels_last, transposed). Each gets a
stand-in Horovod takes, and the result is written back into the user's tensor."""
from typing import List, Sequence, Tuple

import horovod.torch as _hvd
import torch

# Measured on Horovod 0.28.1 (torch): allreduce sums these floating dtypes; broadcast copies
# these dtypes. Anything else raises "Tensor type ... is not supported" from inside Horovod.
SUMMABLE = frozenset({torch.float16, torch.float32, torch.float64, torch.int32, torch.int64})
_COPYABLE = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.float16, torch.float32, torch.float64})
_BITS_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def for_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when Horovod can sum it in place; else a contiguous copy it can sum.

    A dtype Horovod lacks travels as float32: it holds every bf16 value exactly and the sum
    needs real arithmetic (an integer view of the bits would add bit patterns).
    """
    if t.dtype in SUMMABLE:
        return t if t.is_contiguous() else t.contiguous()
    if not t.is_floating_point():
        raise TypeError(f"Horovod cannot sum a {t.dtype} tensor; hvdp reduces floating-point "
                        "gradients only")
    return t.to(torch.float32, memory_format=torch.contiguous_format)


def for_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with ``t``'s bytes that Horovod can broadcast: ``t`` itself, a view
    of its bits as a same-size integer (bf16, bool, complex), or a contiguous copy."""
    src = t if t.is_contiguous() else t.contiguous()
    if src.dtype in _COPYABLE:
        return src
    if src.dim() == 0:  # view(dtype) needs a dimension to reinterpret
        src = src.reshape(1)
    if src.dtype == torch.bool:
        return src.view(torch.uint8)
    return src.view(_BITS_AS[src.element_size()])


def write_back(t: torch.Tensor, stand_in: torch.Tensor) -> None:
    """Put a stand-in's result into ``t``, unless the stand-in is ``t``'s own memory."""
    if t.is_contiguous() and stand_in.data_ptr() == t.data_ptr():
        return  # t itself, or a bit view of it: already written
    if stand_in.dtype != t.dtype and not stand_in.is_floating_point():
        stand_in = stand_in.view(t.dtype)  # a bit view of a copy; a float32 one is a value cast
    with torch.no_grad():
        t.copy_(stand_in.reshape(t.shape))


def broadcast_(items: Sequence[Tuple[str, torch.Tensor]], root_rank: int,
               process_set=_hvd.global_process_set) -> None:
    """Broadcast every ``(name, tensor)`` from ``root_rank`` in place, all submitted at once,
    for any dtype and layout (the bytes travel; a copy is written back where one was needed)."""
    pending: List[Tuple[torch.Tensor, torch.Tensor, object]] = []
    with torch.no_grad():
        for name, t in items:
            s = for_copy(t)
            pending.append((t, s, _hvd.broadcast_async_(s, root_rank, name=name, process_set=process_set)))
        for t, s, h in pending:
            _hvd.synchronize(h)
            write_back(t, s)
