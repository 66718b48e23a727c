"""The exchange overlapped with the backward pass (issue 36, item 2): hvdp.torch's gradient hooks
start a bucket's next phase as soon as its first collective is done (``Engine.progress``).
Run as a check of torch_checks.py (its job).

For every codec with more than one phase (int8, int4, top-k: alltoall then allgather; powersgd:
P then Q), the same 8 steps on a model of seven buckets are trained with ``HVDP_OVERLAP=0`` (every
next phase starts at ``step()``) and with it on: the parameters must be the same bits, and with
overlap on some bucket must have started its second phase before ``step()`` (counted just after
``loss.backward()``). The test of the unit suite (tests/unit/test_engine.py) checks that a phase
never starts before every rank's first collective is done.
"""
import os

import torch

import hvdp.torch as hvd

WIDTH, LAYERS, STEPS, BATCH = 384, 6, 8, 1024  # backward ~10 ms a layer: time for an alltoall


def _model():
    torch.manual_seed(7)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 4))


def _data():
    g = torch.Generator().manual_seed(99 + hvd.rank())
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def _train(codec, overlap):
    """-> (the parameters after STEPS steps, steps in which a bucket's second phase started
    before step())."""
    os.environ["HVDP_OVERLAP"] = "1" if overlap else "0"
    try:
        model = _model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
            compression=codec,
            policy=hvd.CompressionPolicy(min_elements=1000, fusion_threshold_bytes=4 * WIDTH * WIDTH))
    finally:
        os.environ.pop("HVDP_OVERLAP")
    assert len(opt.engine.plan.buckets) == LAYERS + 1, opt.engine.plan
    x, y = _data()
    ahead = 0
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        ahead += any(getattr(p, "phase", 1) >= 2 for p in opt.engine._pending.values())
        opt.step()
    return [p.detach().clone() for p in model.parameters()], ahead


def check_overlap():
    for codec in ("int8", "int4", "topk", "powersgd"):
        late, late_ahead = _train(codec, overlap=False)
        early, ahead = _train(codec, overlap=True)
        assert late_ahead == 0, f"{codec}: HVDP_OVERLAP=0 yet a phase started before step()"
        for i, (a, b) in enumerate(zip(late, early)):
            assert torch.equal(a, b), f"{codec}: parameter {i} differs with overlap: {(a - b).abs().max():.3g}"
        assert ahead > 0, f"{codec}: in none of {STEPS} steps did a bucket's second phase start before step()"
        print(f"OVERLAP {codec} rank={hvd.rank()} steps_with_a_bucket_ahead={ahead}/{STEPS}", flush=True)
