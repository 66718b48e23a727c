"""Ray Train's TorchTrainer running hvdp (in `make test`; alone: `make ray-check`).

A local Ray cluster of two node processes (``ray start --head --block`` and ``ray start
--address ... --block``, one CPU each so that the two workers land on different Ray nodes, free
ports, a private 0700 temporary directory), started by the test in their own sessions and ended
by process group. TorchTrainer(2 workers, gloo) runs, in each worker, the torchrun checks
(hvd.init() bootstraps Horovod's Gloo controller from the variables Ray Train sets; int8) and
examples/torch_digits.py with int8. Both must match horovodrun --gloo: the five losses bit for bit
and the test accuracy. `make setup` installs ray[train]; without ray the test is skipped with the
reason. About 2 min. A Ray driver that crashes in Ray itself ("Fatal Python error", seen once in
eight runs here, cause not found) or a cluster whose second node does not come up is started
afresh once, and the first attempt's failure is printed; a result that differs is never retried."""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, WORKERS, checks_passed
from test_torchrun import CHECKS, clean_env, free_port, horovodrun_reference, losses

pytestmark = pytest.mark.parallel
DRIVER = os.path.join(WORKERS, "ray_train.py")


def ray_exe():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed: `make setup` (scripts/setup.sh) installs ray[train]")
    exe = shutil.which("ray", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the ray command is not next to this interpreter")
    return exe


def wait_port(port, proc, timeout=90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.3)
    return False


def members(pgid):
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(pid))
    return found


def end(proc, wait_s=10):
    """End a `ray start --block` and everything in its session (its GCS, raylet, workers): SIGTERM
    to the group, SIGKILL to what is left after ``wait_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while True:
        proc.poll()  # reap the leader (the other members' parent is the leader, or init)
        if not members(proc.pid):
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.3)


def node_logs(tmp):
    out = []
    for name in sorted(os.listdir(tmp)):
        if name.startswith("node") and name.endswith(".log"):
            with open(os.path.join(tmp, name)) as f:
                out.append(f"{name}: {f.read()[-1500:]}")
    return "\n".join(out)


@contextlib.contextmanager
def ray_cluster():
    """A local Ray cluster of two node processes: yields (address, its private tmp dir, env)."""
    exe = ray_exe()
    tmp = tempfile.mkdtemp(prefix="hvdpray")  # short: Ray's unix sockets live under it
    os.chmod(tmp, 0o700)
    env = dict(clean_env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    port, procs = free_port(), []

    def node(*args):
        ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port"]
        cmd = [exe, "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
               "--disable-usage-stats", "--temp-dir", tmp, *args]
        for p in ports:
            cmd += [p, str(free_port())]
        log = open(os.path.join(tmp, f"node{len(procs)}.log"), "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      start_new_session=True))
        return procs[-1]

    try:
        head = node("--head", "--port", str(port), "--include-dashboard", "false",
                    "--ray-client-server-port", str(free_port()))
        if not wait_port(port, head):
            pytest.skip(f"the Ray head did not start: {open(os.path.join(tmp, 'node0.log')).read()[-2000:]}")
        node("--address", f"127.0.0.1:{port}")
        yield f"127.0.0.1:{port}", tmp, env
    finally:
        for p in reversed(procs):
            end(p)
        shutil.rmtree(tmp, ignore_errors=True)


def drive(out_root):
    """One attempt on a fresh cluster: (returncode, driver output, rank logs, node names, digits
    result, seconds, failure text or None)."""
    with ray_cluster() as (address, tmp, env):
        out = os.path.join(out_root, f"attempt{len(os.listdir(out_root))}")
        os.mkdir(out)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, DRIVER, address, out], capture_output=True, text=True,
                           timeout=420, env=env, cwd=ROOT)
        wall = time.monotonic() - t0
        text = r.stdout + r.stderr
        logs = {rank: (open(os.path.join(out, f"rank{rank}.log")).read()
                       if os.path.exists(os.path.join(out, f"rank{rank}.log")) else "") for rank in (0, 1)}
        failure = None
        if r.returncode != 0:
            crash = text.find("Fatal Python error")
            failure = (f"the Ray driver exited {r.returncode}:\n"
                       + (text[max(0, crash - 3000):crash + 1500] if crash >= 0 else text[-6000:])
                       + "\n---- rank logs ----\n" + "\n----\n".join(v[-2000:] for v in logs.values())
                       + "\n---- ray start logs ----\n" + node_logs(tmp))
        return r.returncode, text, logs, out, wall, failure


def ray_infrastructure(failure):
    """A failure of Ray itself rather than of a result: a crash of the interpreter, or a cluster
    whose second node never came up."""
    return failure is not None and ("Fatal Python error" in failure or "fewer than 2 alive nodes" in failure)


def test_torchtrainer_matches_horovodrun_with_int8(tmp_path):
    ray_exe()
    hout, ref_json = horovodrun_reference(tmp_path)
    runs = tmp_path / "ray"
    runs.mkdir()
    rc, text, logs, out, wall, failure = drive(str(runs))
    if ray_infrastructure(failure):  # once, on a fresh cluster; said in the output
        print(f"\nRay attempt 1 failed in Ray itself; starting a fresh cluster once:\n{failure[-3000:]}")
        rc, text, logs, out, wall, failure = drive(str(runs))
    if failure is not None:
        pytest.fail(failure)
    seen = checks_passed(logs[0] + logs[1])
    assert all(seen.get(c) == {"0", "1"} for c in CHECKS), (seen, logs)
    assert "size=2 local_size=2 cross_size=1 controller=gloo" in logs[0], logs[0]
    nodes = {open(os.path.join(out, f"node{r}.txt")).read() for r in (0, 1)}
    assert len(nodes) == 2, f"both workers ran on one Ray node: {nodes}"
    assert losses(logs[0]) == losses(hout)  # bit for bit, as under horovodrun
    got, ref = (json.load(open(p)) for p in (os.path.join(out, "digits.json"), ref_json))
    assert (got["size"], got["codec"]) == (2, ref["codec"]), (got, ref)
    assert got["test_accuracy"] == ref["test_accuracy"], (got, ref)
    print(f"\nRay TorchTrainer: losses {' '.join(losses(logs[0]))}; torch_digits int8 test accuracy "
          f"{got['test_accuracy']:.4f} (horovodrun {ref['test_accuracy']:.4f}); driver {wall:.0f} s, "
          + next((ln for ln in text.splitlines() if ln.startswith("RAY_FIT_S")), "RAY_FIT_S ?"))
