"""An outer-step optimizer's ``compression_stats()`` (both adapters), from its loop and engines."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .settings import OuterSettings


def stats(settings: OuterSettings, engines: Sequence[Any], loop: Optional[Any] = None) -> dict:
    """An outer-step optimizer's ``compression_stats()``: each fragment's engine summary (per
    sync), the bytes one worker sends per inner step (every fragment's mean bytes per sync over
    H), beside float32 data parallelism's per step; with ``sync_every="auto"``, what it chose
    (``sync_every_auto``; None while probing); with ``warmup_compression``, the warm-up engine's
    summary (``warmup``: its steps, bytes per step)."""
    frags = [eng.summary() for eng in engines]
    per_sync = sum(f["total"]["all"]["sent"] / max(f["steps"], 1) for f in frags)
    fp32 = sum(f["total"]["all"]["fp32"] / max(f["steps"], 1) for f in frags)
    h = loop.sync_every if loop is not None else (None if settings.auto else settings.sync_every)
    out = {"outer": settings.describe(), "fragments": frags, "sync_every": h,
           "sent_per_inner_step": per_sync / h if h else None, "fp32_per_step_of_data_parallelism": fp32}
    if settings.auto:
        out["sync_every_auto"] = loop.auto if loop is not None else None
    if loop is not None and loop.warmup_engine is not None:  # warmup_compression: the warm-up's steps
        out["warmup"] = loop.warmup_engine.summary(steps=loop.warm)  # a traced step: counted per step run
    return out
