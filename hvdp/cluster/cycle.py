"""Horovod's background cycle on jobs without a GPU: ``hvd.init()`` sets ``HOROVOD_CYCLE_TIME``
to :data:`CPU_CYCLE_MS` where nobody set it.

Horovod's background thread wakes once per cycle and, on every wake, agrees with the other
ranks on what is ready (a small collective of its own, even when nothing is). Horovod 0.21
shortened the default cycle from 5 ms to 1 ms (its changelog, #2468), which suits a GPU job: the
thread runs on host cores the GPU leaves idle. A job without a GPU trains on those cores itself,
and a thousand wakes a second per rank take from its compute: measured on two cores with two
ranks (``benchmarks/results/cycle_time.md``, the GPT of the time-to-accuracy benchmark), a step of
hvdp none took 0.79 of its time at 1 ms when the cycle was 5 ms, DDP's 0.85 and even the step with
no communication at all 0.87 (Horovod's thread cycles in every process that called hvd.init()).

So, where nothing says otherwise, hvdp sets 5 ms for a job without a GPU. It leaves the variable
alone where the user set it (``HOROVOD_CYCLE_TIME``, or ``horovodrun --cycle-time-ms``, which sets
it), where Horovod's autotuner chooses it (``HOROVOD_AUTOTUNE``), and on a GPU.

Example::

    choose({}, uses_gpu=False)                           # "5"
    choose({"HOROVOD_CYCLE_TIME": "1"}, uses_gpu=False)  # None: the user's 1 ms stands
"""
from __future__ import annotations

import os
from typing import Callable, MutableMapping, Optional

VAR = "HOROVOD_CYCLE_TIME"
CPU_CYCLE_MS = 5


def choose(environ, uses_gpu: bool) -> Optional[str]:
    """The cycle time (ms, as Horovod reads it) hvdp sets for this job, or None (it sets none)."""
    if uses_gpu or environ.get(VAR) or environ.get("HOROVOD_AUTOTUNE", "0") not in ("", "0"):
        return None
    return str(CPU_CYCLE_MS)


def apply(uses_gpu: Callable[[], bool], environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Before Horovod's init: set :data:`VAR` where :func:`choose` says so. -> the value set, or None."""
    environ = os.environ if environ is None else environ
    if environ.get(VAR):
        return None
    value = choose(environ, uses_gpu())
    if value is not None:
        environ[VAR] = value
    return value


def describe(environ, uses_gpu: bool) -> str:
    """One line for ``python -m hvdp doctor``."""
    value = choose(environ, uses_gpu)
    if value is not None:
        return f"Horovod's cycle: hvd.init() sets {VAR}={value} (ms; no GPU, none set; Horovod's default is 1)"
    if environ.get(VAR):
        return f"Horovod's cycle: {VAR}={environ[VAR]} ms, as set"
    if uses_gpu:
        return "Horovod's cycle: Horovod's default (1 ms; a GPU is used)"
    return "Horovod's cycle: chosen by Horovod's autotuner (HOROVOD_AUTOTUNE)"
