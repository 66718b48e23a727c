"""A small decoder-only transformer, byte-level, on a fixed selection of Python standard-library
sources (examples/workload_data.py), data-parallel with hvdp.

    horovodrun -np 2 -H localhost:2 python examples/torch_gpt.py --compression int8

bf16 autocast on CPU, gradient accumulation through backward_passes_per_step, linear warm-up then
cosine decay, gradient clipping on the averaged gradients (synchronize(), clip, then step()
inside skip_synchronize()), a checkpoint per epoch with hvd.save_checkpoint (--checkpoint; an
existing file is resumed from), and the held-out loss in nats and bits per byte after every epoch.
The learning rate is for the global batch (micro-batch x accumulation x workers), not scaled.

``--ddp-hook fp16|powersgd1|powersgd4`` trains the same model with torch DDP and that
communication hook instead of hvdp (the peers' comparison): accumulation by ``no_sync()`` on all
but the last micro-batch, clipping on DDP's averaged gradients, the same schedule and data.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

import hvdp.torch as hvd
from workload_data import corpus_summary, stdlib_corpus
from workload_ddp import add_ddp_args, nominal_wire_ratio, wrap
from workload_torch import (add_compression_args, distributed, progress, ranks_max_diff,
                            summary_line, write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=128, help="bytes per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per worker")
    p.add_argument("--accumulate", type=int, default=2, help="backward_passes_per_step")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps-per-epoch", type=int, default=50, help="optimizer steps")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak, for the global batch")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    p.add_argument("--val-windows", type=int, default=96, help="held-out sequences per evaluation")
    p.add_argument("--no-bf16", action="store_true", help="float32 compute instead of bf16 autocast")
    p.add_argument("--checkpoint", help="save here after every epoch; resume if it exists")
    add_compression_args(p)
    add_ddp_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="rank 0 writes the final figures and curves here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.ddp_hook and args.checkpoint:
        p.error("--checkpoint saves through hvdp (hvd.save_checkpoint); drop it or --ddp-hook")
    return args


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, layers, d, heads, context, vocab=256):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(context, d)
        self.blocks = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    torch.nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def batch(data, rng, n, context):
    """``n`` random windows: inputs and next-byte targets, (n, context) int64."""
    starts = rng.integers(0, len(data) - context - 1, size=n)
    w = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(w[:, :-1]), torch.from_numpy(w[:, 1:])


def validate(model, val, args, autocast):
    """Mean next-byte loss over evenly spaced held-out windows, this rank's share, summed over ranks."""
    starts = np.linspace(0, len(val) - args.context - 1, args.val_windows).astype(int)[hvd.rank()::hvd.size()]
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad(), autocast():
        for i in range(0, len(starts), 16):
            w = torch.from_numpy(np.stack([val[s:s + args.context + 1] for s in starts[i:i + 16]]).astype(np.int64))
            loss = F.cross_entropy(model(w[:, :-1]).float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
            total += torch.tensor([loss.item(), w[:, 1:].numel()], dtype=torch.float64)
    model.train()
    total = hvd.allreduce(total, op=hvd.Sum, name="val_loss")
    return (total[0] / total[1]).item()


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train, val = stdlib_corpus()
    model = GPT(args.layers, args.d_model, args.heads, args.context)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if args.ddp_hook:  # the peers' comparison: torch DDP with one of its hooks instead of hvdp
        ratio = nominal_wire_ratio(model, args.ddp_hook)
        # One DDP bucket: PowerSGD with no_sync() accumulation over several buckets stopped here
        # (torch 2.13, Gloo) with "op.preamble.length <= op.nbytes ... collective mismatch" once
        # compression began. PowerSGD approximates each tensor on its own: the layout of the
        # buckets changes how its collectives are batched and the random draw that starts each
        # tensor's Q, not the method.
        model, codec = wrap(model, args.ddp_hook, args.seed, args.powersgd_start,
                            bucket_cap_mb=1024 if args.accumulate > 1 else None)  # broadcasts rank 0's
    else:
        opt = distributed(opt, model, args, backward_passes_per_step=args.accumulate)
    total_steps = args.epochs * args.steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    def lr_factor(s):
        if s < args.warmup:
            return (s + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / max(1, total_steps - args.warmup))))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        extra = hvd.load_checkpoint(args.checkpoint, model, opt)
        sched.load_state_dict(extra["scheduler"])
        start_epoch = extra["epoch"]
    if not args.ddp_hook:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    if hvd.rank() == 0:
        print(f"{corpus_summary(train, val)}; model {n_params / 1e6:.2f}M parameters; global batch "
              f"{args.batch_size * args.accumulate * hvd.size()} x {args.context} bytes", flush=True)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16)
    show = hvd.rank() == 0 and not args.quiet
    step, losses, evals, t0 = start_epoch * args.steps_per_epoch, [], [], time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        bar = progress(args.steps_per_epoch, f"epoch {epoch + 1}/{args.epochs}", show)
        for _ in range(args.steps_per_epoch):
            rng = np.random.default_rng([args.seed, step, hvd.rank()])
            opt.zero_grad()
            step_loss = 0.0
            for micro in range(args.accumulate):
                x, y = batch(train, rng, args.batch_size, args.context)
                # DDP reduces on the last micro-batch's backward only; hvdp counts them itself
                local = model.no_sync() if (args.ddp_hook and micro < args.accumulate - 1) else nullcontext()
                with local:
                    with autocast():
                        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                    (loss / args.accumulate).backward()
                step_loss += loss.item() / args.accumulate
            if args.ddp_hook or args.sync_every:  # DDP's (and a warm-up's) averages are in p.grad already
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
            else:
                opt.synchronize()  # averaged gradients in p.grad: clip the global norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                with opt.skip_synchronize():
                    opt.step()
            sched.step()
            losses.append(step_loss)
            step += 1
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{step_loss:.3f}")
            if step >= total_steps:
                break
        if bar:
            bar.close()
        val_loss = validate(model, val, args, autocast)
        evals.append([step, val_loss])
        if hvd.rank() == 0:
            train_loss = np.mean(losses[-args.steps_per_epoch:])
            print(f"epoch {epoch + 1}/{args.epochs}  step {step}  train loss {train_loss:.4f}  "
                  f"val loss {val_loss:.4f}  ({val_loss / math.log(2):.3f} bits per byte)", flush=True)
        if args.checkpoint:
            hvd.save_checkpoint(args.checkpoint, model, opt, epoch=epoch + 1, scheduler=sched.state_dict())
        if step >= total_steps:
            break
    elapsed = time.perf_counter() - t0
    curve = hvd.allreduce(torch.tensor(losses), op=hvd.Average, name="loss_curve").tolist()
    diff = ranks_max_diff(model)
    if args.ddp_hook:
        line = f"compression {codec} (a DDP hook): wire bytes {ratio:.3f} of float32 (nominal)"
    else:
        codec, ratio, line = summary_line(opt)
    if hvd.rank() == 0:
        print(f"val loss {val_loss:.4f} ({val_loss / math.log(2):.3f} bits per byte)  |  "
              f"{len(losses) / max(elapsed, 1e-9):.2f} steps/s  |  {line}  |  ranks differ by {diff:.3g}", flush=True)
    write_json(args.json_out, {"val_loss": val_loss, "bits_per_byte": val_loss / math.log(2),
                               "train_curve": curve, "evals": evals, "codec": codec, "wire_ratio": ratio,
                               "steps": step, "size": hvd.size(), "seed": args.seed, "params": n_params,
                               "ranks_max_diff": diff, "seconds": elapsed,
                               "global_batch": args.batch_size * args.accumulate * hvd.size()})
    return val_loss


if __name__ == "__main__":
    main()
