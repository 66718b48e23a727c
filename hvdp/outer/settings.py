"""What an outer-step optimizer does, frozen and checked once (both adapters make it).

Example::

    OuterSettings(sync_every=8)                      # DiLoCo's outer Nesterov SGD, lr 0.7
    OuterSettings(sync_every=4, lr=1.0, momentum=0)  # periodic parameter averaging
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from ..codecs.auto import Auto
from ..reduce.settings import is_low_rank

AUTO = "auto"

HIERARCHICAL_REFUSAL = (
    "hvd.OuterOptimizer(hierarchical=True): outer steps do not combine with the two-level reduction yet "
    "(every step inside a node, outer steps across nodes): each sync reduces over every rank at once. "
    "Fix: drop hierarchical=True (a sync's bytes are already 1/sync_every of a per-step exchange's), or "
    "use hvd.DistributedOptimizer(..., hierarchical=True) to reduce every step in two levels")

NO_WARMUP = (
    "hvd.OuterOptimizer without warmup_steps: outer steps from the first step. That suits a model that is "
    "already trained; from scratch, outer steps from step 0 ended 17-31% above data parallelism's held-out "
    "loss with the default outer SGD on hvdp's GPT benchmark (2% below it after 96 synchronous steps), and on "
    "its CNN and MLP only parameter averaging (outer_lr=1.0, outer_momentum=0.0, nesterov=False) matched "
    "data parallelism. Pass warmup_steps=W (synchronous steps first), or warmup_steps=0 to start outer steps at "
    "once without this warning; see docs/outer-steps.md")


class NoWarmupWarning(UserWarning):
    """``hvd.OuterOptimizer`` made without ``warmup_steps`` (rank 0 warns once per optimizer)."""


def warmup_steps_of(warmup_steps: Optional[int], rank: int) -> Any:
    """An ``hvd.OuterOptimizer``'s ``warmup_steps`` argument: None (not given) is 0, with a
    :class:`NoWarmupWarning` on rank 0; a value given is returned as it is (``OuterSettings``
    checks it)."""
    if warmup_steps is not None:
        return warmup_steps
    if rank == 0:
        warnings.warn(NO_WARMUP, NoWarmupWarning, stacklevel=3)
    return 0


def outer_codec(resolved: Tuple[Any, Any], arg: str, value: Any) -> Tuple[Any, Any]:
    """An ``hvd.OuterOptimizer`` argument's codec as the adapter's ``resolve`` gave it, or a
    ValueError naming the codecs it takes (a fixed hvdp codec: not powersgd, not auto, not
    one of Horovod's own compressors). ``arg``: "compression" or "warmup_compression"."""
    codec = resolved[0]
    if codec is None or is_low_rank(codec) or isinstance(codec, Auto):
        what = "pseudo-gradients" if arg == "compression" else "the warm-up steps' gradients"
        raise ValueError(f"hvd.OuterOptimizer reduces {what} with hvdp's codecs: {arg}={value!r} is not one "
                         "here; use 'none', 'fp16', 'bf16', 'int8', 'int4' or 'topk'")
    return resolved


@dataclass(frozen=True)
class OuterSettings:
    """The outer loop's settings (every rank must share them: the ranks-agree check sees them).

    Args:
        sync_every: H, inner steps between two syncs of a fragment (>= 1). H = 1 with lr 1 and
            no momentum is plain data parallelism on the parameters. ``"auto"``: chosen from
            the measured inner step and exchange after a probe interval (``hvdp.outer.auto``).
        lr, momentum, nesterov: the outer SGD applied to the averaged pseudo-gradient (PyTorch's
            ``torch.optim.SGD`` rule: the first step's momentum buffer is the gradient itself).
        fragments: K, the parameters split in K fragments synced in turn, fragment k at the
            inner steps where (step mod H) == k * H // K (Streaming DiLoCo); 1 syncs all at once.
        delay: tau, inner steps between a fragment's sync (its reduction started) and the step its
            average is applied; the exchange runs meanwhile. 0 applies it at once.
        mix: alpha, where a fragment lands after ``delay`` steps: the worker keeps
            ``mix * local + (1 - mix) * global`` (0: the global parameters replace the tau local
            steps made meanwhile; the ranks are then identical again).
        warmup: W, synchronous steps first (as ``start_localSGD_iter`` of PyTorch's post-local
            SGD): for W inner steps the adapter averages the gradients before the inner step, so
            every rank takes the same step; the first interval starts after them, from the
            parameters they reached.
        warmup_compression: the codec of the warm-up steps' gradient averages: "none" (float32,
            Horovod's allreduce) or a per-step codec ("fp16", "bf16", "int8", "int4", "topk":
            the two-phase reduction with its own error feedback, as ``hvd.DistributedOptimizer``
            with that compression). On a slow link the warm-up is the run's most expensive part.
    """

    sync_every: Union[int, str]
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    warmup: int = 0
    warmup_compression: str = "none"

    def __post_init__(self):
        def whole(name, v, lo):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if isinstance(self.sync_every, str) and self.sync_every != AUTO:
            raise ValueError(f"sync_every must be an integer >= 1 or 'auto', got {self.sync_every!r}")
        if not self.auto:
            whole("sync_every", self.sync_every, 1)
        whole("fragments", self.fragments, 1)
        whole("delay", self.delay, 0)
        whole("warmup", self.warmup, 0)
        if not isinstance(self.warmup_compression, str):
            raise ValueError(f"warmup_compression must be a codec's name ('none', 'int8', ...), got "
                             f"{self.warmup_compression!r}")
        if self.warmup_compression != "none" and not self.warmup:
            raise ValueError(f"warmup_compression={self.warmup_compression!r} without warmup_steps: there are "
                             "no warm-up steps to compress; pass warmup_steps=W (e.g. 96) or drop warmup_compression")
        # sync_every="auto": H is chosen later, at least fragments and above delay (hvdp.outer.auto)
        if not self.auto and self.fragments > self.sync_every:
            raise ValueError(f"fragments={self.fragments} is more than sync_every={self.sync_every}: each "
                             "fragment syncs at its own inner step of the interval; use fragments <= sync_every")
        if not self.auto and self.delay >= self.sync_every:
            raise ValueError(f"delay={self.delay} must be below sync_every={self.sync_every}: a fragment's "
                             "average must land before its next sync starts")
        if not self.lr > 0:
            raise ValueError(f"the outer lr must be > 0, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {self.momentum!r}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (as torch.optim.SGD); pass nesterov=False "
                             "for plain outer SGD")
        if not 0 <= self.mix < 1:
            raise ValueError(f"mix must be in [0, 1) (the weight of the worker's own parameters), got {self.mix!r}")

    @property
    def auto(self) -> bool:
        """``sync_every="auto"``: H chosen from measured times after a probe (``hvdp.outer.auto``)."""
        return self.sync_every == AUTO

    def offset(self, fragment: int) -> int:
        """The inner step of the interval (0..H-1) at which ``fragment`` syncs."""
        return (fragment * self.sync_every // self.fragments) % self.sync_every

    def describe(self) -> str:
        """One line for the ranks-agree check and ``compression_stats()``."""
        return (f"H={self.sync_every} lr={self.lr:g} momentum={self.momentum:g} nesterov={self.nesterov} "
                f"K={self.fragments} tau={self.delay} mix={self.mix:g}" + (f" W={self.warmup}" if self.warmup else "")
                + (f"/{self.warmup_compression}" if self.warmup_compression != "none" else ""))
