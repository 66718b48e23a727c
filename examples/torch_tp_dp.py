"""Tensor parallelism x data parallelism: Megatron-style parallel MLP blocks, hvdp's DP on one axis.

Each MLP block (``x + fc2(gelu(fc1(x)))``) is split across the ranks of a TP group: ``fc1`` is
column-parallel (each rank holds a slice of its output features) and ``fc2`` row-parallel (the
matching slice of its input features). A block then needs two collectives over ``mesh.tp``, both
inside autograd: the row-parallel output is a partial sum, all-reduced forward (identity
backward); the column-parallel input is used by every shard, so its gradient is all-reduced
backward (identity forward). The layers outside the blocks are replicated on the TP ranks.

DP replicates that arrangement: every TP rank averages its shard's gradients with the ranks
holding the same shard (``mesh.dp``), through hvdp's DistributedOptimizer with int8 by default.

``--check`` also trains the unsplit model in this process on the same global batches and
compares (see ``compare``): the mesh run must equal it (uncompressed) or stay within int8's
bound of it, and the ranks of a DP group must be bit-identical.

Run (4 ranks: dp=2 x tp=2; TP innermost, so ranks 0,1 form a TP group)::

    horovodrun -np 4 -H localhost:4 python examples/torch_tp_dp.py --tp 2 --check
"""
import argparse
import copy

import torch
import torch.nn.functional as F

import hvdp.torch as hvd

D_IN, HIDDEN, FFN, CLASSES = 16, 32, 64, 4


# --- the two TP collectives, as autograd functions --------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Identity forward; gradient all-reduced (summed) over the TP group backward."""

    @staticmethod
    def forward(ctx, x, process_set, name):
        ctx.process_set, ctx.name = process_set, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return hvd.allreduce(g.contiguous(), op=hvd.Sum, name=ctx.name, process_set=ctx.process_set), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Partial sums all-reduced (summed) over the TP group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, process_set, name):
        return hvd.allreduce(x.contiguous(), op=hvd.Sum, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class ParallelMLP(torch.nn.Module):
    """``x + fc2(gelu(fc1(x)))`` with fc1 column-parallel and fc2 row-parallel over ``tp`` ranks.

    Built from the unsplit block's weights, so a one-process model and the split one start equal.
    """

    def __init__(self, fc1: torch.nn.Linear, fc2: torch.nn.Linear, tp_rank=0, tp_size=1,
                 process_set=None, name="mlp"):
        super().__init__()
        k = fc1.out_features // tp_size
        part = slice(tp_rank * k, (tp_rank + 1) * k)
        self.fc1_weight = torch.nn.Parameter(fc1.weight.detach()[part].clone())
        self.fc1_bias = torch.nn.Parameter(fc1.bias.detach()[part].clone())
        self.fc2_weight = torch.nn.Parameter(fc2.weight.detach()[:, part].clone())
        self.fc2_bias = torch.nn.Parameter(fc2.bias.detach().clone())  # added once, after the sum
        self.tp_size, self.process_set, self.name = tp_size, process_set, name

    def forward(self, x):
        split = self.tp_size > 1
        h = _CopyToTP.apply(x, self.process_set, f"{self.name}.dx") if split else x
        h = F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias))
        y = F.linear(h, self.fc2_weight)
        if split:
            y = _ReduceFromTP.apply(y, self.process_set, f"{self.name}.y")
        return x + y + self.fc2_bias


def full_model(seed=0) -> torch.nn.ModuleDict:
    """The unsplit model's layers: input, two MLP blocks (fc1/fc2 each), head."""
    torch.manual_seed(seed)
    L = torch.nn.Linear
    return torch.nn.ModuleDict(dict(inp=L(D_IN, HIDDEN), b1_fc1=L(HIDDEN, FFN), b1_fc2=L(FFN, HIDDEN),
                                    b2_fc1=L(HIDDEN, FFN), b2_fc2=L(FFN, HIDDEN), head=L(HIDDEN, CLASSES)))


def stages(full, tp_rank=0, tp_size=1, process_set=None):
    """The model as two halves (the pipeline example puts them on two stages):
    [inp, tanh, block 1] and [block 2, head], the blocks split over ``tp_size`` ranks."""
    def block(i):
        return ParallelMLP(full[f"b{i}_fc1"], full[f"b{i}_fc2"], tp_rank, tp_size, process_set, f"b{i}")
    first = torch.nn.Sequential(copy.deepcopy(full["inp"]), torch.nn.Tanh(), block(1))
    return first, torch.nn.Sequential(block(2), copy.deepcopy(full["head"]))


def data(seed, n):
    """A learnable synthetic task: labels from a fixed random teacher."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, D_IN, generator=g)
    y = (x @ torch.randn(D_IN, CLASSES, generator=g)).argmax(1)
    return x, y


def shard_of(reference, model, tp_rank):
    """The one-process model's tensors cut as this rank's shards (a split dimension is the one
    whose size differs)."""
    for r, p in zip(reference.parameters(), model.parameters()):
        d = [i for i, (a, b) in enumerate(zip(r.shape, p.shape)) if a != b]
        yield r if not d else r.narrow(d[0], tp_rank * p.shape[d[0]], p.shape[d[0]])


def compare(model, reference, lr, grad_max, compression, mesh, label):
    """Assert the mesh-trained ``model`` against one process's unsplit ``reference`` and that the
    DP group's ranks hold the same bits; return (max |difference|, tolerance).

    Tolerances. Uncompressed: 1e-5. Both runs do the same float32 arithmetic except the order of
    a few sums (TP's partial sums over 2 shards, DP's mean of 2 means instead of one mean); each
    reordering changes a result by a few float32 ulps (~1e-7 relative at weights ~0.1-1) and a few
    SGD steps add these up, so 1e-5 leaves ample room while any real mistake (a lost shard, a
    wrong group, a missing average) is >= 1e-3. int8: each step's two-phase reduction is within
    max|g|/254 (the workers' rounding) + max|avg|/254 (the reduced chunk's) of the exact average,
    and error feedback re-sends what was lost one step later: at most lr * 2 * sum_t max|g_t| / 127
    per weight over the run (a bound to first order: the trajectories differ, slightly, too).
    fp16/bf16 likewise with their relative rounding (2^-11, 2^-8) in place of 1/254. topk keeps a
    few elements per step and has no such bound: only the DP groups' identity is checked.
    """
    step = {"none": 0.0, "fp16": 2 ** -11, "bf16": 2 ** -8, "int8": 1 / 254}.get(compression)
    tol = None if step is None else lr * 4 * step * sum(grad_max) + 1e-5
    err = max((p - q).abs().max().item()
              for p, q in zip(model.parameters(), shard_of(reference, model, mesh.tp_rank)))
    assert tol is None or err <= tol, f"{label}: max |mesh - one process| = {err:.3g} > tolerance {tol:.3g}"
    for k, p in model.named_parameters():
        everyone = hvd.allgather(p.detach().reshape(1, -1), name=f"check.{label}.{k}", process_set=mesh.dp)
        assert all(torch.equal(everyone[0], e) for e in everyone), f"{k}: ranks of a DP group differ"
    return err, tol


def check_text(out) -> str:
    tol = "none" if out["tol"] is None else f"{out['tol']:.3g}"
    return f"max |mesh - one process| = {out['err']:.3g} (tolerance {tol})"


def train(mesh, steps=8, batch=8, lr=0.1, compression="int8", seed=0, check=False, log=print):
    """Train on ``mesh`` (its DP axis reduced by hvdp with ``compression``); with ``check``,
    compare with one process; returns a dict of figures."""
    full = full_model(seed)
    model = torch.nn.Sequential(*stages(full, mesh.tp_rank, mesh.tp_size, mesh.tp))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   process_set=mesh.dp,
                                   policy=hvd.CompressionPolicy(min_elements=1))  # tiny model: all
    hvd.broadcast_parameters(model.state_dict(), root_rank=mesh.dp_root, process_set=mesh.dp)
    gb = batch * mesh.dp_size  # global batch: one slice per DP replica, the same on its TP ranks
    x, y = data(seed, steps * gb)
    reference = torch.nn.Sequential(*stages(full)) if check else None
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr) if check else None
    grad_max = []
    for t in range(steps):
        rows = slice(t * gb + mesh.dp_rank * batch, t * gb + (mesh.dp_rank + 1) * batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        if check and compression != "none":  # int8's bound scales with the largest local gradient
            # (read while the codec's reduction runs: it encoded its copies already)
            grad_max.append(hvd.allreduce(torch.tensor(max(p.grad.abs().max().item() for p in model.parameters())),
                                          op=hvd.Max, name="gmax", process_set=mesh.dp).item())
        opt.step()
        avg = hvd.allreduce(loss.detach(), name="loss", process_set=mesh.dp)  # metric over DP
        if check:
            ref_opt.zero_grad()
            F.cross_entropy(reference(x[t * gb:(t + 1) * gb]), y[t * gb:(t + 1) * gb]).backward()
            ref_opt.step()
        if mesh.rank == 0 and (t % 4 == 0 or t == steps - 1):
            log(f"step {t}: loss {avg.item():.4f} (DP average)")
    out = dict(loss=avg.item(), stats=opt.compression_stats(), opt=opt)
    if check:
        out["err"], out["tol"] = compare(model, reference, lr, grad_max, compression, mesh, f"tp_dp.{compression}")
    # one DP group may finish its last collectives before the other: a rank that exits then shuts
    # Horovod down (every process set with it) under the other group
    hvd.barrier()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="TP group size (dp = world size / tp)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="per DP replica")
    ap.add_argument("--compression", default="int8")
    ap.add_argument("--check", action="store_true", help="compare with one process training the unsplit model")
    a = ap.parse_args()
    hvd.init(process_sets="dynamic")  # the mesh adds its process sets after init
    mesh = hvd.ProcessMesh(dp=max(1, hvd.size() // a.tp), tp=a.tp)  # a bad fit: an error naming sizes
    if hvd.rank() == 0:
        print(mesh.layout.table(), flush=True)
    out = train(mesh, a.steps, a.batch, compression=a.compression, check=a.check)
    if hvd.rank() == 0:
        s = out["stats"]["total"]["all"]
        print(f"DP traffic ({a.compression}, inside each DP group of {mesh.dp_size}): {s['sent'] / 1e3:.1f} kB "
              f"sent per rank, {s['ratio']:.3f} of float32", flush=True)
        if a.check:
            print(f"check: {check_text(out)}; DP groups bit-identical", flush=True)


if __name__ == "__main__":
    main()
