"""What an hvdp DistributedOptimizer reduces with, frozen, and what the engine needs from a framework.

:class:`ReduceSettings` is made once by an adapter from the user's arguments (checked there,
with messages that name the fix) and gives the one answer the rest of hvdp asks for: is this
a two-phase codec, does it keep error feedback, how is it named to the user and to the
ranks-agree check. The framework pieces the engine is handed besides (``Store``, ``PlainPath``) are written down
in ``hvdp.reduce.reducer``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from ..codecs.auto import Auto
from ..codecs.base import Codec
from .collectives import AVERAGE, SUM
from .plan import CompressionPolicy

Array = Any


def is_two_phase(codec) -> bool:
    """The one answer to "does this codec go through the two-phase reduction (alltoall +
    allgather)?": auto (it may choose such a codec) and every codec a sum would break."""
    return codec is not None and not is_low_rank(codec) and (isinstance(codec, Auto) or not codec.summable)


def is_low_rank(codec) -> bool:
    """Whether ``codec`` is reduced by low-rank factors over allreduce (powersgd, ``hvdp.reduce.lowrank``)."""
    return bool(getattr(codec, "low_rank", False))


@dataclass(frozen=True)
class ReduceSettings:
    """The settings every rank must share.

    Args:
        codec: a codec (``hvdp.codecs``), an :class:`~hvdp.codecs.auto.Auto`, or None when a
            Horovod ``Compressor`` does the work (compress, sum, decompress, as in Horovod).
        policy: what is compressed, and when. A codec's own warm-up (``Codec.warmup_steps``:
            powersgd's ``start_powerSGD_iter``) raises its ``warmup_steps`` to that many.
        op: ``hvdp.reduce.collectives.AVERAGE`` or ``SUM``.
        predivide: Horovod's ``gradient_predivide_factor`` (divide before the sum, multiply after).
        backward_passes: Horovod's ``backward_passes_per_step``.
        sparse_as_dense: sparse gradients reduced as dense ones.
        uneven_inputs: ranks may ``hvd.join()`` with any codec (``hvdp.reduce.join``): None (the
            default) is on wherever it is supported (not with ``hierarchical=True`` nor a
            low-rank codec), True insists (an error where unsupported), False is off. Resolved
            here, once, to a bool (what the engine, the adapters and the ranks-agree check see);
            the user's word stays in ``uneven_requested``.
        compressor: the Horovod compressor's name, with ``codec=None``.
        instance: the optimizer's number on its process set (its collectives' names).
        extra: (name, value) pairs an adapter adds (Keras's ``average_aggregated_gradients``).
        hierarchical: two levels (``hvdp.reduce.hierarchy``): full precision inside each node, the
            codec between nodes.

    Example::

        ReduceSettings(get("int8"), CompressionPolicy(), op=AVERAGE).two_phase   # True
    """

    codec: Any
    policy: CompressionPolicy
    op: str = AVERAGE
    predivide: float = 1.0
    backward_passes: int = 1
    sparse_as_dense: bool = False
    uneven_inputs: Optional[bool] = None
    compressor: str = ""
    instance: int = 0
    extra: Tuple[Tuple[str, Any], ...] = ()
    hierarchical: bool = False
    uneven_requested: Optional[bool] = field(default=None, init=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.policy, CompressionPolicy):
            raise TypeError("policy must be an hvdp.CompressionPolicy, e.g. "
                            "hvdp.CompressionPolicy(min_elements=4096)")
        if self.op not in (AVERAGE, SUM):
            raise ValueError(f"op must be average or sum, got {self.op!r}")
        if self.predivide != 1.0 and self.op != AVERAGE:
            raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
        if self.backward_passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {self.backward_passes}")
        if self.codec is None and not self.compressor:
            raise ValueError("ReduceSettings: codec=None needs the Horovod compressor's name")
        if self.uneven_inputs not in (None, True, False):
            raise TypeError(f"uneven_inputs must be None (the default), True or False, got {self.uneven_inputs!r}")
        start = self.codec.warmup_steps if isinstance(self.codec, Codec) else 0
        if start > self.policy.warmup_steps:  # the codec's own warm-up (powersgd's start_powerSGD_iter)
            object.__setattr__(self, "policy", dataclasses.replace(self.policy, warmup_steps=start))
        requested = self.uneven_inputs
        object.__setattr__(self, "uneven_requested", requested)
        if requested is None:  # on wherever the join control is supported
            object.__setattr__(self, "uneven_inputs", self.join_unsupported is None)
        if self.low_rank and (self.hierarchical or self.uneven_inputs):
            what = "hierarchical=True" if self.hierarchical else "uneven_inputs=True"
            raise ValueError(f"{what} is not supported with {self.codec.name} compression (it reduces "
                             "low-rank factors over Horovod's allreduce, in one level, every rank every "
                             f"step): drop {what}, or use compression='int8' with it")
        if self.hierarchical:
            if self.codec is None:
                raise ValueError(f"hierarchical=True runs hvdp's codecs, not a Horovod compressor "
                                 f"({self.compressor}): pass compression='none', 'fp16', 'bf16', 'int8', 'int4' "
                                 "or 'topk' (hvd.Compression.fp16 is hvdp's fp16)")
            if self.auto:
                raise ValueError("hierarchical=True with compression='auto' is not supported: auto measures "
                                 "the flat reduction. Choose the codec between nodes, e.g. "
                                 "compression='int8', hierarchical=True")
            if self.uneven_inputs:
                raise ValueError("hierarchical=True cannot combine with uneven_inputs=True (a joined rank "
                                 "would leave its node's reduce-scatter waiting): give every rank the same "
                                 "number of steps, or use hierarchical=False")

    @classmethod
    def from_user(cls, codec, hvd_compressor, policy=None, *, op_sum: bool = False, predivide: float = 1.0,
                  backward_passes: int = 1, sparse_as_dense: bool = False, uneven_inputs=None,
                  hierarchical=False, **more) -> "ReduceSettings":
        """The settings from a ``DistributedOptimizer``'s arguments as both adapters take them
        (``resolve(compression)``'s codec and Horovod compressor; ``policy=None`` is the default
        policy; ``op_sum``: the user passed ``op=hvd.Sum``); ``more``: ``instance``, ``extra``."""
        return cls(codec, CompressionPolicy() if policy is None else policy, op=SUM if op_sum else AVERAGE,
                   predivide=predivide, backward_passes=backward_passes, sparse_as_dense=sparse_as_dense,
                   uneven_inputs=None if uneven_inputs is None else bool(uneven_inputs),
                   compressor=compressor_name(hvd_compressor), hierarchical=bool(hierarchical), **more)

    @property
    def join_unsupported(self) -> Optional[str]:
        """Why ``hvd.join()`` cannot be made safe for these settings ("low_rank",
        "hierarchical"), or None where the per-step join control works."""
        if self.low_rank:
            return "low_rank"
        if self.hierarchical:
            return "hierarchical"
        return None

    @property
    def join_off(self) -> Optional[str]:
        """Why the join control is off (``hvdp.reduce.join.refusal``'s ``why``): "low_rank",
        "hierarchical", "off" (``uneven_inputs=False`` was passed), or None when it is on."""
        if self.uneven_inputs:
            return None
        return self.join_unsupported or "off"

    @property
    def auto(self) -> bool:
        return isinstance(self.codec, Auto)

    @property
    def two_phase(self) -> bool:
        """Whether the compressed buckets go through the two-phase reduction (:func:`is_two_phase`)."""
        return is_two_phase(self.codec)

    @property
    def low_rank(self) -> bool:
        """Whether the compressed buckets go through the low-rank reduction (:func:`is_low_rank`)."""
        return is_low_rank(self.codec)

    @property
    def bucketed(self) -> bool:
        """Whether compressible tensors are fused into buckets for a reducer (two-phase, low-rank
        or two-level), rather than each reduced by Horovod's allreduce."""
        return self.hierarchical or self.two_phase or self.low_rank

    def error_feedback(self, codec) -> bool:
        """Whether ``codec`` keeps error-feedback residuals: the policy's word, else the codec's default."""
        ef = self.policy.error_feedback
        return codec.error_feedback_default if ef is None else bool(ef)

    @property
    def compression(self) -> str:
        """The setting as the user and the ranks-agree check see it (auto's settings, not one
        rank's measured choice)."""
        return str(self.codec) if self.codec is not None else f"horovod:{self.compressor}"

    @property
    def codec_name(self) -> str:
        """The short name in messages ("int8", "auto", "horovod")."""
        return self.codec.name if self.codec is not None else "horovod"


def compressor_name(compressor) -> str:
    """A Horovod ``Compressor``'s name (its classes are used uncalled, as Horovod documents)."""
    if compressor is None:
        return ""
    return getattr(compressor, "__qualname__", type(compressor).__name__)
