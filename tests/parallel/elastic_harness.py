"""Drive examples/torch_elastic.py under ``horovodrun --gloo`` elastic mode on fake hosts.

The technique of Horovod's own elastic integration tests: the "hosts" are ``localhost`` and
``127.0.0.1``, both this machine, and the host-discovery script answers from a schedule keyed
on training progress (the number of committed steps, which the job's log shows).
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DISCOVERY = """#!/bin/bash
# hosts by progress: {schedule}
c=$(cat {progress} 2>/dev/null || echo 0)
{cases}
"""


def write_discovery(tmp, schedule):
    """schedule: [(from_commit, ["localhost:2", "127.0.0.1:1"]), ...] in increasing order."""
    progress = os.path.join(tmp, "progress")
    cases = []
    for start, hosts in reversed(schedule):
        lines = "\\n".join(hosts)
        cases.append(f'if [ "$c" -ge {start} ]; then printf "{lines}\\n"; exit 0; fi')
    path = os.path.join(tmp, "discover.sh")
    with open(path, "w") as f:
        f.write(DISCOVERY.format(schedule=schedule, progress=progress, cases="\n".join(cases)))
    os.chmod(path, 0o755)
    return path, progress


def read_records(log_dir):
    records, finals = [], []
    for path in glob.glob(os.path.join(log_dir, "log-*.jsonl")):
        with open(path) as f:
            for line in f:
                # a line without its newline is being written (a long record reaches the file in
                # pieces) or was cut by a kill: not a record (yet)
                if line.strip() and line.endswith("\n"):
                    r = json.loads(line)
                    (finals if "final" in r else records).append(dict(r, file=os.path.basename(path)))
    return records, finals


def committed_steps(records):
    """One record per commit id (all ranks log the same global step); they must agree."""
    by_commit = {}
    for r in records:
        prev = by_commit.setdefault(r["commit"], r)
        assert prev["ids"] == r["ids"] and prev["epoch"] == r["epoch"], \
            f"ranks disagree about committed step {r['commit']}: {prev} vs {r}"
    return [by_commit[k] for k in sorted(by_commit)]


def run(tmp, schedule, np_=2, min_np=2, max_np=3, epochs=3, kill_host=None, kill_after=None,
        step_sleep=0.03, timeout=300, extra=(), script="torch_elastic.py", env_extra=None):
    """Run the elastic job; optionally SIGKILL the worker on ``kill_host`` after ``kill_after``
    committed steps. ``env_extra``: more environment (e.g. KERAS_BACKEND). Returns
    (returncode, output, kill_time or None)."""
    log_dir = os.path.join(tmp, "logs")
    os.makedirs(log_dir, exist_ok=True)
    disc, progress = write_discovery(tmp, schedule)
    env = job_env(env_extra)
    cmd = ["horovodrun", "-np", str(np_), "--min-np", str(min_np), "--max-np", str(max_np),
           "--host-discovery-script", disc, "--elastic-timeout", "60", "--gloo",
           # both fake hosts are this machine: name the interface instead of probing 2 hosts
           "--network-interface", "lo",
           sys.executable, os.path.join(ROOT, "examples", script), "--epochs", str(epochs),
           "--log-dir", log_dir, "--step-sleep", str(step_sleep)] + list(extra)
    out_path = os.path.join(tmp, "out.txt")
    kill_time = None
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        deadline = time.time() + timeout
        try:
            while proc.poll() is None:
                if time.time() > deadline:
                    raise TimeoutError(f"elastic job still running after {timeout}s (a hang)")
                records, _ = read_records(log_dir)
                done = max((r["commit"] for r in records), default=0)
                with open(progress + ".tmp", "w") as f:
                    f.write(str(done))
                os.replace(progress + ".tmp", progress)
                if kill_host and kill_time is None and done >= kill_after:
                    pids = glob.glob(os.path.join(log_dir, f"pid-{kill_host}-*"))
                    assert pids, f"no worker on {kill_host} to kill: {os.listdir(log_dir)}"
                    with open(pids[0]) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
                    kill_time = time.time()
                time.sleep(0.05)
        finally:
            stop(proc)
    with open(out_path) as f:
        return proc.returncode, f.read(), kill_time


def job_env(extra=None):
    """The elastic job's environment: this interpreter's bin first on PATH, one thread each."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    # Gloo's timeout (default 30 s) bounds what still waits on a peer: a restarted worker's
    # rendezvous, a hang. Survivors learn of a killed peer from its closed connections (hvdp's
    # build of Horovod ends every wait of a Gloo context at its first failed connection); 10 s
    # keeps a test that goes wrong short and is still far above a step's time
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "10")
    env.update(extra or {})
    return env


def stop(proc):
    """End horovodrun and every worker it started (its process group), if still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def audit(tmp, num_samples, epochs):
    """Per epoch every sample id exactly once over the committed steps; ranks end identical."""
    records, finals = read_records(os.path.join(tmp, "logs"))
    steps = committed_steps(records)
    for e in range(epochs):
        ids = sorted(i for s in steps if s["epoch"] == e for i in s["ids"])
        assert ids == list(range(num_samples)), \
            f"epoch {e}: {len(ids)} ids, {len(set(ids))} distinct, expected each of {num_samples} once"
    digests = {f["final"] for f in finals}
    assert len(digests) == 1 and finals, f"final parameters differ between ranks: {finals}"
    return steps, finals
