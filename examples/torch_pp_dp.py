"""Pipeline parallelism x data parallelism: two stages with micro-batches, hvdp's DP on one axis.

The model of ``torch_tp_dp.py`` is cut in two: stage 0 holds [input layer, MLP block 1], stage 1
[MLP block 2, head] (with ``--tp 2`` each block is also split over a TP group: the 3D layout).
Each step is a GPipe schedule: stage 0 runs every micro-batch forward and sends each activation
as soon as it is ready; stage 1 runs them as they arrive, then one backward, and sends back each
activation's gradient; stage 0 finishes with one backward over all micro-batches. Then every
stage averages its gradients with its DP group (``mesh.dp``: the ranks holding the same stage)
through hvdp's DistributedOptimizer and steps.

Why Horovod collectives (a broadcast inside the two-rank ``mesh.pp`` process set) and not mpi4py
send/recv: the example then runs under ``horovodrun --gloo`` as well as MPI (a Gloo job has no MPI
communicator to hand to mpi4py), with nothing to install; in a set of two ranks a broadcast from
one of them *is* a send to the other. Its price: each transfer waits for Horovod's background
cycle (about 1 ms over MPI, several over Gloo here), so all transfers of a step are submitted
asynchronously and waited for only when their data is needed. A broadcast needs the shape on
both sides: a micro-batch's activation is always (micro-batch size, HIDDEN).

``--check`` also trains the unsplit model in this process on the same global batches and
compares this rank's stage with it (tolerances: ``torch_tp_dp.compare``).

Run (4 ranks: pp=2 x dp=2; ranks 0,1 are stage 0, ranks 2,3 stage 1)::

    horovodrun -np 4 -H localhost:4 python examples/torch_pp_dp.py --check
    horovodrun -np 8 -H localhost:8 python examples/torch_pp_dp.py --tp 2 --check   # 2x2x2
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

import hvdp.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_tp_dp import HIDDEN, check_text, compare, data, full_model, stages  # noqa: E402


class StageLink:
    """Point-to-point between the two stages of this rank's pipeline (``mesh.pp``, two ranks)."""

    def __init__(self, mesh):
        if mesh.pp_size != 2:
            raise ValueError(f"this example has two pipeline stages; got pp={mesh.pp_size}")
        self.ps, self.ranks, self.me = mesh.pp, mesh.ranks("pp"), mesh.pp_rank

    def send(self, t, name):
        """Submit; keep the returned (tensor, handle) alive until ``wait``."""
        t = t.detach().contiguous()
        return t, hvd.broadcast_async_(t, root_rank=self.ranks[self.me], name=name, process_set=self.ps)

    def recv(self, shape, name):
        buf = torch.empty(shape)
        return buf, hvd.broadcast_async_(buf, root_rank=self.ranks[1 - self.me], name=name, process_set=self.ps)

    @staticmethod
    def wait(pending):
        buf, handle = pending
        hvd.synchronize(handle)
        return buf


def pipeline_step(stage, link, x, y, micro, local_batch):
    """One GPipe step of this rank's stage; returns the local loss (stage 1) or None."""
    xs, ys = x.chunk(micro), y.chunk(micro)
    if link.me == 0:
        outs = [stage(xb) for xb in xs]
        sent = [link.send(h, f"act{i}") for i, h in enumerate(outs)]  # out at once, waited below
        grads = [link.recv(h.shape, f"grad{i}") for i, h in enumerate(outs)]
        torch.autograd.backward(outs, [link.wait(g) for g in grads])
        for s in sent:
            link.wait(s)
        return None
    arriving = [link.recv((len(xb), HIDDEN), f"act{i}") for i, xb in enumerate(xs)]
    acts, loss = [], 0.0
    for pend, yb in zip(arriving, ys):
        a = link.wait(pend).requires_grad_()
        acts.append(a)
        loss = loss + F.cross_entropy(stage(a), yb, reduction="sum") / local_batch
    loss.backward()
    for s in [link.send(a.grad, f"grad{i}") for i, a in enumerate(acts)]:
        link.wait(s)
    return loss.detach()


def train(mesh, steps=8, batch=8, micro=4, lr=0.1, compression="int8", seed=0, check=False, log=print):
    """Train this rank's stage on ``mesh`` (DP by hvdp over ``mesh.dp``); with ``check``, compare
    with one process training the unsplit model; returns a dict of figures."""
    full = full_model(seed)
    stage = stages(full, mesh.tp_rank, mesh.tp_size, mesh.tp)[mesh.pp_rank]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(stage.parameters(), lr=lr),
                                   named_parameters=stage.named_parameters(), compression=compression,
                                   process_set=mesh.dp, policy=hvd.CompressionPolicy(min_elements=1))
    hvd.broadcast_parameters(stage.state_dict(), root_rank=mesh.dp_root, process_set=mesh.dp)
    link = StageLink(mesh)
    gb = batch * mesh.dp_size
    x, y = data(seed, steps * gb)
    if check:
        reference = stages(full)
        ref_opt = torch.optim.SGD([p for s in reference for p in s.parameters()], lr=lr)
    grad_max, last = [], mesh.pp_rank == mesh.pp_size - 1
    for t in range(steps):
        rows = slice(t * gb + mesh.dp_rank * batch, t * gb + (mesh.dp_rank + 1) * batch)
        opt.zero_grad()
        loss = pipeline_step(stage, link, x[rows], y[rows], micro, batch)
        if check and compression != "none":  # int8's bound (see torch_tp_dp.compare)
            grad_max.append(hvd.allreduce(torch.tensor(max(p.grad.abs().max().item() for p in stage.parameters())),
                                          op=hvd.Max, name="gmax", process_set=mesh.dp).item())
        opt.step()
        if last:
            loss = hvd.allreduce(loss, name="loss", process_set=mesh.dp)  # metric over DP
            if mesh.dp_rank == 0 and mesh.tp_rank == 0 and (t % 4 == 0 or t == steps - 1):
                log(f"step {t}: loss {loss.item():.4f} (DP average, stage 1)")
        if check:
            ref_opt.zero_grad()
            rx, ry = x[t * gb:(t + 1) * gb], y[t * gb:(t + 1) * gb]
            F.cross_entropy(reference[1](reference[0](rx)), ry).backward()
            ref_opt.step()
    out = dict(stats=opt.compression_stats(), opt=opt)
    if check:
        out["err"], out["tol"] = compare(stage, reference[mesh.pp_rank], lr, grad_max, compression, mesh,
                                         f"pp_dp.{compression}")
    # the stages finish at different times: one that left first would shut Horovod down (every
    # process set with it) under the other's last collectives
    hvd.barrier()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1, help="TP group size inside each stage (2: the 3D layout)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="per DP replica")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--compression", default="int8")
    ap.add_argument("--check", action="store_true", help="compare with one process training the unsplit model")
    a = ap.parse_args()
    hvd.init(process_sets="dynamic")  # the mesh adds its process sets after init
    mesh = hvd.ProcessMesh(dp=max(1, hvd.size() // (2 * a.tp)), tp=a.tp, pp=2)
    if hvd.rank() == 0:
        print(mesh.layout.table(), flush=True)
    out = train(mesh, a.steps, a.batch, a.micro, compression=a.compression, check=a.check)
    s = out["stats"]["total"]["all"]
    line = (f"rank {hvd.rank()} (stage {mesh.pp_rank}): DP traffic ({a.compression}, inside its DP group "
            f"{mesh.ranks('dp')}) {s['sent'] / 1e3:.1f} kB sent, {s['ratio']:.3f} of float32")
    if a.check:
        line += f"; {check_text(out)}, DP group bit-identical"
    print(line, flush=True)


if __name__ == "__main__":
    main()
