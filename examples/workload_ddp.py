"""The peers hvdp is compared with: torch DDP over Gloo with one of its communication hooks, in
the same horovodrun job (Horovod gives the rank and size; DDP's process group is made here).

    --ddp-hook none | fp16 | bf16 | powersgd1 | powersgd4

``bf16`` is DDP's ``bf16_compress_hook``: DDP accepts it with NCCL on CUDA only and refuses it on
Gloo (its message is passed on). PowerSGD (``powerSGD_hook``: rank-r approximation of every matrix
gradient with error feedback and warm start; vectors travel uncompressed) runs plain allreduce for
its first ``--powersgd-start`` steps, as its documentation recommends.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import hvdp.torch as hvd
from hvdp import config

HOOKS = ("none", "fp16", "bf16", "powersgd1", "powersgd4")


def add_ddp_args(p):
    p.add_argument("--ddp-hook", choices=HOOKS, help="train with torch DDP and this communication hook "
                   "instead of hvdp (the peers' comparison)")
    p.add_argument("--powersgd-start", type=int, default=10, help="PowerSGD's start_powerSGD_iter")


def init_process_group():
    """DDP's Gloo process group over the ranks horovodrun started (once per process)."""
    if not dist.is_initialized():
        addr, port = config.ddp_addr(), config.ddp_port(29557)  # HVDP_DDP_ADDR, HVDP_DDP_PORT
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=hvd.rank(),
                                world_size=hvd.size())


def wrap(model, hook, seed=0, powersgd_start=10, bucket_cap_mb=None):
    """``model`` in DDP with ``hook`` registered; the name that describes it. ``bucket_cap_mb``:
    DDP's (None: its default)."""
    init_process_group()
    extra = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, **extra)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)  # raises on Gloo
    elif hook.startswith("powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(hook[8:]),
                                            start_powerSGD_iter=powersgd_start, use_error_feedback=True,
                                            warm_start=True, random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, f"ddp+{hook}" if hook != "none" else "ddp"


def nominal_wire_ratio(model, hook):
    """Bytes the hook sends per step ÷ a float32 allreduce's, once PowerSGD's warm-up is over:
    fp16/bf16 halve every gradient; PowerSGD rank r sends r(n + m) numbers for an n x m matrix
    (a conv weight is viewed as out x rest) when that is at most half of n*m (its default
    min_compression_rate 2), and every other gradient whole."""
    full = sum(p.numel() for p in model.parameters())
    if hook in ("fp16", "bf16"):
        return 0.5
    if not hook.startswith("powersgd"):
        return 1.0
    r, sent = int(hook[8:]), 0
    for p in model.parameters():
        n = p.shape[0] if p.dim() > 1 else 0
        m = p.numel() // n if n else 0
        sent += r * (n + m) if n and 2 * r * (n + m) <= n * m else p.numel()
    return sent / full
