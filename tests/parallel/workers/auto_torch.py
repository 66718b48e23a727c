"""compression="auto" on real workers (hvdp.torch). Each rank runs the named checks and prints
'CHECK <name> OK rank=<r>'; a failed check raises, which fails the horovodrun job."""
import copy
import json
import sys

import torch

import hvdp.torch as hvd
from hvdp.cluster.agreement import DisagreementError
from hvdp.reduce.auto import CostTable, Line

# max |param difference| after a few SGD steps, 2 workers vs 1 worker on the same global batch,
# by the coarsest codec auto chose (float32 summation order alone: 1e-5)
TOL = {"none": 1e-5, "fp16": 2e-3, "bf16": 1e-2, "int8": 2e-2}
POLICY = dict(min_elements=1, fusion_threshold_bytes=256 * 1024)  # several buckets, biases too
STEPS = 4


def model_and_data(seed=0, n=64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 3))
    g = torch.Generator().manual_seed(1234)
    return model, torch.randn(n, 20, generator=g), torch.randint(0, 3, (n,), generator=g)


def my_slice(n):
    per = n // hvd.size()
    return slice(hvd.rank() * per, (hvd.rank() + 1) * per)


def make_opt(model, compression, tag):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=[(f"{tag}.{k}", p) for k, p in model.named_parameters()],
                                    compression=compression, policy=hvd.CompressionPolicy(**POLICY))


def step(model, opt, x, y, sync_only=False):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    if not sync_only:
        with opt.skip_synchronize():
            opt.step()
    return grads


def decision(opt):
    return {b["bucket"]: b["codec"] for b in opt.compression_stats()["auto"]["buckets"]}


def same_on_every_rank(obj, what):
    got = hvd.allgather_object(json.dumps(obj, sort_keys=True))
    assert all(g == got[0] for g in got), f"{what} differs between ranks: {got}"


def check_probe():
    """A real probe (no trial): every rank takes the same decision; each bucket's reduced
    gradient equals the one the fixed codec it got gives; a reset probes again."""
    model, x, y = model_and_data()
    sl = my_slice(len(x))
    opt = make_opt(model, hvd.Compression.auto.configure(trial_steps=0), "auto")
    grads = step(model, opt, x[sl], y[sl], sync_only=True)
    stats = opt.compression_stats()["auto"]
    assert stats["probes"] == 1 and stats["decided"] and len(stats["buckets"]) >= 2, stats
    dec = decision(opt)
    same_on_every_rank(dec, "auto's decision")
    same_on_every_rank(stats["costs"], "auto's cost table")
    if hvd.rank() == 0:
        print(f"  decision {dec}; probe {1e3 * stats['probe_wall_s']:.1f} ms; costs {stats['costs']}", flush=True)
    opt.check_agreement()  # after the probe: the digest covers the setting, not the measurements
    index = {p: i for i, p in enumerate(model.parameters())}
    reduced = [p for p in model.parameters() if p.requires_grad]  # the engine's layout order
    for codec in sorted(set(c.split("(")[0] for c in dec.values())):
        twin = copy.deepcopy(model)
        fixed = make_opt(twin, codec, f"fixed{codec}")
        ref = step(twin, fixed, x[sl], y[sl], sync_only=True)
        for b, idx in enumerate(opt.engine.plan.buckets):
            if dec[f"b{b}"].split("(")[0] == codec:
                for i in idx:
                    j = index[reduced[i]]
                    assert torch.equal(grads[j], ref[j]), f"bucket b{b} ({codec}): auto differs from fixed"
    opt.abort_step()  # what an elastic reset's restore/sync does
    step(model, opt, x[sl], y[sl])
    assert opt.compression_stats()["auto"]["probes"] == 2
    same_on_every_rank(decision(opt), "auto's decision after a reset")


def check_trial():
    """The default: probe, then K steps each of none, the proposal and the runner-up, timed;
    every rank ends with the same decision, one of the plans tried."""
    model, x, y = model_and_data(seed=2)
    sl = my_slice(len(x))
    opt = make_opt(model, "auto", "trial")
    k = hvd.Compression.auto.trial_steps
    for _ in range(3 * k + 4):  # the probe's step, 3 plans of k steps (+1 not counted), the verdict
        step(model, opt, x[sl], y[sl])
    stats = opt.compression_stats()["auto"]
    assert stats["decided"], stats
    same_on_every_rank({"decision": decision(opt), "trial": stats["trial"], "proposal": stats["proposal"]},
                       "auto's trial")
    final = set(decision(opt).items())
    if any(not c.startswith("none") for c in stats["proposal"].values()):
        assert stats["trial"] is not None, stats
        assert stats["trial"]["plans"][stats["trial"]["kept"]] == dict(final), stats
    if hvd.rank() == 0:
        print(f"  proposal {stats['proposal']}, trial {stats['trial']}, kept {decision(opt)}", flush=True)


def forced(candidates, per_byte):
    """A fake table under which the listed codec wins every bucket."""
    links = {k: Line(1e-4, per_byte) for k in ("allreduce.float32", "allreduce.float16", "alltoall", "allgather")}
    return hvd.Compression.auto.configure(candidates=candidates, costs=CostTable(
        hvd.size(), links, {"fp16": Line(0, 1e-12), "int8(block_size=256)": Line(0, 1e-12)}))


def check_forced_equals_fixed():
    """Auto made to choose int8 (then fp16, then none) everywhere trains exactly as the fixed
    codec; buckets given none go tensor by tensor, as compression="none" sends them."""
    for name, auto in (("int8", forced(("int8",), 1e-6)), ("fp16", forced(("fp16",), 1e-6)),
                       ("none", forced(("int8",), 1e-13))):
        model, x, y = model_and_data(seed=3)
        twin = copy.deepcopy(model)
        sl = my_slice(len(x))
        opt, fixed = make_opt(model, auto, f"a{name}"), make_opt(twin, name, f"f{name}")
        for _ in range(STEPS):
            step(model, opt, x[sl], y[sl])
            step(twin, fixed, x[sl], y[sl])
        assert set(decision(opt).values()) == {str(hvd.Compression.__dict__[name])}, decision(opt)
        packed = [opt.engine.packs(b) for b in range(len(opt.engine.plan.buckets))]
        assert packed and (not any(packed) if name == "none" else all(packed)), (name, packed)
        for (k, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"{name}: {k} differs between auto and fixed"


def check_vs_one_worker():
    """2 workers with auto (a real probe, and int8 forced) vs 1 worker on the same global batch."""
    for label, compression in (("probe", "auto"), ("int8", forced(("int8",), 1e-6))):
        model, x, y = model_and_data(seed=5)
        one = copy.deepcopy(model)
        ref = torch.optim.SGD(one.parameters(), lr=0.1)
        opt = make_opt(model, compression, f"one{label}")
        sl = my_slice(len(x))
        for _ in range(STEPS):
            step(model, opt, x[sl], y[sl])
            ref.zero_grad()
            torch.nn.functional.cross_entropy(one(x), y).backward()
            ref.step()
        used = list(decision(opt).values()) + list(opt.compression_stats()["auto"]["proposal"].values())
        coarsest = max((c.split("(")[0] for c in used), key=lambda c: TOL[c])
        err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), one.parameters()))
        assert err <= TOL[coarsest], f"{label}: max |diff| {err:.3g} > {TOL[coarsest]} ({coarsest})"
        if hvd.rank() == 0:
            print(f"  vs 1 worker ({label}, coarsest codec {coarsest}): max |diff| {err:.3g}", flush=True)


def check_disagreement():
    """auto on one rank and int8 on the other: the same clear error on both, no hang."""
    model, _, _ = model_and_data()
    try:
        make_opt(model, "auto" if hvd.rank() == 0 else "int8", "disagree")
    except DisagreementError as e:
        assert "auto(candidates=" in str(e) and "int8" in str(e), str(e)
    else:
        raise AssertionError("auto on one rank and int8 on the other were not refused")


CHECKS = {"probe": check_probe, "trial": check_trial, "disagreement": check_disagreement,
          "forced": check_forced_equals_fixed, "one_worker": check_vs_one_worker}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CHECKS):
        CHECKS[name]()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)
