"""hvd.ProcessMesh and DP over a process set, at -np 4. First argument: "dynamic" (process sets
added after init) or "static" (passed to hvd.init); then the checks to run, in order. Each rank
prints 'CHECK <name> OK rank=<r>'; a failed check raises, which fails the horovodrun job."""
import copy
import os
import sys

import numpy as np
import torch

import hvdp.torch as hvd
from hvdp.cluster.mesh import MeshError
from hvdp.reduce.stats import ring_allreduce_bytes, two_phase_bytes
from hvdp.reduce.twophase import chunk_length

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))
from reduction_bounds import check_reduced, reference_two_phase  # noqa: E402
import torch_pp_dp  # noqa: E402
import torch_tp_dp  # noqa: E402

MODE = sys.argv[1]
TP_DP = dict(dp=2, tp=2)   # ranks 0,1 | 2,3 share a TP group; DP groups [0, 2], [1, 3]
PP_DP = dict(dp=2, pp=2)   # stages: ranks 0,1 | 2,3; DP groups [0, 1], [2, 3]


def gather(t, name, process_set):
    return hvd.allgather(t.detach().reshape(1, -1), name=name, process_set=process_set)


def check_layout():
    for kw in (TP_DP, PP_DP):
        mesh = hvd.ProcessMesh(**kw)
        assert mesh.coords == mesh.layout.coords(hvd.rank()) and mesh.rank == hvd.rank()
        for axis in ("dp", "tp", "pp"):
            ps = mesh.process_set(axis)
            got = gather(torch.tensor([hvd.rank()]), f"layout.{axis}", ps).reshape(-1).tolist()
            assert got == mesh.ranks(axis), (axis, got, mesh.ranks(axis))  # the set is the group
            assert ps.size() == len(got) and ps.rank() == mesh.ranks(axis).index(hvd.rank())
        assert (mesh.dp_size, mesh.dp_rank) == (2, mesh.ranks("dp").index(hvd.rank()))
    try:
        hvd.ProcessMesh(dp=3, tp=2)
        raise AssertionError("a 6-rank mesh in a 4-rank job was accepted")
    except MeshError as e:
        assert "spans 6 ranks but the job has 4" in str(e), e
    # (a refused static mesh is a unit test: every 4-rank layout's sets are registered here)
    if MODE == "dynamic":        # a DP group spanning the world is Horovod's global set
        assert hvd.ProcessMesh(dp=4).dp.process_set_id == 0


def local_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def bucket_flats(buckets, got, per_rank):
    """Per bucket: this rank's reduced values and every rank's local gradients, flat."""
    for idx in buckets:
        yield (np.concatenate([got[i] for i in idx]),
               [np.concatenate([np.asarray(pr[i], np.float32) for i in idx]) for pr in per_rank])


def check_dp_codecs():
    """Every codec reduces inside mesh.dp only: equal to the DP group's average within the codec's
    bound (two-phase ones: the numpy reference replayed on the group's gradients), far from the
    world's average, with residuals and wire counts sized by the group (2 ranks), not the world."""
    mesh = hvd.ProcessMesh(**TP_DP)
    torch.manual_seed(5)
    x = torch.randn(16, 12) * (1 + 3 * mesh.tp_rank) + hvd.rank()  # TP groups' data far apart
    y = torch.arange(16) % 3
    for name in ["none", "fp16", "bf16", "int8", "topk"]:
        model = local_model(seed=1)
        twin = copy.deepcopy(model)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=name,
                                       process_set=mesh.dp, policy=hvd.CompressionPolicy(min_elements=1))
        torch.nn.functional.cross_entropy(twin(x), y).backward()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        group = [gather(q.grad, f"cd.{name}.{i}", mesh.dp) for i, q in enumerate(twin.parameters())]
        world = [gather(q.grad, f"cw.{name}.{i}", hvd.global_process_set) for i, q in enumerate(twin.parameters())]
        per_rank = [[g[r].numpy() for g in group] for r in range(mesh.dp_size)]
        got = [p.grad.reshape(-1).numpy() for p in model.parameters()]
        if name == "none":
            err = max(float(np.abs(g - np.mean([pr[i] for pr in per_rank], 0)).max()) for i, g in enumerate(got))
            assert err <= 1e-6, err
        else:
            err = check_reduced(opt.engine.settings.codec, per_rank, got, opt.engine.plan.buckets)
        # what the same codec would give over the whole world, against what it gives over the group
        if opt.engine.settings.codec.summable:
            near, far = err, max(float((torch.from_numpy(g) - w.double().mean(0).float()).abs().max())
                                 for g, w in zip(got, world))
        else:
            near, far = (max(float(np.abs(mine - reference_two_phase(opt.engine.settings.codec, flats)).max())
                             for mine, flats in bucket_flats(opt.engine.plan.buckets, got, ranks))
                         for ranks in (per_rank, [[w[r].numpy() for w in world] for r in range(hvd.size())]))
        assert far > 10 * max(near, 1e-6), f"{name}: the result is as close to the world's reduction ({far:.3g})"
        stats = opt.compression_stats()["last_step"]
        sizes = [sum(p.numel() for i, p in enumerate(model.parameters()) if i in b) for b in opt.engine.plan.buckets]
        if opt.engine.reducer is None:  # Horovod's allreduce inside the set: a ring of 2
            wire = {"none": 4, "fp16": 2}[name]
            want = sum(ring_allreduce_bytes(wire * p.numel(), mesh.dp_size) for p in model.parameters())
        else:
            codec = opt.engine.settings.codec
            chunks = [chunk_length(n, mesh.dp_size, codec.align) for n in sizes]
            want = sum(two_phase_bytes(codec.payload_nbytes(c), mesh.dp_size) for c in chunks)
            if opt.engine.reducer.error_feedback:
                lens = sorted(int(v.numel()) for v in opt.engine.reducer.worker_residual.values())
                assert lens == sorted(2 * c for c in chunks), (lens, chunks)
        assert abs(stats[name]["sent"] - want) < 1e-6, (name, stats[name]["sent"], want)
        print(f"  {name}: max |err| vs the DP group's average {err:.3g}; vs the group's reduction "
              f"{near:.3g}, the world's {far:.3g}; "
              f"{stats[name]['sent']:.0f} B sent (P=2 formula), ratio {stats[name]['ratio']:.3f}", flush=True)


def check_dp_broadcast_metric():
    mesh = hvd.ProcessMesh(**TP_DP)
    model = local_model(seed=100 + hvd.rank())  # every rank different
    hvd.broadcast_parameters(model.state_dict(), root_rank=mesh.dp_root, process_set=mesh.dp)
    for k, p in model.named_parameters():
        in_dp = gather(p, f"bc.dp.{k}", mesh.dp)
        in_tp = gather(p, f"bc.tp.{k}", mesh.tp)
        assert torch.equal(in_dp[0], in_dp[1]), f"{k}: differs inside the DP group after broadcast"
        assert not torch.equal(in_tp[0], in_tp[1]), f"{k}: the other DP group's root leaked in"
    mine = local_model(seed=100 + mesh.dp_root)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), mine.parameters()))
    metric = hvd.allreduce(torch.tensor(float(hvd.rank())), name="metric", process_set=mesh.dp)
    assert metric.item() == float(np.mean(mesh.ranks("dp"))), metric


def check_dp_optimizer_state():
    """broadcast_optimizer_state inside mesh.dp, where the two stages hold different parameters
    (a world-wide broadcast would pair stage 0's tensors with stage 1's)."""
    mesh = hvd.ProcessMesh(**PP_DP)
    torch.manual_seed(mesh.pp_rank)
    model = torch.nn.Linear(6 + 4 * mesh.pp_rank, 3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression="int8",
                                   process_set=mesh.dp, policy=hvd.CompressionPolicy(min_elements=1))
    x = torch.randn(8, model.in_features) + hvd.rank()
    model(x).square().mean().backward()
    opt.step()
    for g in opt.param_groups:  # a per-rank setting and per-rank momentum: the root's must win
        g["momentum"] = 0.9 - 0.1 * hvd.rank()
    for st in opt.state.values():
        st["momentum_buffer"].add_(float(hvd.rank()))
    residual = {k: v.clone() for k, v in opt.engine.reducer.worker_residual.items()}
    hvd.broadcast_optimizer_state(opt, root_rank=mesh.dp_root, process_set=mesh.dp)
    assert opt.param_groups[0]["momentum"] == 0.9 - 0.1 * mesh.dp_root
    for i, p in enumerate(model.parameters()):
        buf = gather(opt.state[p]["momentum_buffer"], f"os.{i}", mesh.dp)
        assert torch.equal(buf[0], buf[1]), f"momentum of parameter {i} differs inside the DP group"
    mine = opt.engine.reducer.worker_residual
    assert residual and all(torch.equal(mine[k], v) for k, v in residual.items()), "residuals are per worker"


def check_tp_dp_example():
    mesh = hvd.ProcessMesh(**TP_DP)
    for compression in ("none", "int8"):
        out = torch_tp_dp.train(mesh, steps=6, compression=compression, check=True, log=lambda s: None)
        ratio = out["stats"]["total"]["all"]["ratio"]
        assert compression == "none" or ratio < 0.3, ratio
        print(f"  tp x dp, {compression}: {torch_tp_dp.check_text(out)}, DP wire ratio {ratio:.3f}", flush=True)


def check_pp_dp_example():
    mesh = hvd.ProcessMesh(**PP_DP)
    for compression in ("none", "int8"):
        out = torch_pp_dp.train(mesh, steps=6, compression=compression, check=True, log=lambda s: None)
        ratio = out["stats"]["total"]["all"]["ratio"]
        assert compression == "none" or ratio < 0.3, ratio
        print(f"  pp x dp, {compression}, stage {mesh.pp_rank}: {torch_tp_dp.check_text(out)}, "
              f"DP wire ratio {ratio:.3f}", flush=True)


def main():
    if MODE == "static":
        sets = hvd.ProcessMesh.static_process_sets(**TP_DP) + hvd.ProcessMesh.static_process_sets(**PP_DP)
        hvd.init(process_sets=list({id(s): s for s in sets}.values()))
    else:
        hvd.init(process_sets="dynamic")
    for name in sys.argv[2:]:
        globals()[f"check_{name}"]()
        hvd.barrier()
        print(f"CHECK {name} OK rank={hvd.rank()}", flush=True)


if __name__ == "__main__":
    main()
