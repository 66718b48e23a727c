"""Which kernels serve a codec on a device: providers registered per backend, asked in order.

A provider is ``provider(codec, ops, like) -> CodecKernels | None``; to say why it cannot serve
(no compiler, a device it does not handle) it raises :class:`Unavailable` with a reason that
names the fix. ``select`` returns the first kernels that serve, or None: then the caller keeps
the codec's array-op path, which is always correct. ``HVDP_KERNELS=off`` forces that path.

Example::

    register("cpu-c", cpu_provider)                  # a backend's one line
    kernels = select(get("int8"), NumpyOps(), flat)  # None -> array ops
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ..config import HVDP_KERNELS, KERNEL_MODES, kernels_mode
from .base import CodecKernels, Unavailable  # Unavailable also importable from here, as before

Provider = Callable[[Any, Any, Any], Optional[CodecKernels]]
MODES = KERNEL_MODES


_PROVIDERS: List[Tuple[str, Provider]] = []


def register(name: str, provider: Provider, first: bool = False) -> Provider:
    """Enter a provider under ``name`` (asked after the others, or before them with ``first``:
    a device-specific backend such as CUDA goes first). A duplicate name is an error."""
    if any(n == name for n, _ in _PROVIDERS):
        raise ValueError(f"kernel provider {name!r} is already registered; "
                         f"registered: {', '.join(n for n, _ in _PROVIDERS)}")
    if first:
        _PROVIDERS.insert(0, (name, provider))
    else:
        _PROVIDERS.append((name, provider))
    return provider


def unregister(name: str) -> None:
    """Remove a provider (tests; a backend withdrawn at run time)."""
    _PROVIDERS[:] = [(n, p) for n, p in _PROVIDERS if n != name]


def providers() -> List[str]:
    return [n for n, _ in _PROVIDERS]


def mode() -> str:
    """``HVDP_KERNELS``: ``auto`` (default: kernels where one serves) or ``off`` (array ops)."""
    return kernels_mode()


def explain(codec, ops, like) -> Tuple[Optional[CodecKernels], List[str]]:
    """The kernels ``select`` picks (or None) and, for each provider that did not serve, why."""
    _load_builtin()
    if mode() == "off":
        return None, [f"{HVDP_KERNELS}=off: the array ops run (unset it to use kernels)"]
    reasons = []
    for name, provider in _PROVIDERS:
        try:
            k = provider(codec, ops, like)
        except Unavailable as e:
            reasons.append(f"{name}: {e}")
            continue
        except Exception as e:  # a broken backend must not stop training: the array ops serve
            reasons.append(f"{name}: failed ({type(e).__name__}: {e})")
            continue
        if k is not None:
            return k, reasons
        reasons.append(f"{name}: does not serve {codec} here")
    if not _PROVIDERS:
        reasons.append("no kernel provider is registered")
    return None, reasons


def select(codec, ops, like) -> Optional[CodecKernels]:
    """The first registered kernels that serve ``codec`` for arrays like ``like``, or None."""
    return explain(codec, ops, like)[0]


_BUILTIN_LOADED = False


def _load_builtin() -> None:
    # the CPU backend registers itself on import; imported late so that importing hvdp compiles
    # nothing
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        from . import cpu  # noqa: F401


def kernel_paths(ops=None, like=None, names=("int8", "bf16", "topk")) -> list:
    """One line per codec of the two-phase reduction: which implementation of its phases runs for
    arrays like ``like`` (default: numpy arrays in host memory) and, where no kernel serves, why.
    (fp16 and none are summed by Horovod's allreduce: no codec phases of hvdp's run for them.)"""
    from ..codecs import get
    if ops is None:
        import numpy as np
        from ..ops import NumpyOps
        ops, like = NumpyOps(), np.zeros(4, np.float32)
    lines = []
    for name in names:
        try:
            k, why = explain(get(name), ops, like)
        except ValueError as e:  # a bad HVDP_KERNELS value
            lines.append(f"{name}: array ops ({e})")
            continue
        if k is not None:
            desc = getattr(k, "description", "")
            lines.append(f"{name}: {k.path} kernel" + (f" ({desc})" if desc else ""))
        else:
            lines.append(f"{name}: array ops ({'; '.join(why)})")
    return lines
