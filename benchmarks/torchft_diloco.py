"""torchft's ``DiLoCo`` as a baseline for the outer-step time-to-accuracy benchmark.

Call :func:`build` from inside each of the benchmark's worker processes, once
``torch.distributed`` is initialised with a Gloo group (every rank calls it, collectively)::

    tft = torchft_diloco.build(model, inner_opt, outer_opt, sync_every=H)
    with tft:                        # torchft's DiLoCo context: hooks on inner_opt.step()
        for x, y in batches:
            inner_opt.zero_grad()
            loss_fn(model(x), y).backward()
            inner_opt.step()         # every H-th call also runs torchft's outer step
    tft.close()                      # collective: barrier, then manager + lighthouse shut down
    tft.sync_seconds                 # wall time of each outer step (quorum + allreduce + outer opt)

Layout: every process is its own torchft *replica group* of size 1 (``replica_id``
``hvdp_<rank>``), with its own TCPStore; rank 0 also runs the Rust ``LighthouseServer``
(``min_replicas`` = world size) whose address it hands to the others over the existing
``torch.distributed`` group. The cross-replica averaging of pseudo-gradients runs on torchft's
own ``ProcessGroupGloo``, which the Manager configures at each quorum; the existing group is
used only to exchange the lighthouse address, broadcast rank 0's initial weights and for the
closing barrier.

torchft is not a dependency of hvdp and must not touch the environment's torch: it lives in a
``pip install --target`` directory keyed by version (``TORCHFT_DIR`` below; :func:`ensure_installed`
makes it), put at the *end* of ``sys.path`` so the environment's own packages win::

    pip download torchft==0.2.0 --no-deps -d /tmp/tft
    pip install --no-deps --target ~/.cache/hvdp/torchft-0.2.0 /tmp/tft/torchft-0.2.0-*.whl
    pip install --target ~/.cache/hvdp/torchft-0.2.0 "opentelemetry-exporter-otlp-proto-http>=1.39.0" \
        "opentelemetry-sdk>=1.39.0" "opentelemetry-api>=1.39.0"

(torchft 0.2.0 needs torch>=2.7 and imports opentelemetry at ``import torchft``; the wheel is
cp311 manylinux x86_64 only.)

Measured here (2 shared CPU cores, torch 2.13 CPU, 0.92M-parameter 4-layer d=128 transformer,
51 tensors, H=4): an outer step costs ~0.08 s with torchft's default per-tensor allreduce and
~0.03-0.04 s with ``diloco_kwargs={"use_bucketization": True}``, against ~0.03 s for one flat
Gloo allreduce of the pseudo-gradient plus the same outer SGD; the lighthouse's fast quorum takes
a few ms (both replicas heartbeat, so the tick does not matter), ``should_commit`` ~1 ms.
Quirks: each build starts ~12 threads (Rust runtime, Gloo, HTTP checkpoint server) that are not
all reclaimed by ``close()``, so build once per process; torchft's logger warns "Unable to reset
NCCL flight recorder" at each quorum reconfiguration (harmless on CPU); servers bind random
ports (``[::]:0``, lighthouse on IPv6 any).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

TORCHFT_VERSION = "0.2.0"
TORCHFT_DIR = os.path.expanduser(f"~/.cache/hvdp/torchft-{TORCHFT_VERSION}")
OTEL = ("opentelemetry-exporter-otlp-proto-http>=1.39.0", "opentelemetry-sdk>=1.39.0", "opentelemetry-api>=1.39.0")


def ensure_installed() -> str:
    """Install torchft (no dependencies: the environment's torch stays) and the opentelemetry
    packages it imports into :data:`TORCHFT_DIR` when that is not there yet; -> "" or why not."""
    import subprocess
    if os.path.isfile(os.path.join(TORCHFT_DIR, ".complete")):
        return ""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", TORCHFT_DIR]
    for extra in (["--no-deps", f"torchft=={TORCHFT_VERSION}"], list(OTEL)):
        r = subprocess.run(pip + extra, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            return f"pip could not install {extra[-1]}: {(r.stderr or r.stdout).strip()[-300:]}"
    open(os.path.join(TORCHFT_DIR, ".complete"), "w").close()
    return ""


def import_torchft():
    """The ``torchft`` module, from :data:`TORCHFT_DIR` if it is not importable already.
    Raises ImportError naming the install step when it is missing."""
    # The Rust side logs every quorum and commit at INFO to stderr unless RUST_LOG says otherwise.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        return importlib.import_module("torchft")
    except ImportError:
        if os.path.isdir(TORCHFT_DIR) and TORCHFT_DIR not in sys.path:
            sys.path.append(TORCHFT_DIR)
    try:
        return importlib.import_module("torchft")
    except ImportError as e:
        raise ImportError(f"torchft {TORCHFT_VERSION} not found (looked in {TORCHFT_DIR}): {e}; "
                          f"install it with the steps in {__file__}'s docstring") from e


class TorchftDiLoCo:
    """What :func:`build` returns: a context manager around torchft's ``DiLoCo``."""

    def __init__(self, diloco, manager, lighthouse, group):
        self.diloco = diloco
        self.manager = manager
        self.lighthouse = lighthouse
        self.group = group
        self.sync_seconds: list[float] = []  # per outer step, on this rank
        self.commits: list[bool] = []  # per outer step: whether torchft committed it
        self._closed = False

    def __enter__(self):
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc):
        return self.diloco.__exit__(*exc)

    def close(self):
        """Collective: wait for every rank, then stop this rank's manager (and on rank 0 the
        lighthouse). Idempotent."""
        if self._closed:
            return
        self._closed = True
        dist.barrier(group=self.group)
        self.manager.shutdown(wait=True)
        dist.barrier(group=self.group)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def build(model: torch.nn.Module, inner_opt: torch.optim.Optimizer, outer_opt: torch.optim.Optimizer,
          sync_every: int, *, host: str | None = None, group=None, broadcast_init: bool = True,
          timeout_s: float = 600.0, quorum_tick_ms: int | None = None,
          heartbeat_ms: int = 100, diloco_kwargs: dict | None = None) -> TorchftDiLoCo:
    """Wrap ``model``/``inner_opt``/``outer_opt`` in torchft's ``DiLoCo`` syncing every
    ``sync_every`` inner steps across all ranks of ``group`` (default: the world). Collective.

    ``outer_opt`` must be built over ``model.parameters()`` (e.g. ``SGD(lr=0.7, momentum=0.9,
    nesterov=True)``); torchft sets each parameter's ``.grad`` to the averaged pseudo-gradient
    ``global - local`` and steps it from the previous global weights. ``broadcast_init``: copy
    rank 0's parameters to every rank first (torchft's own ``init_sync`` would instead overwrite
    rank >0's first H local steps with rank 0's state, so it is off). ``host``: the address the
    other ranks reach this one's stores/servers at (default ``MASTER_ADDR`` or 127.0.0.1).
    ``timeout_s``: torchft's op and quorum timeouts (a quorum waits for a whole round of H steps
    on the slowest rank). ``quorum_tick_ms``: the lighthouse's tick (its default when None).
    ``diloco_kwargs``: passed on to ``DiLoCo`` (e.g. ``use_bucketization=True``)."""
    torchft = import_torchft()
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised (Gloo) before build()")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")

    if broadcast_init:
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group else 0, group=group)

    lighthouse = None
    addr = [None]
    if rank == 0:
        kw = {} if quorum_tick_ms is None else {"quorum_tick_ms": int(quorum_tick_ms)}
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world, **kw)
        addr = [lighthouse.address()]
    dist.broadcast_object_list(addr, src=dist.get_global_rank(group, 0) if group else 0, group=group)

    # This replica group's own store (one process per replica group).
    store = dist.TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=None, state_dict=None,
        min_replica_size=world, use_async_quorum=False,  # DiLoCo requires the synchronous quorum
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=60),
        rank=0, world_size=1, store_addr=host, store_port=store.port,
        lighthouse_addr=addr[0], replica_id=f"hvdp_{rank}", hostname=host,
        heartbeat_interval=timedelta(milliseconds=heartbeat_ms), init_sync=False)
    manager._hvdp_store = store  # keep the master store alive as long as the manager

    # Model + inner optimizer as the replica's user state (what a healing replica would fetch).
    manager.register_state_dict_fn(
        "hvdp_model",
        lambda sd: (model.load_state_dict(sd["model"]), inner_opt.load_state_dict(sd["inner"])),
        lambda: {"model": model.state_dict(), "inner": inner_opt.state_dict()})

    diloco = DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=sync_every,
                    **(diloco_kwargs or {}))
    out = TorchftDiLoCo(diloco, manager, lighthouse, group)

    # Time each outer step: DiLoCo's post-step hook runs quorum + allreduce + outer step when its
    # local counter reaches sync_every. Shadow the bound method before __enter__ registers it.
    post = diloco._step_post_hook

    def timed_post(opt, args, kwargs):
        syncing = diloco._local_step + 1 == diloco._sync_every
        step0, t0 = manager.current_step(), time.perf_counter()
        post(opt, args, kwargs)
        if syncing:
            out.sync_seconds.append(time.perf_counter() - t0)
            out.commits.append(manager.current_step() > step0)  # should_commit advanced the step

    diloco._step_post_hook = timed_post
    return out
