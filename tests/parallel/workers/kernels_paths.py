"""Training through the fused CPU codec kernels and through the array ops gives the same bits.

Each rank trains the same model for a few steps on its half of a global batch with int8 + error
feedback and with bf16, once with HVDP_KERNELS=auto (the cpu-c kernels) and once with
HVDP_KERNELS=off; the parameters must be bit-identical, and within a stated tolerance of the
same training with compression="none". Prints 'CHECK <name> OK rank=<r>'.
"""
import os

import torch

import hvdp.torch as hvd

STEPS = 6


def train(compression, kernels):
    os.environ["HVDP_KERNELS"] = kernels
    torch.manual_seed(0)
    # odd sizes: buckets whose chunks need padding; 10 ranks' worth of blocks in the big layer
    model = torch.nn.Sequential(torch.nn.Linear(37, 301), torch.nn.Tanh(), torch.nn.Linear(301, 5))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    g = torch.Generator().manual_seed(99)
    x, y = torch.randn(64, 37, generator=g), torch.randint(0, 5, (64,), generator=g)
    per = 64 // hvd.size()
    xs, ys = x[hvd.rank() * per:(hvd.rank() + 1) * per], y[hvd.rank() * per:(hvd.rank() + 1) * per]
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
    stats = opt.compression_stats()
    return [p.detach().clone() for p in model.parameters()], stats


def main():
    hvd.init()
    base, _ = train("none", "off")
    for name, tol in (("int8", 2e-2), ("bf16", 2e-2)):
        fast, s_fast = train(name, "auto")
        slow, s_slow = train(name, "off")
        assert s_fast["paths"] == {name: "cpu-c"}, s_fast["paths"]
        assert s_slow["paths"] == {name: "array ops"}, s_slow["paths"]
        for a, b, c in zip(fast, slow, base):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{name}: kernel path differs"
            err = (a - c).abs().max().item()
            assert err <= tol, f"{name}: max |param - uncompressed param| {err:.3g} > {tol}"
        assert all(v > 0 for k, v in s_fast["phase_ms"].items()), s_fast["phase_ms"]
        print(f"CHECK kernels_{name} OK rank={hvd.rank()} phase_ms kernel "
              f"{ {k: round(v, 2) for k, v in s_fast['phase_ms'].items()} } array ops "
              f"{ {k: round(v, 2) for k, v in s_slow['phase_ms'].items()} }", flush=True)


if __name__ == "__main__":
    main()
