"""What a demanding torch user does (issue 18), under real workers: two optimizers in flight,
bfloat16 models, non-contiguous parameters, requires_grad changed after the optimizer was made;
GradScaler's skipped steps (torch_amp_checks.py). (Horovod's API against plain Horovod:
torch_compat_checks.py, its own job.)
Each rank runs the named checks and prints 'CHECK <name> OK rank=<r>'; a failure raises."""
import copy
import sys

import torch

import hvdp.torch as hvd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from reduction_bounds import check_reduced  # noqa: E402
import cycle_check  # noqa: E402  (before hvd.init(): it reads the launcher's variable)

CODECS = ["none", "fp16", "bf16", "int8", "topk"]
BF16_REL = 2.0 ** -8  # one rounding to bfloat16 (8 significant bits): at most half an ulp <= 2^-8 |x|
ce = torch.nn.functional.cross_entropy


def mlp(seed):
    torch.manual_seed(seed)
    # 1280 weights: a compressed bucket under the default policy; biases and 192: plain allreduce
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def data(n=32, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 3, (n,), generator=g)


def my_slice(n):
    per = n // hvd.size()
    return slice(hvd.rank() * per, (hvd.rank() + 1) * per)


def gathered(t, name):
    """Every rank's copy of ``t`` (float64), stacked."""
    return hvd.allgather(t.detach().double().reshape(1, -1).contiguous(), name=name)


def ranks_identical(tensors, tag):
    for i, t in enumerate(tensors):
        allt = gathered(t, f"{tag}.ident.{i}")
        assert torch.equal(allt[0], allt[-1]), f"{tag}: tensor {i} differs between ranks"


def assert_reduced(codec, opt, locals_, got, tag):
    """``got`` (reduced gradients) against the exact average of every rank's ``locals_``."""
    everyone = [gathered(g, f"{tag}.loc.{i}") for i, g in enumerate(locals_)]
    if codec == "none":
        for i, (e, g) in enumerate(zip(everyone, got)):
            err = (g.double().reshape(-1) - e.mean(0)).abs().max().item()
            assert err <= 1e-6, f"{tag}: tensor {i} off the exact average by {err:.3g}"
        return
    per_rank = [[e[r].float().numpy() for e in everyone] for r in range(hvd.size())]
    check_reduced(codec, per_rank, [g.detach().float().reshape(-1).numpy() for g in got],
                  opt.engine.plan.buckets)


# --- row 3: two optimizers in flight ----------------------------------------------------------
def check_two_optimizers():
    """GAN-style: two models, two hvdp optimizers, one backward, both stepped. The models are the
    same architecture, so their parameter names collide unless the optimizers scope them."""
    x, y = data()
    sl = my_slice(len(x))
    for codec in CODECS:
        for named in (True, False):
            models = [mlp(seed=5), mlp(seed=6)]
            opts = [hvd.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                named_parameters=m.named_parameters() if named else None, compression=codec,
                policy=hvd.CompressionPolicy(min_elements=1)) for m in models]
            tag = f"two.{codec}.{named}"
            for step in range(3):
                twins = [copy.deepcopy(m) for m in models]
                (ce(twins[0](x[sl]), y[sl]) + ce(twins[1](2 * x[sl]), y[sl])).backward()
                for o in opts:
                    o.zero_grad()
                (ce(models[0](x[sl]), y[sl]) + ce(models[1](2 * x[sl]), y[sl])).backward()
                for o in opts:
                    o.synchronize()
                if step == 0:  # later steps carry error-feedback residuals: no closed-form bound
                    for k, (m, t, o) in enumerate(zip(models, twins, opts)):
                        assert_reduced(codec, o, [q.grad for q in t.parameters()],
                                       [p.grad for p in m.parameters()], f"{tag}.{k}")
                for o in opts:
                    with o.skip_synchronize():
                        o.step()
            for k, m in enumerate(models):
                ranks_identical(list(m.parameters()), f"{tag}.{k}")


# --- row 2: bfloat16 models -------------------------------------------------------------------
def check_bf16():
    """A bf16 model reduces like a float32 copy of it fed the same gradients, then rounded to
    bf16: on the plain, grouped and two-phase paths, every codec."""
    x, y = data()
    sl = my_slice(len(x))
    for codec in CODECS:
        for groups in (0, 2):
            tag = f"bf16.{codec}.{groups}"
            m16 = mlp(seed=7).to(torch.bfloat16)
            m32, twin = copy.deepcopy(m16).float(), copy.deepcopy(m16)
            opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=m.named_parameters(), compression=codec,
                                             groups=groups or None)
                    for m in (m16, m32)]
            assert opts[0].engine.plan.buckets or codec in ("none", "fp16"), "no two-phase bucket tested"
            ce(twin(x[sl].bfloat16()), y[sl]).backward()
            ce(m16(x[sl].bfloat16()), y[sl]).backward()  # through the hooks, as in training
            for p, q in zip(m32.parameters(), twin.parameters()):
                p.grad = q.grad.float()
            for o in opts:
                o.synchronize()
            for (k, p16), p32 in zip(m16.named_parameters(), m32.parameters()):
                assert p16.grad.dtype == torch.bfloat16, (tag, k)
                err = (p16.grad.float() - p32.grad).abs()
                assert bool((err <= BF16_REL * p32.grad.abs()).all()), \
                    f"{tag} {k}: max |bf16 - float32| {err.max().item():.3g}"
            for o in opts:
                with o.skip_synchronize():
                    o.step()
            for (k, p16), p32 in zip(m16.named_parameters(), m32.parameters()):
                # each the same SGD step; bf16 rounds the gradient (above) and the new value
                bound = BF16_REL * (p32.abs() + 0.1 * p32.grad.abs()) * 1.01
                err = (p16.float() - p32).abs()
                assert bool((err <= bound).all()), f"{tag} {k}: step off by {err.max().item():.3g}"
            ranks_identical(list(m16.parameters()), tag)
    _check_bf16_sparse()
    _check_bf16_broadcast()


def _check_bf16_sparse():
    """Horovod's sparse allreduce (a bf16 embedding with sparse gradients) travels as float32."""
    g = torch.Generator().manual_seed(hvd.rank())
    idx = torch.randint(0, 50, (8, 5), generator=g)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 40, sparse=True).to(torch.bfloat16)
    twin = copy.deepcopy(emb)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    twin(idx).float().sum().backward()
    emb(idx).float().sum().backward()
    opt.synchronize()
    exact = gathered(twin.weight.grad.to_dense(), "bf16.sparse").mean(0)
    got = emb.weight.grad.to_dense().double().reshape(-1)
    # values rounded to bf16 one by one, then duplicates summed in bf16: a few roundings
    err = (got - exact).abs().max().item()
    assert emb.weight.grad.dtype == torch.bfloat16 and err <= 4 * BF16_REL * exact.abs().max().item(), err


def _check_bf16_broadcast():
    x, y = data()
    model = mlp(seed=100 + hvd.rank()).to(torch.bfloat16)  # different weights on every rank
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ce(model(x[my_slice(len(x))].bfloat16()), y[my_slice(len(x))]).backward()
    sgd.step()  # bf16 momentum buffers, different on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    ranks_identical(list(model.parameters()), "bf16.bcast.params")
    ranks_identical([sgd.state[p]["momentum_buffer"] for p in model.parameters()], "bf16.bcast.sgd")
    # Adam with state on the root only (a checkpoint loaded there): the others create theirs (bf16)
    # without moving their parameters, then get the root's
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    if hvd.rank() == 0:
        ce(model(x[:4].bfloat16()), y[:4]).backward()
        adam.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "parameters moved"
    st = [adam.state[p]["exp_avg"] for p in model.parameters()]
    assert all(s.dtype == torch.bfloat16 for s in st)
    ranks_identical(st, "bf16.bcast.adam")
    assert {adam.state[p]["step"].item() for p in model.parameters()} == {1.0}


def check_fresh_state_broadcast():
    """A fresh optimizer stays fresh: broadcast_optimizer_state moves no parameter and counts no
    step, so two workers train exactly as one process on the same global batch (AdamW with weight
    decay and SGD with weight decay, hvdp uncompressed, three steps); the root's settings win."""
    x, y = data()
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)):
        one = mlp(seed=7)  # the one-process run, on every rank
        solo = make(one.parameters())
        model = mlp(seed=7)
        opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters())
        opt.param_groups[0]["lr"] *= 1 + hvd.rank()  # a per-rank setting: the root's must win
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        before = [p.detach().clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert not opt.state, "a fresh optimizer got state"
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "parameters moved"
        assert opt.param_groups[0]["lr"] == solo.param_groups[0]["lr"]
        sl = my_slice(len(x))
        for _ in range(3):
            solo.zero_grad()
            ce(one(x), y).backward()
            solo.step()
            opt.zero_grad()
            ce(model(x[sl]), y[sl]).backward()
            opt.step()
        for a, b in zip(one.parameters(), model.parameters()):
            err = (a - b).abs().max().item()
            # the mean of two half-batch means against the full-batch mean: float32 rounding only
            assert err <= 1e-5, f"{type(solo).__name__}: 2 workers off 1 process by {err:.3g}"
        ranks_identical(list(model.parameters()), f"fresh.{type(solo).__name__}")


def check_bf16_join():
    """Uneven inputs on a bf16 model: rank 0 has one batch more, then hvd.join() brings every
    rank to rank 0's parameters and state (broadcast of bf16 tensors)."""
    x, y = data()
    sl = my_slice(len(x))
    for codec in ("none", "int8"):
        model = mlp(seed=11).to(torch.bfloat16)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=codec,
                                       uneven_inputs=True)
        for _ in range(2 if hvd.rank() == 0 else 1):
            opt.zero_grad()
            ce(model(x[sl].bfloat16()), y[sl]).backward()
            opt.step()
        assert hvd.join() == 0
        ranks_identical(list(model.parameters()), f"bf16.join.{codec}")
        ranks_identical([opt.state[p]["momentum_buffer"] for p in model.parameters()],
                        f"bf16.join.state.{codec}")


# --- row 6: non-contiguous gradients ----------------------------------------------------------
class Strided(torch.nn.Module):
    """channels_last convolutions and transposed matrices: every weight's gradient is
    non-contiguous (torch gives a gradient its parameter's strides). conv1 and w are over 1024
    elements (a compressed bucket), conv0 and v under (plain allreduce)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.conv0 = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.conv1 = torch.nn.Conv2d(4, 40, 3).to(memory_format=torch.channels_last)
        self.w = torch.nn.Parameter(0.2 * torch.randn(30, 40).t())
        self.v = torch.nn.Parameter(0.2 * torch.randn(3, 30).t())

    def forward(self, x):
        h = torch.tanh(self.conv1(torch.tanh(self.conv0(x)))).mean((-1, -2))
        return torch.tanh(h @ self.w) @ self.v


def strided_data(n=16):
    g = torch.Generator().manual_seed(99)
    x = torch.randn(n, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 3, (n,), generator=g)


def check_noncontiguous():
    x, y = strided_data()
    sl = my_slice(len(x))
    for codec in CODECS:
        for groups in (0, 2):
            tag = f"nc.{codec}.{groups}"
            model, twin = Strided(seed=3), Strided(seed=3)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=codec, groups=groups or None)
            ce(twin(x[sl]), y[sl]).backward()
            weights = [twin.conv0.weight, twin.conv1.weight, twin.w, twin.v]
            assert not any(q.grad.is_contiguous() for q in weights), "the gradients are contiguous"
            ce(model(x[sl]), y[sl]).backward()
            opt.synchronize()
            assert_reduced(codec, opt, [q.grad for q in twin.parameters()],
                           [p.grad for p in model.parameters()], tag)
            with opt.skip_synchronize():
                opt.step()
            ranks_identical(list(model.parameters()), tag)
    model = Strided(seed=200 + hvd.rank())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ce(model(x[sl]), y[sl]).backward()
    sgd.step()  # momentum buffers with the parameters' strides, different on every rank
    assert not sgd.state[model.w]["momentum_buffer"].is_contiguous()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    ranks_identical(list(model.parameters()), "nc.bcast.params")
    ranks_identical([sgd.state[p]["momentum_buffer"] for p in model.parameters()], "nc.bcast.sgd")
    assert not model.w.is_contiguous()  # written back in place, layout kept


# --- row 10: requires_grad changed after the optimizer was made --------------------------------
class WithSpare(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.net = mlp(seed)
        self.spare = torch.nn.Parameter(torch.ones(40, 30))  # requires grad, never used

    def forward(self, x):
        return self.net(x)


def check_requires_grad():
    """Against plain torch on one worker with the whole batch: unfreeze a layer, freeze one,
    step() without backward, a parameter never used. Weight decay and momentum make a parameter
    move whenever the optimizer is handed a zero gradient instead of None."""
    x, y = data(n=16 * hvd.size())
    sl = my_slice(len(x))
    for codec, tol in (("none", 1e-5), ("int8", 2e-3)):  # int8: a few steps of 8-bit rounding
        model, ref = WithSpare(seed=9), WithSpare(seed=9)
        for m in (model, ref):
            m.net[0].weight.requires_grad_(False)  # frozen when the optimizer is made
        kw = dict(lr=0.1, momentum=0.9, weight_decay=0.05)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), **kw),
                                       named_parameters=model.named_parameters(), compression=codec,
                                       policy=hvd.CompressionPolicy(min_elements=1))
        ref_opt = torch.optim.SGD(ref.parameters(), **kw)
        spare0 = model.spare.detach().clone()

        def step(backward=True):
            opt.zero_grad()
            ref_opt.zero_grad()
            if backward:
                ce(model(x[sl]), y[sl]).backward()
                ce(ref(x), y).backward()
            opt.step()
            ref_opt.step()

        def same_as_ref(what):
            for (k, p), q in zip(model.named_parameters(), ref.parameters()):
                err = (p - q).abs().max().item()
                assert err <= tol, f"{codec} {what}: {k} off plain torch by {err:.3g} > {tol}"
            ranks_identical(list(model.parameters()), f"rg.{codec}.{what}")

        step()
        same_as_ref("frozen at creation")
        for m in (model, ref):
            m.net[0].weight.requires_grad_(True)   # unfrozen after the optimizer was made
        for _ in range(2):
            step()
        assert model.net[0].weight.grad is not None
        same_as_ref("unfrozen")
        for m in (model, ref):
            m.net[2].requires_grad_(False)         # frozen mid-training (momentum buffers exist)
        frozen = [p.detach().clone() for p in model.net[2].parameters()]
        for _ in range(2):
            step()
        assert all(torch.equal(p, f) for p, f in zip(model.net[2].parameters(), frozen)), \
            f"{codec}: a frozen layer moved"
        same_as_ref("frozen")
        before = [p.detach().clone() for p in model.parameters()]
        step(backward=False)                       # no gradient anywhere: nothing moves
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), \
            f"{codec}: step() without backward moved a parameter"
        assert torch.equal(model.spare, spare0) and model.spare.grad is None, f"{codec}: unused moved"
        same_as_ref("no backward")
    _check_used_on_one_rank(x[sl], y[sl])


def _check_used_on_one_rank(x, y):
    """A gradient on one rank only is still Horovod's average (the others add zeros), and every
    rank keeps it: the decision for None must be the same everywhere."""
    torch.manual_seed(4)
    a, b = torch.nn.Linear(20, 3), torch.nn.Linear(20, 3)
    params = list(a.parameters()) + list(b.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
    twin = copy.deepcopy(b)
    if hvd.rank() == 0:
        ce(a(x) + b(x), y).backward()
        ce(a(x).detach() + twin(x), y).backward()
    else:
        ce(a(x), y).backward()
    local = twin.weight.grad if twin.weight.grad is not None else torch.zeros_like(twin.weight)
    opt.synchronize()
    assert b.weight.grad is not None, "a gradient another rank had was dropped"
    err = (b.weight.grad.double().reshape(-1) - gathered(local, "one.rank").mean(0)).abs().max().item()
    assert err <= 1e-6, f"used on one rank: off the average by {err:.3g}"


CHECKS = {
    "cycle_time": lambda: cycle_check.check(torch.cuda.is_available()),
    "two_optimizers": check_two_optimizers,
    "bf16": check_bf16,
    "bf16_join": check_bf16_join,
    "noncontiguous": check_noncontiguous,
    "requires_grad": check_requires_grad,
    "fresh_state_broadcast": check_fresh_state_broadcast,
    "amp_skipped_steps": lambda: __import__("torch_amp_checks").check_skipped_steps(),
}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
