"""hvdp.torch under Slurm's srun, without horovodrun: a one-node Slurm cluster (Debian's slurm-wlm
and munge) started by the test as root in a private directory (its own munge socket and ports),
two tasks of the torchrun checks; hvd.init() bootstraps Horovod's Gloo controller from SLURM_*
(hvdp.cluster.bootstrap). Skipped, with the reason, where the cluster cannot start."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, checks_passed, horovodrun
from test_torchrun import CHECKS, SCRIPT, clean_env, losses

pytestmark = pytest.mark.parallel
DAEMONS = ("munged", "slurmctld", "slurmd")

CONF = """ClusterName=hvdp
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} CPUs=2 State=UNKNOWN
PartitionName=hvdp Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(d, wait_s=30):
    """End the daemons this test started, by their pid files (never by name), and wait for them."""
    pids = []
    for name in reversed(DAEMONS):
        try:
            with open(os.path.join(d, f"{name}.pid")) as f:
                pids.append(int(f.read().strip()))
            os.kill(pids[-1], signal.SIGTERM)
        except (OSError, ValueError):
            pass
    deadline = time.time() + wait_s
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)


@pytest.fixture
def slurm():
    missing = [p for p in ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
               if not os.path.exists(p)] + [p for p in ("srun", "sinfo") if not shutil.which(p)]
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)} missing): apt-get install slurmctld slurmd "
                    "slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("starting a Slurm cluster needs root")
    if not os.path.exists("/etc/munge/munge.key"):
        pytest.skip("no /etc/munge/munge.key (Debian's munge package creates it)")
    d = tempfile.mkdtemp(prefix="hvdp-slurm-")  # 0700, ours
    os.makedirs(os.path.join(d, "state"))
    os.makedirs(os.path.join(d, "spool"))
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(CONF.format(host=socket.gethostname(), d=d, ctl_port=free_port(), d_port=free_port()))
    env = dict(clean_env(), SLURM_CONF=conf)
    try:
        subprocess.run(["/usr/sbin/munged", "--force", f"--socket={d}/munge.socket",
                        f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                        f"--seed-file={d}/munged.seed", "--key-file=/etc/munge/munge.key"],
                       check=True, timeout=30, capture_output=True)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([f"/usr/sbin/{daemon}", "-f", conf], check=True, timeout=30, env=env,
                           capture_output=True)
        for _ in range(60):
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, timeout=10)
            if r.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            logs = "".join(open(os.path.join(d, f"{n}.log")).read()[-1500:] for n in ("slurmctld", "slurmd")
                           if os.path.exists(os.path.join(d, f"{n}.log")))
            pytest.skip(f"the one-node Slurm cluster did not come up (sinfo: {r.stdout or r.stderr!r}):\n{logs}")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        stop(d)
        pytest.skip(f"could not start {e.cmd[0]}: {getattr(e, 'stderr', b'')!r}")
    try:
        yield env
    finally:
        stop(d)
        shutil.rmtree(d, ignore_errors=True)


def test_srun_two_tasks_match_horovodrun(slurm):
    env = dict(slurm, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        r = subprocess.run(["srun", "-N1", "-n2", "--time=5", sys.executable, SCRIPT], capture_output=True,
                           text=True, timeout=240, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"srun timed out after 240s (a hang):\n{(e.stdout or b'')[-3000:]!r}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    seen = checks_passed(out)
    assert all(seen.get(c) == {"0", "1"} for c in CHECKS), (seen, out[-3000:])
    assert "size=2 local_size=2 cross_size=1 controller=gloo" in out
    # the same five losses, bit for bit, as the same script under horovodrun on this machine (the
    # digits depend on the CPU's float kernels: a number written down on one machine fails on another)
    rc, hout = horovodrun([SCRIPT], controller="gloo", env={})
    assert rc == 0 and all(checks_passed(hout).get(c) == {"0", "1"} for c in CHECKS), hout[-3000:]
    assert losses(out) == losses(hout), (losses(out), losses(hout))
