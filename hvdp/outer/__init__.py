"""Outer steps: sync every H inner steps instead of every step (local SGD, DiLoCo, streaming).

Each worker takes H inner steps on its own; then the change of its parameters since the last
sync (the *pseudo-gradient*: global minus local) is averaged through the engine like a gradient
(every codec, error feedback carried from one outer step to the next), and an outer optimizer
(SGD, default lr 0.7, momentum 0.9, Nesterov; lr 1 without momentum is periodic averaging)
moves the global parameters, from which every worker continues.

- ``settings``: :class:`OuterSettings` (frozen, checked);
- ``loop``: :class:`OuterLoop`, the framework-free layer over one engine per fragment that an
  adapter calls after every inner step;
- ``stats``: what an outer-step optimizer's ``compression_stats()`` returns.
"""
from .loop import OuterLoop
from .settings import HIERARCHICAL_REFUSAL, NoWarmupWarning, OuterSettings, outer_codec, warmup_steps_of

__all__ = ["HIERARCHICAL_REFUSAL", "NoWarmupWarning", "OuterLoop", "OuterSettings", "outer_codec", "warmup_steps_of"]
