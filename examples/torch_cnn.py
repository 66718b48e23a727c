"""A small convolutional network with batch norm on the bundled digits images, data-parallel
with hvdp (any codec; synchronised batch norm optional); one-pixel shifts as augmentation.

    horovodrun -np 2 -H localhost:2 python examples/torch_cnn.py --compression int8 --sync-bn

Each rank trains on its own shard of every epoch's shuffle; the learning rate is scaled by the
number of workers. Batch-norm running statistics are averaged over the ranks before each
evaluation, so every rank evaluates the same model.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

import hvdp.torch as hvd
from workload_data import digits_images, shift_batch
from workload_ddp import add_ddp_args, nominal_wire_ratio, wrap
from workload_torch import (add_compression_args, average_buffers, distributed, progress,
                            ranks_max_diff, summary_line, write_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: all)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="for one worker; scaled by size")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="SGD with momentum 0.9, or AdamW "
                   "(give it its own --lr, e.g. 2e-3)")
    p.add_argument("--width", type=int, default=32, help="channels of the first conv layer")
    p.add_argument("--sync-bn", action="store_true", help="batch statistics over all workers' "
                   "samples: Horovod's SyncBatchNorm on a GPU, CpuSyncBatchNorm on CPU")
    p.add_argument("--bn-refresh", action="store_true", help="before each evaluation, recompute the batch-norm "
                   "running statistics of the current weights over the training set (torch's update_bn)")
    add_compression_args(p)
    add_ddp_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", help="rank 0 writes the final figures and curves here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


class _SumOverRanks(torch.autograd.Function):
    """Sum over the ranks; the backward pass sums the gradients too (named: Horovod's response
    cache keeps hitting, unlike the fresh automatic names of an unnamed allreduce)."""

    @staticmethod
    def forward(ctx, t, name):
        ctx.name = name
        return hvd.allreduce(t, op=hvd.Sum, name=name + ".fwd")

    @staticmethod
    def backward(ctx, grad):
        return hvd.allreduce(grad, op=hvd.Sum, name=ctx.name + ".bwd"), None


class CpuSyncBatchNorm(torch.nn.BatchNorm2d):
    """Batch norm over all workers' samples for CPU tensors (Horovod's SyncBatchNorm takes GPU
    tensors only). Layers are numbered in construction order, the same on every rank."""
    _made = 0

    def __init__(self, channels):
        super().__init__(channels)
        self.sync_name = f"syncbn.{CpuSyncBatchNorm._made}"
        CpuSyncBatchNorm._made += 1

    def forward(self, x):
        if not self.training or hvd.size() == 1:
            return super().forward(x)
        n = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
        stats = _SumOverRanks.apply(torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), n]), self.sync_name)
        c = x.shape[1]
        count = stats[2 * c]
        mean = stats[:c] / count
        var = (stats[c:2 * c] / count - mean * mean).clamp_min(0)
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(m * mean.detach())
            self.running_var.mul_(1 - m).add_(m * var.detach() * count / (count - 1))
            self.num_batches_tracked += 1
        xhat = (x - mean[None, :, None, None]) * torch.rsqrt(var + self.eps)[None, :, None, None]
        return xhat * self.weight[None, :, None, None] + self.bias[None, :, None, None]


def make_model(width=32, sync_bn=False):
    bn = torch.nn.BatchNorm2d
    if sync_bn:
        bn = hvd.SyncBatchNorm if torch.cuda.is_available() else CpuSyncBatchNorm

    def block(cin, cout):
        return [torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False), bn(cout), torch.nn.ReLU()]
    return torch.nn.Sequential(*block(1, width), *block(width, 2 * width), torch.nn.MaxPool2d(2),
                               *block(2 * width, 2 * width), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(2 * width, 10))


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        out = model(x)
        return F.cross_entropy(out, y).item(), (out.argmax(1) == y).float().mean().item()


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = digits_images()
    xte, yte, ytr_t = torch.from_numpy(xte), torch.from_numpy(yte), torch.from_numpy(ytr)
    model = make_model(args.width, args.sync_bn)
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr * hvd.size(), weight_decay=5e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9, weight_decay=5e-4)
    if args.ddp_hook:  # the peers' comparison: torch DDP with one of its hooks instead of hvdp
        ratio = nominal_wire_ratio(model, args.ddp_hook)
        model, codec = wrap(model, args.ddp_hook, args.seed, args.powersgd_start)
    else:
        opt = distributed(opt, model, args)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    global_batch = args.batch_size * hvd.size()
    steps = len(xtr) // global_batch
    total_steps = steps * args.epochs if not args.max_steps else min(args.max_steps, steps * args.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(  # cosine decay to zero at the last step
        opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s, total_steps) / total_steps)))
    show = hvd.rank() == 0 and not args.quiet
    losses, evals, step, t0 = [], [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        shard = order[:steps * global_batch][hvd.rank()::hvd.size()].numpy()
        rng = np.random.default_rng([args.seed, epoch, hvd.rank()])
        model.train()
        bar = progress(steps, f"epoch {epoch + 1:2d}/{args.epochs}", show)
        for s in range(steps):
            idx = shard[s * args.batch_size:(s + 1) * args.batch_size]
            xb = torch.from_numpy(shift_batch(xtr[idx], rng))
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), ytr_t[idx])
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            step += 1
            if bar:
                bar.update(1)
            if step >= total_steps:
                break
        if bar:
            bar.close()
        if args.bn_refresh:  # the running statistics of these weights, from the whole training set
            torch.optim.swa_utils.update_bn([torch.from_numpy(xtr[i:i + 256]) for i in range(0, len(xtr), 256)],
                                            model)
        average_buffers(model)
        test_loss, acc = evaluate(model, xte, yte)
        evals.append([step, test_loss, acc])
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}  train loss {np.mean(losses[-steps:]):.4f}  "
                  f"test loss {test_loss:.4f}  test acc {acc:.4f}", flush=True)
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
        print(f"test accuracy {acc:.4f}  test loss {test_loss:.4f}  |  {step * global_batch / elapsed:.0f} "
              f"samples/s over {hvd.size()} worker(s)  |  {line}  |  ranks differ by {diff:.3g}", flush=True)
    write_json(args.json_out, {"test_accuracy": acc, "test_loss": test_loss, "train_curve": curve,
                               "evals": evals, "codec": codec, "wire_ratio": ratio, "steps": step,
                               "size": hvd.size(), "seed": args.seed, "ranks_max_diff": diff,
                               "seconds": elapsed, "global_batch": global_batch})
    return acc


if __name__ == "__main__":
    main()
