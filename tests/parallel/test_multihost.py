"""Multi-host launch rehearsed on one machine: `horovodrun -H a:1,b:1 -p PORT` over real SSH.

scripts/ssh_rehearsal.sh starts an sshd on loopback with throw-away keys and makes two host names
resolve to 127.0.0.2 / 127.0.0.3. Those are not this machine's interface addresses, so Horovod
(and Open MPI) take them for remote hosts: the ssh check, the ssh launch of every worker (Gloo)
or of Open MPI's daemons (MPI), and the cross-host rendezvous all run as on a cluster. Traffic is
kept on loopback (`--network-interfaces lo`, Open MPI's out-of-band channel too). Everything the
script makes is removed afterwards, also on failure; the teardown asserts it.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.parallel, pytest.mark.timeout(180)]

HELPER = os.path.join(ROOT, "scripts", "ssh_rehearsal.sh")
SERVERS = {"127.0.0.2", "127.0.0.3"}  # where ssh_rehearsal.sh points the two names
LAUNCH_TIMEOUT = 90  # seconds for one horovodrun; ~10-20 s when healthy on 2 busy cores

# The job each "host" runs. It checks that the launch really went through sshd on distinct
# loopback hosts, that Horovod sees two hosts of one slot each, and that a compressed (int8)
# DistributedOptimizer step across them matches an uncompressed step within int8's bound.
WORKER = r'''
import os
import torch
import hvdp.torch as hvd

hvd.init()
server = (os.environ.get("SSH_CONNECTION") or "? ? none ?").split()[2]
assert hvd.size() == 2 and hvd.local_size() == 1 and hvd.cross_size() == 2, \
    (hvd.size(), hvd.local_size(), hvd.cross_size())
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="rank_sum")
assert total.item() == 3.0, total
octet = hvd.allgather(torch.tensor([int(server.rsplit(".", 1)[-1]) if server[0].isdigit() else -1]),
                      name="servers")
assert sorted(octet.tolist()) == [2, 3], f"ranks not launched through sshd on two hosts: {octet}"

torch.manual_seed(0)
model = torch.nn.Linear(64, 32)  # 2048 weights: above the policy's 1024-element floor for int8
w0 = model.weight.detach().clone()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                               named_parameters=model.named_parameters(), compression="int8")
x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + hvd.rank()))
model(x).pow(2).mean().backward()
g = model.weight.grad.detach().clone()
opt.step()
# the uncompressed step: w0 - lr * average of the local gradients
ref = w0 - hvd.allreduce(g, op=hvd.Average, name="ref_grad")
gmax = hvd.allreduce(g.abs().max().reshape(1), op=hvd.Max, name="gmax").item()
# int8: half a step (|block max| / 254) for each worker's encoding plus half a step for the
# re-encoded average; both steps are below the largest |g| / 127.
bound = gmax / 127 * 1.001
err = (model.weight.detach() - ref).abs().max().item()
assert err <= bound, (err, bound)
both = hvd.allgather(model.weight.detach()[None], name="weights")
assert torch.equal(both[0], both[1]), "ranks diverged after the compressed step"
assert "int8" in str(opt.compression_stats()["codec"]), opt.compression_stats()
print(f"CHECK multihost OK rank={hvd.rank()} server={server} err={err:.3g} bound={bound:.3g}",
      flush=True)
'''


def _helper(*args, timeout=60, env=None):
    return subprocess.run(["bash", HELPER, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """Two loopback 'hosts' behind a throw-away sshd; torn down (and checked) afterwards."""
    why = _helper("check", timeout=30)
    if why.returncode != 0:
        pytest.skip(f"multi-host rehearsal cannot run here: {why.stdout.strip() or why.stderr.strip()}")
    state = tempfile.mkdtemp(prefix="hvdp-rehearsal-")
    tag = re.sub("[^a-z0-9]", "", os.path.basename(state).rsplit("-", 1)[-1].lower())
    names = (f"hvdp-a-{tag}", f"hvdp-b-{tag}")  # unique: two rehearsals can run side by side
    port = _free_port()
    try:
        up = _helper("up", state, str(port), *names, timeout=60,
                     env={"HVDP_REHEARSAL_OWNER": str(os.getpid())})
        assert up.returncode == 0, f"ssh_rehearsal.sh up failed:\n{up.stdout}\n{up.stderr}"
        worker = os.path.join(state, "multihost_worker.py")
        with open(worker, "w") as f:
            f.write(WORKER)
        yield {"names": names, "port": port, "key": os.path.join(state, "id"), "worker": worker}
    finally:
        pid = _read(os.path.join(state, "sshd.pid"))
        down = _helper("down", state, timeout=60)
    assert down.returncode == 0, down.stderr
    assert state not in _read("/etc/hosts"), "hosts lines left in /etc/hosts"
    assert not [n for n in os.listdir("/etc/ssh/ssh_config.d") if os.path.basename(state) in n]
    assert not os.path.exists(state), "state directory left behind"
    if pid:  # gone, or at most a zombie waiting for init
        assert _read(f"/proc/{pid}/stat").split(") ")[-1][:1] in ("", "Z"), f"sshd {pid} still runs"


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _run(cmd, timeout):
    """Run in its own process group; on timeout kill the whole group, so a hang fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               # Open MPI's daemon <-> mpirun channel: loopback too (horovodrun sets only btl's)
               OMPI_MCA_oob_tcp_if_include="lo")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=ROOT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"horovodrun hung for {timeout}s:\n{out[-3000:]}")
    return p.returncode, out


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_two_hosts_over_ssh(cluster, controller):
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        pytest.skip("horovodrun not found next to the interpreter: run `make setup`")
    a, b = cluster["names"]
    cmd = [exe, "-np", "2", "-H", f"{a}:1,{b}:1", "-p", str(cluster["port"]), "-i", cluster["key"],
           "--network-interfaces", "lo", "--start-timeout", "60", f"--{controller}",
           sys.executable, cluster["worker"]]
    t0 = time.monotonic()
    rc, out = _run(cmd, LAUNCH_TIMEOUT)
    took = time.monotonic() - t0
    print(f"{controller}: horovodrun over ssh took {took:.1f} s")
    assert rc == 0, out[-4000:]
    oks = dict(re.findall(r"CHECK multihost OK rank=(\d) server=(\S+)", out))
    assert set(oks) == {"0", "1"}, out[-4000:]
    assert set(oks.values()) == SERVERS, oks  # one rank behind each host name's sshd address
