"""Horovod's ``Compressor`` contract on hvdp's codecs: ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``, which Horovod's own module-level collectives call
(``hvd.allreduce(t, compression=hvd.Compression.fp16)``, ``grouped_allreduce``,
``reducescatter``) and Horovod scripts call by hand.

Only a codec whose cast survives Horovod's sum (``summable``: none, fp16) has this contract, and
it does exactly what Horovod's compressor of the same name does: each adapter registers its
framework's ``horovod.<framework>.Compression`` for its tensor types, and the work is Horovod's
own. bf16, int8 and topk carry per-worker scales or indices a sum would corrupt, and auto
chooses per bucket; they raise an error naming what to use instead.
"""
from typing import Any, List, Tuple

_FRAMEWORKS: List[Tuple[tuple, Any]] = []  # (tensor types, that framework's horovod Compression)


def register_framework(tensor_types: tuple, horovod_compression: Any) -> None:
    """Tensors of ``tensor_types`` are compressed by ``horovod_compression``'s members (an
    adapter calls this once, at import: ``(torch.Tensor,), horovod.torch.Compression``)."""
    entry = (tuple(tensor_types), horovod_compression)
    if entry not in _FRAMEWORKS:
        _FRAMEWORKS.append(entry)


def horovod_compressor(codec, tensor) -> Any:
    """The Horovod compressor that does ``codec``'s work on ``tensor``, or a clear error."""
    if not codec.summable:
        why = ("it chooses a codec per bucket" if codec.name == "auto" else
               "it sends low-rank factors of whole matrices, which need the tensors' shapes and state"
               if getattr(codec, "low_rank", False) else
               "its payload does not survive Horovod's sum; hvdp reduces it in two phases, alltoall "
               "+ allgather")
        raise ValueError(
            f"hvd.Compression.{codec.name} has no Horovod compress/decompress: it works inside hvdp's "
            f"DistributedOptimizer only ({why}). Pass it as hvd.DistributedOptimizer(..., "
            f"compression=hvd.Compression.{codec.name}); for a collective such as "
            f"hvd.allreduce(tensor, compression=...) use hvd.Compression.fp16 or hvd.Compression.none")
    for types, compression in _FRAMEWORKS:
        if isinstance(tensor, types):
            return getattr(compression, codec.name)
    raise TypeError(f"hvd.Compression.{codec.name}.compress: no framework takes a "
                    f"{type(tensor).__module__}.{type(tensor).__qualname__} (import hvdp.torch or "
                    f"hvdp.keras first; they register torch and TensorFlow tensors)")
