"""Two nodes on one machine (scripts/two_node.sh via two_node.TwoNodeCluster): network namespaces
joined by a throttled veth pair, an sshd with its own host name in each, jobs launched from node A.

One cluster for the module: the throttle holds the rate; then the two-level jobs (a Gloo and an
MPI horovodrun of 2 + 2 ranks for hvdp.torch, a Gloo one for hvdp.keras). The torch jobs first
check the cluster itself: Horovod's view (size 4, local_size 2, cross_size 2), that each rank runs
in its node's namespaces (host name, veth address), and (Gloo, static process sets {0,1} and
{2,3}) that a node-local allreduce leaves the veth quiet while a cross-node one crosses it. The
veth counters seen from outside must grow by the cross-node payload too, and `down` must leave
nothing behind.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from two_node import TwoNodeCluster

CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk")  # two_level_checks.py's torch checks

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(300)]

RATE, RATE_BITS = "1gbit", 1e9
JOB_TIMEOUT = 150  # seconds for one horovodrun; ~20 s when healthy on 2 busy cores
MIB = 1 << 20


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


def test_two_node_cluster_link_rate(cluster):
    """The veth between the nodes runs at the rate asked (the jobs below check the rest: host
    names, addresses and where the bytes go, see two_level_checks.py's cluster check)."""
    bps = cluster.speed(0.5)
    print(f"A->B over the veth: {bps / 1e6:.0f} Mbit/s at rate {RATE}")
    assert 0.5 * RATE_BITS < bps < 1.1 * RATE_BITS, bps


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
    c = cluster
    if args[0] == "torch":  # the cluster's own checks first (both controllers; bytes: static)
        args = args + [c.iface, ",".join(c.names), ",".join(c.addresses)]
    before = c.bytes()
    r = c.run(c.horovodrun(controller) + [sys.executable, TWO_LEVEL] + args, timeout=JOB_TIMEOUT, env=env)
    after = c.bytes()
    assert r.returncode == 0, f"{controller} {args}:\n{r.stdout[-6000:]}"
    if args[0] == "torch":
        hosts = {int(k): v for k, v in re.findall(r"CHECK two_node OK rank=(\d) host=(\S+)", r.stdout)}
        assert hosts == {0: c.names[0], 1: c.names[0], 2: c.names[1], 3: c.names[1]}, r.stdout[-4000:]
        tx, rx = after[0] - before[0], after[1] - before[1]
        print(f"{controller}: veth tx={tx} rx={rx} bytes for the job")
        assert tx >= 4 * MIB and rx >= 4 * MIB, (controller, tx, rx)
    oks = re.findall(r"CHECK two_level (\S+) OK rank=(\d)", r.stdout)
    expect = 4 * (1 if args[0] == "keras" else len(CODECS))
    if "dynamic" not in args:  # node B's ranks ended 2 s after node A's (their last collective is
        expect += 2            # node-local): hvdp's exit wait kept Horovod up for them
        assert {rank for what, rank in oks if what == "late_node"} == {"2", "3"}, r.stdout[-4000:]
    assert len(set(oks)) == expect, (sorted(set(oks)), r.stdout[-4000:])


TWO_LEVEL_KILL = os.path.join(ROOT, "tests", "parallel", "workers", "two_level_kill.py")


def test_rank_killed_inside_two_level_reduction(cluster, tmp_path):
    """Rank 3 (node B) SIGKILLed with its int8 two-level reduction submitted. Before hvdp's patch
    of Horovod's shutdown (hvdp/install/recipe.py), every survivor aborted in C++ 0.2-0.4 s later
    ('terminate called after throwing an instance of gloo::IoException': negotiating the process
    sets' removal with the dead rank threw outside any handler). Now no rank aborts; horovodrun
    then stops the others (SIGTERM to the local ones, the ssh session of the remote one), and each
    local survivor says where it was (hvdp's Python error, or the flight recorder's last words
    naming the collective it was in). The remote survivor (rank 2, beside the dead one) raises
    hvdp's error too, but horovodrun has closed its ssh session by then (the rank goes on a moment
    longer than horovodrun), so what it says reaches no terminal: its flight record keeps it, and
    `python -m hvdp trace` shows it (checked here)."""
    c = cluster
    flight = tmp_path / "flight"
    r = c.run(c.horovodrun("gloo") + [sys.executable, TWO_LEVEL_KILL, "3"], timeout=JOB_TIMEOUT,
              env={"HVDP_FLIGHT_DIR": str(flight)})
    out = r.stdout
    assert r.returncode != 0 and "KILLING rank=3" in out, out[-6000:]
    assert "terminate called" not in out and "Aborted" not in out, out[-6000:]
    for rank in (0, 1):  # node A's survivors
        raised = re.search(rf"ERROR rank={rank} after=\S+ type=HorovodInternalError msg=\"hvdp: ", out)
        # the collective it was in: a phase of the reduction or the step's presence sum ("allreduce
        # (presence)"), started or failed
        stopped = re.search(rf"hvdp: rank {rank} ended by SIGTERM in hvdp\.opt0\.\S+ #\d+ \(.+?, (started|failed)\)",
                            out)
        assert raised or stopped, f"rank {rank}:\n{out[-6000:]}"  # a str: pytest prints it whole
    deadline = time.monotonic() + 30  # the remote survivor outlives horovodrun (its ssh session
    while not (flight / "rank-2.json").exists() and time.monotonic() < deadline:  # is gone)
        time.sleep(0.5)
    dumps = {p.name: json.loads(p.read_text()) for p in flight.glob("rank-*.json")}
    assert "rank-3.json" not in dumps and "rank-2.json" in dumps, (sorted(dumps), out[-6000:])
    why = dumps["rank-2.json"]["reasons"][0]["reason"]
    assert "hvdp: rank 2 saw Horovod shut down" in why, why
    t = subprocess.run([sys.executable, "-m", "hvdp", "trace", str(flight)], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert t.returncode == 1 and "hvdp: rank 2 saw Horovod shut down" in t.stdout, t.stdout + t.stderr
    assert re.search(r"no dump \(killed.*: rank 3$", t.stdout, re.M), t.stdout
