"""Two nodes on one machine (scripts/two_node.sh) for tests and benchmarks.

Two network namespaces joined by a throttled veth pair, an sshd in each (own host name), jobs
launched from node A. Horovod and Open MPI take node B for a remote host and start its ranks
through ssh; the bytes between the nodes are node A's veth counters. Needs root (see
``TwoNodeCluster.unavailable()``); one cluster per machine.

    with TwoNodeCluster(rate="1gbit") as c:
        r = c.run(c.horovodrun("gloo") + [sys.executable, "train.py"], timeout=120)
        tx, rx = c.bytes()

``run`` executes on node A with this interpreter's bin directory first on PATH,
OMP_NUM_THREADS=1 and Open MPI's out-of-band channel on the veth, unless ``env`` says otherwise.
"""
import os
import re
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "two_node.sh")


class TwoNodeCluster:
    """Context manager: ``up`` on enter, ``down`` on exit (also after a failure)."""

    names = ("hvdpnodea", "hvdpnodeb")      # host names (each node's `hostname` too)
    addresses = ("10.77.0.1", "10.77.0.2")  # each node's veth address (/24)
    namespaces = ("hvdp-na", "hvdp-nb")     # network namespaces (`ip netns`)
    iface = "hvdp0"                         # the veth end's name, the same in both nodes

    def __init__(self, rate="1gbit", slots=2, port=2222):
        self.rate, self.slots, self.port = rate, slots, port
        self.dir = None
        self.sshd_pids = ()

    @property
    def hosts(self):
        """``-H`` value: 'hvdpnodea:2,hvdpnodeb:2'."""
        return ",".join(f"{n}:{self.slots}" for n in self.names)

    @property
    def np(self):
        return 2 * self.slots

    @staticmethod
    def unavailable():
        """Why the cluster cannot run here (for ``pytest.skip``), or None."""
        try:
            r = subprocess.run(["bash", SCRIPT, "check"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"two_node.sh check failed: {e}"
        if r.returncode == 0:
            return None
        return f"two-node cluster cannot run here: {(r.stdout or r.stderr).strip()}"

    def _script(self, *args, timeout=60):
        env = dict(os.environ, HVDP_TWO_NODE_OWNER=str(os.getpid()),
                   HVDP_TWO_NODE_PORT=str(self.port), PYTHON=sys.executable)
        return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True,
                              timeout=timeout, env=env)

    def up(self):
        self.dir = tempfile.mkdtemp(prefix="hvdp-two-node-")
        r = self._script("up", self.dir, self.rate, timeout=120)
        if r.returncode != 0:
            if os.path.isdir(self.dir) and not os.listdir(self.dir):  # refused before using it
                os.rmdir(self.dir)
            self.dir = None
            raise RuntimeError(f"two_node.sh up failed:\n{r.stdout}{r.stderr}")
        self.sshd_pids = tuple(int(_read(os.path.join(self.dir, n, "sshd.pid")) or 0) for n in "ab")
        return self

    def down(self):
        """Remove everything ``up`` made; returns what is left (``leftovers()``)."""
        if self.dir is not None:
            r = self._script("down", self.dir, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"two_node.sh down failed:\n{r.stdout}{r.stderr}")
        return self.leftovers()

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        left = self.down()
        if left and exc[0] is None:
            raise RuntimeError(f"two_node.sh down left: {left}")

    def leftovers(self):
        """What of this cluster still exists: namespaces, /etc/hosts lines, ssh config, state
        directory, running sshd (empty after ``down``)."""
        left = []
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        left += [f"netns {ns}" for ns in self.namespaces if re.search(rf"^{ns}\b", netns, re.M)]
        left += [f"/etc/hosts: {line}" for line in _read("/etc/hosts").splitlines()
                 if "# hvdp-two-node" in line and (self.dir is None or self.dir in line)]
        if os.path.exists("/etc/ssh/ssh_config.d/hvdp-two-node.conf"):
            left.append("/etc/ssh/ssh_config.d/hvdp-two-node.conf")
        if self.dir and os.path.exists(self.dir):
            left.append(f"state {self.dir}")
        for pid in self.sshd_pids:  # gone, or at most a zombie waiting for init
            if pid and _read(f"/proc/{pid}/stat").split(") ")[-1][:1] not in ("", "Z"):
                left.append(f"sshd {pid}")
        return left

    def env(self, extra=None):
        """The environment ``run`` gives a job."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                   OMPI_MCA_oob_tcp_if_include=self.iface)  # horovodrun --mpi sets btl's only
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
        env.update(extra or {})
        return env

    def run(self, cmd, timeout=180, env=None, cwd=None):
        """Run ``cmd`` on node A; CompletedProcess with stdout and stderr together in ``stdout``.
        On timeout the whole process group is killed and TimeoutExpired raised (with output)."""
        if self.dir is None:
            raise RuntimeError("the cluster is not up")
        p = subprocess.Popen(["bash", SCRIPT, "exec", self.dir, *cmd], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=self.env(env),
                             cwd=cwd or ROOT, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out)
        return subprocess.CompletedProcess(cmd, p.returncode, out, None)

    def bytes(self):
        """(tx, rx): bytes node A's veth end has sent and received since ``up``."""
        r = self._script("bytes", self.dir, timeout=30)
        m = re.fullmatch(r"tx=(\d+) rx=(\d+)", r.stdout.strip())
        if r.returncode != 0 or not m:
            raise RuntimeError(f"two_node.sh bytes failed: {r.stdout}{r.stderr}")
        return int(m.group(1)), int(m.group(2))

    def speed(self, seconds=1.0):
        """Measured TCP throughput A -> B in bit/s (one stream, for ``seconds``)."""
        r = self._script("speed", self.dir, str(seconds), timeout=seconds + 60)
        m = re.search(r"A->B (\d+) Mbit/s", r.stdout)
        if r.returncode != 0 or not m:
            raise RuntimeError(f"two_node.sh speed failed: {r.stdout}{r.stderr}")
        return int(m.group(1)) * 1e6

    def horovodrun(self, controller="gloo", np=None):
        """horovodrun's launch prefix for this cluster; append the program and its arguments."""
        exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        return [exe, "-np", str(np or self.np), "-H", self.hosts, "-p", str(self.port),
                f"--{controller}", "--network-interfaces", self.iface, "--start-timeout", "60"]

    def mpirun(self, np=None, export=("OMP_NUM_THREADS", "PATH", "PYTHONPATH", "PYTHONUNBUFFERED")):
        """Plain Open MPI launch prefix (the flags horovodrun --mpi uses, and the out-of-band
        channel on the veth too); ssh's port comes from the ssh config two_node.sh writes."""
        cmd = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(np or self.np),
               "-H", self.hosts, "-bind-to", "none", "-map-by", "slot",
               "-mca", "pml", "ob1", "-mca", "btl", "^openib,ofi",
               "-mca", "btl_tcp_if_include", self.iface, "-mca", "oob_tcp_if_include", self.iface]
        env = self.env()
        for name in export:
            if name in env:  # mpirun warns about a name that is not set
                cmd += ["-x", name]
        return cmd


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
