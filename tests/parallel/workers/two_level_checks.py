"""Two-level reduction (``hierarchical=True``) on a real cluster of nodes (tests/parallel/test_two_node.py).

    two_level_checks.py torch static|dynamic      hvdp.torch, every codec
    two_level_checks.py keras                     hvdp.keras (TensorFlow backend): fit with two levels

torch: each codec reduces the same per-rank gradients in two levels; every rank checks the result
against the exact float64 average under the codec's bound, against the numpy reference of the
whole two-level pipeline (replayed from every rank's gradients), bit-identity across ranks, and
for none equality with the flat allreduce within float32 rounding; compression_stats() names
the node layout and counts bytes across nodes. "static": the process sets registered at hvd.init
(hvd.hierarchical_process_sets()); "dynamic": HOROVOD_DYNAMIC_PROCESS_SETS=1 and hvd.init().
Prints 'CHECK two_level <what> OK rank=<r>'."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reduction_bounds import check_reduced, reference_two_level  # noqa: E402

from hvdp import codecs  # noqa: E402

CODECS = ("none", "fp16", "bf16", "int8", "topk")


def places(hvd, gather):
    got = gather(np.array([[hvd.cross_rank(), hvd.local_rank()]], np.int64))
    return [tuple(int(v) for v in row) for row in got]


def torch_checks(mode):
    import torch

    import hvdp.torch as hvd
    if mode == "static":
        hvd.init(process_sets=hvd.hierarchical_process_sets())
    else:
        assert os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
        hvd.init()
    r = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (4, 2, 2)

    def gather(a, name="g"):
        return hvd.allgather(torch.from_numpy(np.ascontiguousarray(a)), name=name).numpy()
    where = places(hvd, lambda a: gather(a, "places"))
    local_of = [(node, i) for node, i in where]   # node, local rank
    cross_of = [(i, node) for node, i in where]   # local rank, node
    for codec in CODECS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=codec,
                                       hierarchical=True)
        x = torch.randn(16, 96, generator=torch.Generator().manual_seed(100 + r)) * (1 + r)
        model(x).pow(2).mean().backward()
        params = list(model.parameters())
        local = [p.grad.detach().clone().reshape(-1).numpy() for p in params]
        opt.synchronize()
        got = [p.grad.detach().reshape(-1).numpy() for p in params]
        per_rank = [[None] * len(params) for _ in range(4)]
        for i, g in enumerate(local):
            rows = gather(g[None], f"local.{codec}.{i}")
            for q in range(4):
                per_rank[q][i] = rows[q]
        names = [n for n, _ in model.named_parameters()]
        buckets = [[names.index(n) for n in members] for members in opt.engine.bucket_members().values()]
        assert buckets, (codec, opt.engine.plan)  # every codec, none too, goes through the buckets
        c = codecs.get(codec)
        if codec == "topk":  # not bounded per element: the replayed pipeline is the check
            for idx in buckets:
                flats = [np.concatenate([per_rank[q][i] for i in idx]) for q in range(4)]
                ref = reference_two_level(c, flats, local_of, cross_of)
                mine = np.concatenate([got[i] for i in idx])
                np.testing.assert_allclose(mine, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
            err = 0.0
        else:
            err = check_reduced(codec, per_rank, got, buckets,
                                reference=lambda c, flats: reference_two_level(c, flats, local_of, cross_of))
        if codec == "none":  # the flat allreduce of the same gradients, within float32 rounding
            for i, g in enumerate(local):
                flat = hvd.allreduce(torch.from_numpy(g), op=hvd.Average, name=f"flat.{i}").numpy()
                tol = 8 * np.finfo(np.float32).eps * float(np.abs(flat).max())
                assert float(np.abs(got[i] - flat).max()) <= tol, (i, float(np.abs(got[i] - flat).max()), tol)
        for i, g in enumerate(got):  # every rank decoded the same bytes
            rows = gather(g[None], f"got.{codec}.{i}")
            assert all(np.array_equal(rows[0], rows[q]) for q in range(4)), (codec, i)
        stats = opt.compression_stats()
        assert stats["hierarchical"] == "2 nodes x 2 ranks", stats["hierarchical"]
        assert stats["last_step"][c.name]["cross"] > 0, stats["last_step"]
        print(f"CHECK two_level torch-{mode}-{codec} OK rank={r} err={err:.3g}", flush=True)


def keras_checks():
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    import hvdp.keras as hvd
    hvd.init(process_sets=hvd.hierarchical_process_sets())
    r = hvd.rank()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = rng.standard_normal((64, 16)).astype(np.float32)
    shard = slice(16 * r, 16 * (r + 1))
    weights = {}
    for codec, hier in (("none", False), ("none", True), ("int8", True)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"),
                                  keras.layers.Dense(16)])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=codec, hierarchical=hier)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x[shard], y[shard], batch_size=16, epochs=3, verbose=0, shuffle=False)
        w = np.concatenate([v.reshape(-1) for v in model.get_weights()])
        rows = hvd.allgather(w[None], name=f"w.{codec}.{hier}")
        rows = np.asarray(rows)
        assert all(np.array_equal(rows[0], rows[q]) for q in range(4)), (codec, hier)
        weights[(codec, hier)] = w
        if hier:
            stats = opt.compression_stats()
            assert stats["hierarchical"] == "2 nodes x 2 ranks", stats["hierarchical"]
            assert stats["last_step"][codec]["cross"] > 0, stats["last_step"]
    flat = weights[("none", False)]
    scale = float(np.abs(flat).max())
    d_none = float(np.abs(weights[("none", True)] - flat).max())
    d_int8 = float(np.abs(weights[("int8", True)] - flat).max())
    assert d_none <= 1e-5 * scale, d_none  # float32 summation order only
    assert d_int8 <= 2e-3 * scale, d_int8  # three steps of int8 with error feedback
    print(f"CHECK two_level keras OK rank={r} none={d_none:.3g} int8={d_int8:.3g}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        torch_checks(sys.argv[2])
    else:
        keras_checks()
