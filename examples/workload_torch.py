"""What examples/torch_cnn.py and examples/torch_gpt.py share: the compression arguments, the
check that all ranks hold the same model, and rank 0's progress bar and JSON summary."""
import json

import torch

import hvdp.torch as hvd


def add_compression_args(p):
    p.add_argument("--compression", default="none", help="none, fp16, bf16, int8, int4, topk (or auto "
                   "where hvdp.torch offers it)")
    p.add_argument("--topk-ratio", type=float, default=0.01)
    p.add_argument("--no-error-feedback", action="store_true")
    add_outer_args(p)


def add_outer_args(p):
    p.add_argument("--sync-every", type=int, default=0, help="outer steps (hvd.OuterOptimizer): H inner "
                   "steps between syncs, the pseudo-gradients in --compression; 0: every step")
    p.add_argument("--warmup-steps", type=int, default=None, help="with --sync-every: synchronous steps "
                   "first (default: hvd.OuterOptimizer's)")
    p.add_argument("--outer-lr", type=float, default=None, help="with --sync-every: the outer SGD's lr "
                   "(default: hvd.OuterOptimizer's; 1 with --outer-momentum 0 averages the parameters)")
    p.add_argument("--outer-momentum", type=float, default=None, help="with --sync-every: the outer SGD's "
                   "Nesterov momentum (default: hvd.OuterOptimizer's; 0: plain outer SGD)")


def compression_kwargs(args):
    """``compression=`` and ``policy=`` for hvd.DistributedOptimizer from the parsed arguments."""
    compression = args.compression
    if compression == "topk":
        compression = hvd.Compression.topk.configure(ratio=args.topk_ratio)
    policy = hvd.CompressionPolicy(error_feedback=False) if args.no_error_feedback else None
    return {"compression": compression, "policy": policy}


def distributed(opt, model, args, **kwargs):
    """``opt`` wrapped as the arguments ask: ``hvd.DistributedOptimizer`` (every step), or
    ``hvd.OuterOptimizer`` with ``--sync-every`` (its buffers averaged at the syncs)."""
    named = model.named_parameters()
    if not args.sync_every:
        return hvd.DistributedOptimizer(opt, named_parameters=named, **compression_kwargs(args), **kwargs)
    return hvd.OuterOptimizer(opt, named_parameters=named, sync_every=args.sync_every,
                              buffers=model.named_buffers(), **outer_kwargs(args), **compression_kwargs(args))


def outer_kwargs(args):
    """hvd.OuterOptimizer's outer settings that the arguments give (the rest its defaults)."""
    given = {"warmup_steps": args.warmup_steps, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    outer = {k: v for k, v in given.items() if v is not None}
    if args.outer_momentum is not None:
        outer["nesterov"] = args.outer_momentum > 0
    return outer


def average_buffers(model):
    """Average floating buffers (batch-norm running statistics) over the ranks, so that every rank
    evaluates the same model; integer buffers (batch counters) are equal already."""
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.copy_(hvd.allreduce(b, op=hvd.Average, name=f"buffer.{name}"))


def ranks_max_diff(model):
    """Largest absolute difference between this rank's parameters and buffers and rank 0's, the
    maximum over ranks (0.0: every rank holds the same model)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()])
    ref = hvd.broadcast(flat, root_rank=0, name="ranks_identical.ref")
    diff = (flat - ref).abs().max().reshape(1)
    return hvd.allreduce(diff, op=hvd.Max, name="ranks_identical.max").item()


def progress(total, desc, show):
    if not show:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, ncols=80)


def summary_line(opt):
    stats = opt.compression_stats()
    if "outer" in stats:  # hvd.OuterOptimizer: bytes per inner step against float32's every step
        ratio = stats["sent_per_inner_step"] / stats["fp32_per_step_of_data_parallelism"]
        return stats["outer"], ratio, f"outer steps {stats['outer']}: wire bytes {ratio:.3f} of float32 per step"
    wire = stats["total"]["all"]
    return stats["codec"], wire["ratio"], (
        f"compression {stats['codec']} ({stats['compressed_tensors']} tensors compressed, "
        f"{stats['plain_tensors']} plain): wire bytes {wire['ratio']:.3f} of float32")


def write_json(path, result):
    if path and hvd.rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f)
