"""Two-level reduction (``hierarchical=True``) on a real cluster of nodes (tests/parallel/test_two_node.py).

    two_level_checks.py torch static|dynamic [IFACE NAMES ADDRESSES]   hvdp.torch, every codec
    two_level_checks.py keras                     hvdp.keras (TensorFlow backend): fit with two levels

torch: each codec reduces the same per-rank gradients in two levels; every rank checks the result
against the exact float64 average under the codec's bound, against the numpy reference of the
whole two-level pipeline (replayed from every rank's gradients), bit-identity across ranks, and
for none equality with the flat allreduce within float32 rounding; compression_stats() names
the node layout and counts bytes across nodes. "static": the process sets registered at hvd.init
(hvd.hierarchical_process_sets()); "dynamic": HOROVOD_DYNAMIC_PROCESS_SETS=1 and hvd.init().
With IFACE NAMES ADDRESSES (the cluster's veth name, host names and addresses, comma-separated,
node A first) the job first checks the cluster itself: each rank's host name and address are
its node's, and (static) a node-local allreduce of 16 MiB sends nothing over the veth while a
4 MiB allreduce over all four ranks crosses it ('CHECK two_node OK rank=<r> ...').
Prints 'CHECK two_level <what> OK rank=<r>'."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reduction_bounds import check_reduced, reference_two_level  # noqa: E402

from hvdp import codecs  # noqa: E402

CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk")


def places(hvd, gather):
    got = gather(np.array([[hvd.cross_rank(), hvd.local_rank()]], np.int64))
    return [tuple(int(v) for v in row) for row in got]


def veth(iface):
    """(tx, rx) bytes of this node's veth end (/proc/net/dev is per network namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                v = rest.split()
                return int(v[8]), int(v[0])
    raise SystemExit(f"no {iface} in this process's network namespace")


def address(iface):
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(ifreq[20:24])


def cluster_checks(hvd, torch, iface, names, addresses, sets):
    """The two-node cluster as Horovod sees it: 2 nodes x 2 ranks, each rank on its own node's
    host and address; with the process sets registered at init (``sets``), node-local traffic
    stays off the veth and cross-node traffic crosses it."""
    import socket
    r, node = hvd.rank(), hvd.cross_rank()
    assert node == r // 2, (r, node)  # ranks 0, 1 on node A; 2, 3 on node B
    host, addr = socket.gethostname(), address(iface)
    assert (host, addr) == (names[node], addresses[node]), (r, host, addr)
    intra, cross = 0, (0, 0)
    if sets:
        mib = 1 << 20
        mine = [ps for ps in sets if sorted(ps.ranks) == [2 * node, 2 * node + 1]]
        assert len(mine) == 1, [ps.ranks for ps in sets]
        hvd.barrier()
        t0 = veth(iface)
        local = hvd.allreduce(torch.full((4 * mib,), 1.0), op=hvd.Sum, process_set=mine[0], name="node_local_16MiB")
        hvd.barrier()
        t1 = veth(iface)
        total = hvd.allreduce(torch.full((mib,), r + 1.0), op=hvd.Sum, name="cross_4MiB")
        hvd.barrier()
        t2 = veth(iface)
        assert torch.equal(local, torch.full_like(local, 2.0)), local[:4]
        assert torch.equal(total, torch.full_like(total, 10.0)), total[:4]
        intra = (t1[0] - t0[0]) + (t1[1] - t0[1])
        cross = (t2[0] - t1[0], t2[1] - t1[1])
        assert intra < mib, f"a node-local 16 MiB allreduce moved {intra} bytes over the veth"
        assert min(cross) >= 4 * mib, f"a cross-node 4 MiB allreduce moved only {cross} bytes"
    print(f"CHECK two_node OK rank={r} host={host} addr={addr} intra={intra} tx={cross[0]} rx={cross[1]}",
          flush=True)


def torch_checks(mode, cluster=None):
    import torch

    import hvdp.torch as hvd
    sets = []
    if mode == "static":
        sets = hvd.hierarchical_process_sets()
        hvd.init(process_sets=sets)
    else:
        assert os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
        hvd.init()
    r = hvd.rank()
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (4, 2, 2)
    if cluster:
        iface, names, addresses = cluster[0], cluster[1].split(","), cluster[2].split(",")
        cluster_checks(hvd, torch, iface, names, addresses, sets)

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
        params = list(model.parameters())
        loss = model(x).pow(2).mean()
        # this rank's own gradients, taken before backward: backward's hooks start the reductions,
        # and a tensor below the policy's size goes by Horovod's in-place allreduce, so p.grad
        # may already hold the average by the time backward returns
        local = [g.detach().reshape(-1).numpy() for g in torch.autograd.grad(loss, params, retain_graph=True)]
        loss.backward()
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
    if mode == "static":
        node_b_ends_late(hvd, lambda ps: hvd.allreduce(torch.ones(4), op=hvd.Sum, name="late", process_set=ps),
                         sets)


def node_b_ends_late(hvd, local_sum, sets):
    """Node A ends at once; node B's ranks sleep 2 s, then sum over their node's process set (as
    the last node-local part of a two-level step does when node B is slower). Node A's exit must
    not shut Horovod down under node B's collective (hvdp's exit wait, hvdp.cluster.exits)."""
    import time
    r = hvd.rank()
    if hvd.cross_rank() == 1:
        local = next(ps for ps in sets if sorted(ps.ranks) == [2, 3])
        time.sleep(2.0)
        total = float(np.asarray(local_sum(local)).sum())
        assert total == 8.0, total
        print(f"CHECK two_level late_node OK rank={r}", flush=True)


def keras_checks():
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    import hvdp.keras as hvd
    sets = hvd.hierarchical_process_sets()
    hvd.init(process_sets=sets)
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
    node_b_ends_late(hvd, lambda ps: hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum, name="late",
                                                   process_set=ps), sets)


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        torch_checks(sys.argv[2], sys.argv[3:6])
    else:
        keras_checks()
