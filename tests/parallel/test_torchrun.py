"""hvdp.torch under torchrun, without horovodrun: hvd.init() bootstraps Horovod's Gloo controller
from torchrun's variables (hvdp.cluster.bootstrap). Three jobs of one script (int8 checks, five losses):
``horovodrun --gloo`` once for the module, ``torchrun --standalone --nproc-per-node 2``, and two
torchrun "nodes" (``--nnodes 2 --node-rank 0|1 --nproc-per-node 1`` on loopback, the host names
made distinct with HOROVOD_HOSTNAME so that hvdp plans two hosts of one rank each). Each torchrun
job must give horovodrun's losses bit for bit."""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel
SCRIPT = os.path.join(WORKERS, "torchrun_checks.py")
CHECKS = ("size", "allreduce", "int8_step", "ranks_identical")
LAUNCHERS = ("HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_S = 240


def clean_env():
    """This environment without any launcher's variables (the test may itself run under one)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(LAUNCHERS) and k not in TORCHRUN_VARS}


def losses(out):
    found = re.findall(r"LOSSES ((?:[-+.0-9eE]+ ){4}[-+.0-9eE]+)", out)  # five numbers, nothing after
    assert len(found) == 1, out[-3000:]
    return found[0].split()


def horovodrun_reference(tmp_path):
    """The reference another launcher is compared with: (output of the torchrun checks under
    horovodrun --gloo, path of torch_digits.py's int8 result under horovodrun --gloo)."""
    rc, hout = horovodrun([SCRIPT], controller="gloo", env={})
    assert rc == 0 and all(checks_passed(hout).get(c) == {"0", "1"} for c in CHECKS), hout[-3000:]
    ref_json = str(tmp_path / "digits_horovodrun.json")
    rc, dout = horovodrun([os.path.join(ROOT, "examples", "torch_digits.py"), "--compression", "int8",
                           "--quiet", "--json-out", ref_json], controller="gloo", env={})
    assert rc == 0, dout[-3000:]
    return hout, ref_json


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("torchrun not found next to this interpreter: install torch")
    return exe


@pytest.fixture(scope="module")
def horovodrun_losses(torchrun):
    """The reference: the same script under horovodrun --gloo (every check on both ranks)."""
    rc, out = horovodrun([SCRIPT], controller="gloo", env={})
    assert rc == 0 and all(checks_passed(out).get(c) == {"0", "1"} for c in CHECKS), out[-3000:]
    return losses(out)


def run_all(cmds_envs, timeout=TIMEOUT_S):
    """Start every (cmd, env) at once, wait for all; their outputs (a hang fails, killing all)."""
    files = [tempfile.TemporaryFile(mode="w+") for _ in cmds_envs]
    procs = [subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
             for (cmd, env), f in zip(cmds_envs, files)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    hung = [p for p in procs if p.poll() is None]
    for p in hung:
        p.kill()
        p.wait()
    outs = []
    for f in files:
        f.seek(0)
        outs.append(f.read())
        f.close()
    if hung:
        pytest.fail(f"torchrun timed out after {timeout}s (a hang):\n" + "\n----\n".join(o[-2000:] for o in outs))
    return [p.returncode for p in procs], outs


def test_torchrun_matches_horovodrun_with_int8(torchrun, horovodrun_losses):
    env = dict(clean_env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    (rc,), (out,) = run_all([([torchrun, "--standalone", "--nproc-per-node", "2", SCRIPT], env)])
    assert rc == 0, out[-4000:]
    seen = checks_passed(out)
    assert all(seen.get(c) == {"0", "1"} for c in CHECKS), (seen, out[-3000:])
    assert "size=2 local_size=2 cross_size=1 controller=gloo" in out
    assert losses(out) == horovodrun_losses  # the same job, bit for bit, under either launcher


def test_two_node_torchrun_matches_horovodrun_with_int8(torchrun, horovodrun_losses):
    """Two torchrun agents (static rendezvous at 127.0.0.1:port, node 0 hosting the store), one
    process each, on two "hosts": hvdp plans local size 1, cross size 2, cross rank = torchrun's
    GROUP_RANK (checked in the worker), and the job reduces as horovodrun's does."""
    port = free_port()
    jobs = []
    for node in (0, 1):
        env = dict(clean_env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CHECK_NODES="2",
                   HOROVOD_HOSTNAME=f"hvdpnode{node}")
        jobs.append(([torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                      "--master-addr", "127.0.0.1", "--master-port", str(port), SCRIPT], env))
    rcs, outs = run_all(jobs)
    assert rcs == [0, 0], "\n----\n".join(o[-3000:] for o in outs)
    both = "\n".join(outs)
    seen = checks_passed(both)
    assert all(seen.get(c) == {"0", "1"} for c in CHECKS), (seen, both[-3000:])
    assert "rank=0 size=2 local_size=1 cross_size=2 controller=gloo" in outs[0], outs[0][-3000:]
    assert "rank=1 size=2 local_size=1 cross_size=2 controller=gloo" in outs[1], outs[1][-3000:]
    assert losses(outs[0]) == horovodrun_losses
