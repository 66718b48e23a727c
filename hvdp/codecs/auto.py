"""``compression="auto"``: the settings of hvdp's chooser. It is not a codec (it encodes nothing):
it names the codecs a bucket may get, and ``hvdp.reduce.auto`` picks one per bucket from measurements."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Tuple

from .base import Codec, get, names
from .compressor import horovod_compressor

# topk and int4 change what training sees (most of each gradient waits in the residual; a 4-bit
# step is a seventh of a block's largest value), so auto never picks them unless the user lists them
DEFAULT_CANDIDATES = ("none", "fp16", "bf16", "int8")


@dataclass(frozen=True)
class Auto:
    """Let hvdp measure the link and the codecs at the first step, and choose per bucket.

    Args:
        candidates: codec names or codec objects auto may choose from; ``"none"`` is always
            one of them (the baseline auto must never lose to). ``topk`` and ``int4`` only when listed.
        margin: a codec that does more work is chosen only when it is predicted faster than
            the less-work one by more than this fraction (ties go to less work, in the order
            none, then by measured codec cost).
        trial_steps: after the probe, K steps uncompressed then K steps with the probe's
            choice, timed; the choice stays only if it is faster (see ``hvdp.reduce.chooser``).
            0: the probe's model alone decides.
        costs: a measured :class:`hvdp.reduce.auto.CostTable` to decide from instead of probing
            (e.g. one printed by ``compression_stats()``); the same on every rank. No trial.

    Example::

        hvd.Compression.auto.configure(candidates=("none", "int8", "topk"))
    """

    name: ClassVar[str] = "auto"
    summable: ClassVar[bool] = False  # it may choose a two-phase codec (e.g. for hvd.join's rules)
    candidates: Tuple[Any, ...] = DEFAULT_CANDIDATES
    margin: float = 0.05
    trial_steps: int = 3
    costs: Any = None

    def __post_init__(self):
        given = (self.candidates,) if isinstance(self.candidates, (str, Codec)) else tuple(self.candidates)
        if any(isinstance(c, Auto) or (isinstance(c, str) and c.strip().lower() == "auto") for c in given):
            raise ValueError("auto cannot be its own candidate; valid names: " + ", ".join(names()))
        codecs = []
        for c in given:
            try:
                codecs.append(get(c))
            except (TypeError, ValueError) as e:
                raise ValueError(f"auto candidate {c!r}: {e}") from None
        low_rank = [c.name for c in codecs if getattr(c, "low_rank", False)]
        if low_rank:
            raise ValueError(f"auto cannot choose {low_rank[0]}: it reduces whole buckets by low-rank "
                             f"factors, not by the per-bucket payloads auto measures. Pass "
                             f"compression='{low_rank[0]}' (or hvd.Compression.{low_rank[0]}) itself")
        if not any(c.name == "none" for c in codecs):
            codecs.insert(0, get("none"))
        seen, unique = set(), []
        for c in codecs:
            if str(c) not in seen:
                seen.add(str(c))
                unique.append(c)
        object.__setattr__(self, "candidates", tuple(unique))
        if not 0.0 <= float(self.margin) < 1.0:
            raise ValueError(f"auto margin must be in [0, 1), got {self.margin!r}")
        if not isinstance(self.trial_steps, int) or self.trial_steps < 0:
            raise ValueError(f"auto trial_steps must be an int >= 0, got {self.trial_steps!r}")

    def compress(self, tensor):
        """Not a Horovod compressor: raises, naming what to use (``hvdp.codecs.compressor``)."""
        return horovod_compressor(self, tensor)

    def decompress(self, tensor, ctx):
        return horovod_compressor(self, tensor)

    def configure(self, **settings) -> "Auto":
        """A copy with other settings, e.g. ``configure(candidates=("none", "int8"))``."""
        return dataclasses.replace(self, **settings)

    def __str__(self) -> str:
        # what every rank must share (the ranks-agree digest): the settings, never the
        # measurements of one rank
        cands = ",".join(str(c) for c in self.candidates)
        fixed = "" if self.costs is None else f", costs={self.costs.digest()}"
        return f"auto(candidates=[{cands}], margin={self.margin}, trial_steps={self.trial_steps}{fixed})"
