"""hvdp.cluster.bootstrap without processes: launcher detection, Slurm node lists, Horovod's local/cross
plan, the size refusal, and the store protocol with a fake store and threads (no Horovod)."""
import threading

import pytest

from hvdp.cluster import bootstrap as bs
from hvdp.cluster import launchers

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
        "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"}


def test_detects_each_launcher():
    assert launchers.detect({}).kind == "none" and not launchers.detect({}).bootstraps
    h = launchers.detect({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"})
    assert (h.kind, h.rank, h.size, h.bootstraps) == ("horovod", 1, 2, False)  # horovodrun first
    assert launchers.detect({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "1.2.3.4"}).kind == "horovod"
    m = launchers.detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", **SRUN})
    assert (m.kind, m.name, m.rank, m.size) == ("mpi", "mpirun (Open MPI)", 2, 8)
    assert launchers.detect({"PMIX_RANK": "0"}).size is None  # no size to check
    assert launchers.detect({"PMI_RANK": "1", "PMI_SIZE": "3"}).size == 3
    t = launchers.detect({**TORCHRUN, **SRUN})  # torchrun inside an srun step: torchrun's world
    assert (t.kind, t.name, t.rank, t.size, t.local_rank, t.local_size, t.addr, t.port) == \
        ("torchrun", "torchrun", 1, 4, 1, 2, "node01", 29500)
    assert t.bootstraps
    assert launchers.detect({"RANK": "0", "WORLD_SIZE": "2"}).name == "a torchrun-style launcher"
    assert not launchers.detect({"RANK": "0", "WORLD_SIZE": "1"}).bootstraps  # one process: nothing to do
    s = launchers.detect(SRUN)
    assert (s.kind, s.rank, s.size, s.local_rank, s.addr, s.port) == ("slurm", 3, 4, 1, "gpu07", 29400 + 1234)
    s2 = launchers.detect({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (s2.addr, s2.port) == ("head", 4000)
    # a batch script's own shell (no srun step) is not a launcher of several processes
    assert launchers.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"}).kind == "none"
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        launchers.detect({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize("text,hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n1", ["n1"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[3],y[009-010]z", ["x3", "y009z", "y010z"]),
])
def test_parses_slurm_node_lists(text, hosts):
    assert launchers.parse_nodelist(text) == hosts


def test_refuses_a_broken_node_list():
    with pytest.raises(ValueError, match="unbalanced"):
        launchers.parse_nodelist("node[01-03")
    with pytest.raises(ValueError, match="cannot read"):
        launchers.parse_nodelist("node[a-b]")


def test_plan_matches_horovods_host_assignments():
    slots = launchers.plan(["a", "a", "b", "b"])
    assert [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == \
        [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert all(s.size == 4 for s in slots) and [s.rank for s in slots] == [0, 1, 2, 3]
    # uneven hosts and interleaved ranks: local ranks in rank order, hosts in order of first rank
    slots = launchers.plan(["b", "a", "b", "a", "b"])
    assert [(s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == \
        [("b", 0, 3, 0, 2), ("a", 0, 2, 1, 2), ("b", 1, 3, 0, 2), ("a", 1, 2, 1, 2), ("b", 2, 3, 0, 1)]


def test_plan_is_horovods_own_where_horovod_is_installed():
    hosts = pytest.importorskip("horovod.runner.common.util.hosts")
    mine = launchers.plan(["a", "a", "a", "b", "b", "c"])
    theirs = hosts.get_host_assignments(hosts.parse_hosts("a:3,b:2,c:1"), 6)
    assert [s.__dict__ for s in mine] == [t.__dict__ for t in theirs]


def test_refuses_a_silent_split():
    la = launchers.detect(TORCHRUN)
    with pytest.raises(RuntimeError) as e:
        launchers.check_size(la, 1)
    msg = str(e.value)
    assert "torchrun started 4 processes" in msg and "size 1" in msg and "Fix:" in msg
    assert "RANK" in msg and "horovodrun" in msg
    launchers.check_size(la, 4)
    launchers.check_size(launchers.detect({}), 1)
    with pytest.raises(RuntimeError, match=r"mpirun \(Open MPI\) started 2 .* install-horovod"):
        launchers.check_size(launchers.detect({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}), 1)


class FakeStore:
    """TCPStore's two calls: set, and a get that waits for the key."""

    def __init__(self):
        self.data, self.cv = {}, threading.Condition()

    def set(self, key, value):
        with self.cv:
            self.data[key] = value
            self.cv.notify_all()

    def get(self, key):
        with self.cv:
            assert self.cv.wait_for(lambda: key in self.data, timeout=10), key
            return self.data[key]


def test_bootstrap_gives_each_rank_horovodruns_variables():
    store, started, out = FakeStore(), [], {}
    hosts = ["h1", "h1", "h2"]

    def start(slots):
        started.append(slots)
        return 4242

    def rank(r):
        env = {**TORCHRUN, "RANK": str(r), "WORLD_SIZE": "3", "HOROVOD_GLOO_IFACE": "eth9"}
        out[r] = bs.bootstrap(launchers.detect(env), store, hostname=hosts[r], environ=env, start=start)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    assert len(started) == 1 and [s.hostname for s in started[0]] == hosts  # rank 0 only
    assert out[2]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4242" and out[0]["HOROVOD_CONTROLLER"] == "gloo"
    assert [(out[r]["HOROVOD_LOCAL_RANK"], out[r]["HOROVOD_CROSS_RANK"], out[r]["HOROVOD_HOSTNAME"])
            for r in range(3)] == [("0", "0", "h1"), ("1", "0", "h1"), ("0", "1", "h2")]
    assert {out[r]["HOROVOD_GLOO_IFACE"] for r in range(3)} == {"eth9"}  # the user's choice kept
    assert {out[r]["HOROVOD_CPU_OPERATIONS"] for r in range(3)} == {"gloo"}
    assert {out[r]["NCCL_SOCKET_IFNAME"] for r in range(3)} == {"eth9"}


def test_one_host_uses_loopback():
    la = launchers.Launcher("torchrun", "torchrun", 0, 1, addr="somewhere.invalid", port=1)
    got = bs.bootstrap(la, FakeStore(), hostname="h", environ={}, start=lambda slots: 7)
    assert (got["HOROVOD_GLOO_RENDEZVOUS_ADDR"], got["HOROVOD_GLOO_IFACE"]) == ("127.0.0.1", "lo")
    kept = bs.bootstrap(la, FakeStore(), hostname="h", environ={"NCCL_SOCKET_IFNAME": "ib0"},
                        start=lambda slots: 7)
    assert "NCCL_SOCKET_IFNAME" not in kept  # the user's NCCL interface is left alone


def test_init_bootstraps_then_checks_the_size(monkeypatch):
    monkeypatch.setattr(bs, "start_rendezvous", lambda slots: 4243)
    store, calls, envs = FakeStore(), [], {}

    def rank(r):
        envs[r] = {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        bs.init(lambda comm=None, process_sets=None: calls.append((r, comm, process_sets)), lambda: 2,
                lambda: False, process_sets=["ps"], make_store=lambda la: store, environ=envs[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    assert sorted(calls) == [(0, None, ["ps"]), (1, None, ["ps"])]
    assert [envs[r]["HOROVOD_RANK"] for r in (0, 1)] == ["0", "1"]
    assert envs[1]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4243" and envs[1]["HOROVOD_GLOO_IFACE"] == "lo"
    calls.clear()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    # without a store (Keras on TensorFlow): refused, naming the launchers that work
    with pytest.raises(RuntimeError, match="horovodrun.*mpirun"):
        bs.init(lambda **k: calls.append(k), lambda: 1, lambda: False, environ=dict(env))
    assert calls == []
    # an MPI launcher whose world Horovod did not join
    with pytest.raises(RuntimeError, match="size 1"):
        bs.init(lambda **k: calls.append(k), lambda: 1, lambda: False,
                environ={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    assert calls == [{"comm": None, "process_sets": None}]
    # no rendezvous host
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        bs.init(lambda **k: None, lambda: 1, lambda: False, environ={"RANK": "0", "WORLD_SIZE": "2"},
                make_store=lambda la: FakeStore())


def test_doctor_lines_name_the_launcher():
    lines = bs.describe(TORCHRUN)
    assert lines[0].startswith("launcher: torchrun (rank 1 of 4") and "RendezvousServer" in lines[1]
    assert bs.describe({}) == ["launcher: no launcher (a single process)"]
    assert "sets nothing" in bs.describe({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"})[1]


def test_an_initialised_process_group_bootstraps_without_launcher_variables(monkeypatch):
    """No launcher's variables, but the framework's group has 2 ranks (a torch.multiprocessing.spawn
    script that called init_process_group itself): bootstrap through the group's store, check the
    size against the group's; a one-rank group or none changes nothing."""
    monkeypatch.setattr(bs, "start_rendezvous", lambda slots: 4244)
    store, calls, envs, kinds = FakeStore(), [], {}, []

    def make_store(la):
        kinds.append((la.kind, la.rank, la.size, la.addr))
        return store

    def rank(r):
        envs[r] = {}
        bs.init(lambda comm=None, process_sets=None: calls.append(r), lambda: 2, lambda: False,
                make_store=make_store, environ=envs[r], group=lambda: (r, 2, "a test group"))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    assert sorted(calls) == [0, 1] and sorted(kinds) == [("group", 0, 2, None), ("group", 1, 2, None)]
    assert [envs[r]["HOROVOD_RANK"] for r in (0, 1)] == ["0", "1"]
    assert envs[1]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4244" and envs[1]["HOROVOD_GLOO_IFACE"] == "lo"
    # Horovod joined less than the group: refused, naming the group
    with pytest.raises(RuntimeError, match="a test group started 2 processes.*size 1"):
        bs.init(lambda **k: None, lambda: 1, lambda: True, environ={}, group=lambda: (0, 2, "a test group"))
    # a one-rank group or no group: not used
    for grp in (lambda: (0, 1, "g"), lambda: None):
        bs.init(lambda **k: None, lambda: 1, lambda: False, environ={}, make_store=make_store, group=grp)
    assert len(kinds) == 2


def test_a_second_init_after_shutdown_bootstraps_a_new_job(monkeypatch):
    """hvd.init(), hvd.shutdown(), hvd.init() in one process (the Ray check runs the torchrun
    checks, then torch_digits.py, in each worker): the variables the first bootstrap set are not
    read as horovodrun's; the second init starts a new rendezvous server (the first one's keys can
    outlive its job) and every rank gets its port. Genuine horovodrun variables still mean
    horovodrun: nothing bootstrapped."""
    monkeypatch.setattr(bs, "_SET", [])
    ports = iter([5001, 5002])
    monkeypatch.setattr(bs, "start_rendezvous", lambda slots: next(ports))
    stores, envs = {1: FakeStore(), 2: FakeStore()}, {}  # one per generation, as tcp_store's prefixes

    def rank(r, generation):
        env = envs.setdefault(r, {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
        bs.init(lambda **k: None, lambda: 2, lambda: False, environ=env,
                make_store=lambda la: stores[generation])

    for generation in (1, 2):
        threads = [threading.Thread(target=rank, args=(r, generation)) for r in (1, 0)]
        [t.start() for t in threads]
        [t.join(20) for t in threads]
        assert [envs[r]["HOROVOD_GLOO_RENDEZVOUS_PORT"] for r in (0, 1)] == [str(5000 + generation)] * 2
    assert [envs[r]["HOROVOD_RANK"] for r in (0, 1)] == ["0", "1"]
    horovodrun = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "h"}
    bs.init(lambda **k: None, lambda: 2, lambda: False, environ=dict(horovodrun),
            make_store=lambda la: pytest.fail("bootstrapped under horovodrun"))
