"""Two nodes on one machine (scripts/two_node.sh via two_node.TwoNodeCluster): network namespaces
joined by a throttled veth pair, an sshd with its own host name in each, jobs launched from node A.

One test, one cluster: the throttle holds the rate, then a Gloo and an MPI horovodrun of 2 + 2
ranks. Each rank checks Horovod's view (size 4, local_size 2, cross_size 2), that it runs in its
node's namespaces (host name, veth address), an allreduce's result, that a node-local allreduce
(process sets {0,1} and {2,3}) leaves the veth quiet and that a cross-node one crosses it. The
veth counters seen from outside must grow by the cross-node payload too, and `down` must leave
nothing behind.
"""
import os
import re
import sys

import pytest

from conftest import ROOT
from two_node import TwoNodeCluster

CODECS = ("none", "fp16", "bf16", "int8", "topk")  # two_level_checks.py's torch checks

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(300)]

RATE, RATE_BITS = "1gbit", 1e9
JOB_TIMEOUT = 150  # seconds for one horovodrun; ~20 s when healthy on 2 busy cores
MIB = 1 << 20

WORKER = r'''
import fcntl, socket, struct, sys
import torch
import horovod.torch as hvd

iface, names, addresses = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
MIB = 1 << 20

def veth():  # (tx, rx) of this node's veth end: /proc/net/dev is per network namespace
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                v = rest.split()
                return int(v[8]), int(v[0])
    raise SystemExit(f"no {iface} in this process's network namespace")

def address():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(ifreq[20:24])

node_a, node_b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])
hvd.init(process_sets=[node_a, node_b])
r = hvd.rank()
assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (4, 2, 2), \
    (hvd.size(), hvd.local_size(), hvd.cross_size())
node = hvd.cross_rank()
assert node == r // 2, (r, node)  # ranks 0, 1 on node A; 2, 3 on node B
host, addr = socket.gethostname(), address()
assert (host, addr) == (names[node], addresses[node]), (r, host, addr)

hvd.barrier()
t0 = veth()
local = hvd.allreduce(torch.full((4 * MIB,), 1.0), op=hvd.Sum, process_set=(node_a, node_b)[node],
                      name="node_local_16MiB")
hvd.barrier()
t1 = veth()
total = hvd.allreduce(torch.full((MIB,), r + 1.0), op=hvd.Sum, name="cross_4MiB")
hvd.barrier()
t2 = veth()
assert torch.equal(local, torch.full_like(local, 2.0)), local[:4]
assert torch.equal(total, torch.full_like(total, 10.0)), total[:4]
intra = (t1[0] - t0[0]) + (t1[1] - t0[1])
cross = (t2[0] - t1[0], t2[1] - t1[1])
assert intra < MIB, f"a node-local 16 MiB allreduce moved {intra} bytes over the veth"
assert min(cross) >= 4 * MIB, f"a cross-node 4 MiB allreduce moved only {cross} bytes"
print(f"CHECK two_node OK rank={r} host={host} addr={addr} intra={intra} tx={cross[0]} rx={cross[1]}",
      flush=True)
'''


@pytest.fixture(scope="module")
def cluster():
    """One two-node cluster for the module's tests; afterwards nothing of it may be left."""
    reason = TwoNodeCluster.unavailable()
    if reason:
        pytest.skip(reason)
    c = TwoNodeCluster(rate=RATE)
    with c:
        yield c
    assert c.leftovers() == [], c.leftovers()


def test_two_node_cluster(cluster, tmp_path):
    worker = tmp_path / "two_node_worker.py"
    worker.write_text(WORKER)
    c = cluster
    bps = c.speed(0.5)
    print(f"A->B over the veth: {bps / 1e6:.0f} Mbit/s at rate {RATE}")
    assert 0.5 * RATE_BITS < bps < 1.1 * RATE_BITS, bps

    args = [sys.executable, str(worker), c.iface, ",".join(c.names), ",".join(c.addresses)]
    for controller in ("gloo", "mpi"):
        before = c.bytes()
        r = c.run(c.horovodrun(controller) + args, timeout=JOB_TIMEOUT)
        after = c.bytes()
        assert r.returncode == 0, f"{controller}:\n{r.stdout[-4000:]}"
        oks = {int(k): v for k, v in re.findall(r"CHECK two_node OK rank=(\d) host=(\S+)", r.stdout)}
        assert oks == {0: c.names[0], 1: c.names[0], 2: c.names[1], 3: c.names[1]}, r.stdout[-4000:]
        tx, rx = after[0] - before[0], after[1] - before[1]
        print(f"{controller}: veth tx={tx} rx={rx} bytes for the job")
        assert tx >= 4 * MIB and rx >= 4 * MIB, (controller, tx, rx)


TWO_LEVEL = os.path.join(ROOT, "tests", "parallel", "workers", "two_level_checks.py")


@pytest.mark.parametrize("controller,args,env", [
    ("gloo", ["torch", "static"], {}),
    ("mpi", ["torch", "dynamic"], {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}),
    ("gloo", ["keras"], {}),
], ids=["torch-gloo-static", "torch-mpi-dynamic", "keras-gloo"])
def test_two_level_reduction(cluster, controller, args, env):
    """hierarchical=True on two nodes of two ranks: every codec (torch) against the exact average
    under its bound and the numpy reference of the pipeline, ranks bit-identical, none equal to
    the flat allreduce; Keras's fit with two levels equal to the flat one (see the worker)."""
    r = cluster.run(cluster.horovodrun(controller) + [sys.executable, TWO_LEVEL] + args,
                    timeout=JOB_TIMEOUT, env=env)
    assert r.returncode == 0, f"{controller} {args}:\n{r.stdout[-6000:]}"
    oks = re.findall(r"CHECK two_level (\S+) OK rank=(\d)", r.stdout)
    expect = 4 * (1 if args[0] == "keras" else len(CODECS))
    assert len(set(oks)) == expect, (sorted(set(oks)), r.stdout[-4000:])
