"""hvdp powersgd against PyTorch DDP's ``powerSGD_hook`` at two ranks on the same gradients
(issue 36, deliverable 4), run by torch_checks.py as the check ``powersgd_ddp``.

Each rank draws its own gradients per step (seeded by step and rank) and both reduce them:
hvdp's DistributedOptimizer with ``powersgd.configure(rank=r, start_powerSGD_iter=2)``, and the
hook with ``PowerSGDState(start_powerSGD_iter=2)`` called on a stand-in for DDP's GradBucket
(its flat buffer, its tensors in hvdp's bucket order) over a torch.distributed Gloo group of
the same two processes. hvdp is given the hook's initial Qs (drawn from torch's generator as
the hook draws them); everything else is each one's own: warm-up, error feedback (the hook also
keeps a residual for its uncompressed tensors, which averages to zero over the ranks: no
effect on the result), Gram-Schmidt / QR, the allreduces and the averaging.

Tolerance: 1e-5 of the step's largest |value| (float32, other summation orders; seen at two
ranks: 7.9e-7 at rank 1, 2.8e-7 at rank 2, 1.1e-6 at rank 4). The warm-up steps: the exact
average (1e-6), with no powersgd bytes.
"""
import time

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook_mod

import hvdp.torch as hvd
from ddp_bucket import FakeBucket
from outer_torch import torch_group

# two of the same shape (the hook draws Qs grouped by shape), a vector, a conv-like 4-D weight,
# a matrix too small to compress at rank 2, a wide one
SHAPES = [(24, 16), (16,), (8, 3, 3, 3), (24, 16), (4, 4), (10, 30)]
TOL, WARM_TOL, START, STEPS = 1e-5, 1e-6, 2, 5


def hook_init(codec, shapes, seed):
    """The hook's initial Qs in hvdp's order: torch seeded from RandomState(seed), Qs drawn in the
    hook's order (its tensors grouped by shape, in order of first appearance)."""
    rng = np.random.RandomState(seed)

    def init(name, dims):
        mats = [(i, codec.matrix(s)) for i, s in enumerate(shapes) if codec.matrix(s)]
        by_shape = {}
        for i, (n, m, r) in mats:
            by_shape.setdefault((n, m), []).append((i, m, r))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng.randint(1_000_000_000))
            drawn = {i: torch.randn(1, m, r, dtype=torch.float32)[0].numpy()
                     for group in by_shape.values() for i, m, r in group}
        out = [drawn[i] for i, _ in mats]
        assert [q.shape for q in out] == [tuple(d) for d in dims], ([q.shape for q in out], dims)
        return out
    return init


def compare(rank, dist):
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])
    codec = hvd.Compression.powersgd.configure(rank=rank, start_powerSGD_iter=START)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=params.named_parameters(),
                                   compression=codec, policy=hvd.CompressionPolicy(min_elements=1))
    (idx,) = opt.engine.plan.buckets  # one bucket, every tensor in it
    shapes = [SHAPES[i] for i in idx]
    opt.engine.reducer.init_q = hook_init(codec, shapes, 0)
    state = hook_mod.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=START,
                                   min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
    worst = 0.0
    for t in range(STEPS):
        g = torch.Generator().manual_seed(1000 * t + hvd.rank())
        grads = [torch.randn(s, generator=g) * (1 + 0.5 * t) for s in SHAPES]
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        want = hook_mod.powerSGD_hook(state, FakeBucket(flat.clone(), shapes)).wait()
        want = want[0] if isinstance(want, (list, tuple)) else want
        opt.zero_grad()
        sum((p * gr).sum() for p, gr in zip(params, grads)).backward()  # p.grad = gr
        opt.synchronize()
        got = torch.cat([params[i].grad.reshape(-1) for i in idx])
        with opt.skip_synchronize():
            opt.step()
        top = float(want.abs().max())
        err = float((got - want).abs().max()) / top
        used = set(opt.compression_stats()["last_step"]) - {"all"}
        if t < START:  # both plain allreduce: the exact average, nothing compressed
            exact = flat.clone()
            dist.all_reduce(exact)
            exact /= hvd.size()
            assert used == {"none"} and float((got - exact).abs().max()) <= WARM_TOL * top, (rank, t, used)
        else:
            assert "powersgd" in used, (rank, t, used)
        assert err <= TOL, f"rank {rank} step {t}: |hvdp - hook| = {err:.3g} of the largest value > {TOL}"
        worst = max(worst, err)
    return worst


def check_powersgd_matches_ddp_hook():
    t0 = time.perf_counter()
    with torch_group() as dist:
        worst = {r: compare(r, dist) for r in (1, 4)}  # Gram-Schmidt (r <= 2) and QR
    if hvd.rank() == 0:
        print("  powersgd vs DDP's powerSGD_hook, 2 ranks, same gradients, start_powerSGD_iter=2: max |diff| / "
              "largest value " + ", ".join(f"rank {r}: {w:.2g}" for r, w in worst.items())
              + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
