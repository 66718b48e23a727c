"""``hvd.init()`` where the cluster launched the processes: never a silent split.

Which launcher started this process is read from the environment (``detect``, in
``hvdp.cluster.launchers`` with ``plan`` and ``check_size``): Horovod's own
(``horovodrun``), an MPI launcher (``mpirun``, PMI/PMIx), a torchrun-style one (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``: torchrun, Kubeflow Trainer, Ray Train, Spark's
TorchDistributor) or Slurm's ``srun``. For the last two, where Horovod's variables are absent,
``bootstrap`` starts Horovod's Gloo controller as ``horovodrun --gloo`` would: every rank writes its
host name into a bootstrap store reached at the launcher's address, rank 0 computes Horovod's
local/cross ranks from them (``plan``), starts Horovod's own ``RendezvousServer`` with that plan
and publishes its port; each rank then sets the variables horovodrun gives a Gloo worker.
Where no launcher's variables are present but the framework's own process group is already
initialised with several ranks (``torch.distributed.init_process_group`` called by the script, as
``torch.multiprocessing.spawn`` scripts do), the adapter passes its rank and size (``group``) and
the bootstrap runs through that group's store. After Horovod's init, ``check_size`` refuses a job
smaller than the launcher's world.

Framework-free: the store is an argument (``set(key, bytes)``, ``get(key) -> bytes`` that waits;
torch's ``TCPStore`` is one), and Horovod's runner is imported only when rank 0 starts the server.

Example::

    launcher = detect(os.environ)          # Launcher(kind="torchrun", rank=1, size=2, ...)
    plan(["a", "a", "b"])[2]               # Slot(hostname="b", rank=2, local_rank=0, cross_rank=1, ...)
    parse_nodelist("node[01-03,07],gpu5")  # ['node01', 'node02', 'node03', 'node07', 'gpu5']
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from . import cycle
from .launchers import FIX, Launcher, Slot, check_size, detect, env_int, plan

def _route_source(addr: str) -> Optional[str]:
    """The local IPv4 address the kernel would send from to reach ``addr`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> Dict[str, str]:
    """{interface: IPv4 address} of this host (ioctl SIOCGIFADDR on each of ``if_nameindex``)."""
    import fcntl
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                out[name] = socket.inet_ntoa(raw[20:24])
            except OSError:  # no IPv4 address
                pass
    return out


def choose_iface(addr: Optional[str], environ: Mapping[str, str], one_host: bool) -> str:
    """HOROVOD_GLOO_IFACE if set; ``lo`` when every rank is on this host; else the interface
    whose address routes to ``addr`` (the rendezvous host)."""
    if environ.get("HOROVOD_GLOO_IFACE"):
        return environ["HOROVOD_GLOO_IFACE"]
    if one_host:
        return "lo"
    src = _route_source(addr) if addr else None
    if src is None:
        raise RuntimeError(f"hvdp cannot reach the rendezvous host {addr!r} from this host to choose "
                           "Gloo's network interface: export HOROVOD_GLOO_IFACE=<interface>")
    if ipaddress.ip_address(src).is_loopback:
        return "lo"
    for name, ip in interface_addresses().items():
        if ip == src:
            return name
    raise RuntimeError(f"no interface holds {src}, this host's address towards {addr}: export "
                       "HOROVOD_GLOO_IFACE=<interface>")


def horovod_env(slot: Slot, addr: str, port: int, iface: str) -> Dict[str, str]:
    """The variables horovodrun --gloo gives this worker (gloo_run.create_run_env_vars and
    create_slot_env_vars)."""
    return {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": iface,
            "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size)}


# --- the bootstrap ------------------------------------------------------------------------------
_SERVERS: list = []  # rank 0's rendezvous servers: alive as long as the process


def start_rendezvous(slots: Sequence[Slot]) -> int:
    """Horovod's own RendezvousServer, initialised with the plan as horovodrun does; its port."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init([SlotInfo(**s.__dict__) for s in slots])
    _SERVERS.append(server)
    return port


def bootstrap(launcher: Launcher, store, hostname: Optional[str] = None,
              environ: Optional[Mapping[str, str]] = None,
              start: Optional[Callable[[Sequence[Slot]], int]] = None) -> Dict[str, str]:
    """Exchange host names through ``store``, start the rendezvous on rank 0, and return this
    rank's Horovod variables (the caller puts them into ``os.environ`` before Horovod's init)."""
    environ = os.environ if environ is None else environ
    hostname = hostname or environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    rank, size = launcher.rank, launcher.size
    store.set(f"host/{rank}", hostname.encode())
    if rank == 0:
        hosts = [store.get(f"host/{r}").decode() for r in range(size)]
        one_host = len(set(hosts)) == 1
        target = launcher.addr or hosts[0]  # a process group may give no address: rank 0's host
        src = None if one_host else _route_source(target)
        # one host: loopback; else this host's address towards the launcher's host (which is the
        # launcher's address itself when rank 0 runs there and reaches it over lo)
        addr = "127.0.0.1" if one_host else (src if src and not ipaddress.ip_address(src).is_loopback
                                             else target)
        port = (start or start_rendezvous)(plan(hosts))
        store.set("plan", json.dumps({"addr": addr, "port": port, "hosts": hosts}).encode())
    info = json.loads(store.get("plan").decode())
    slots = plan(info["hosts"])
    if slots[rank].hostname != hostname:
        raise RuntimeError(f"rank {rank} is on {hostname} but the bootstrap store says "
                           f"{slots[rank].hostname}: two jobs share {launcher.addr}:{launcher.port}")
    iface = choose_iface(info["addr"], environ, len(set(info["hosts"])) == 1)
    env = horovod_env(slots[rank], info["addr"], info["port"], iface)
    if not environ.get("NCCL_SOCKET_IFNAME"):  # as horovodrun sets it; a user's choice is kept
        env["NCCL_SOCKET_IFNAME"] = iface
    return env


_STORES: list = []     # kept alive: rank 0's may serve the others
_GENERATION = [0]      # a second init (after shutdown) uses fresh keys
_SET: list = []        # the variables each bootstrap of this process put into its environment
STORE_TIMEOUT_S = 300  # how long a rank waits for the others' host names and rank 0's plan


def tcp_store(dist, launcher: Launcher, environ: Optional[Mapping[str, str]] = None):
    """torch's TCPStore at the launcher's address, ``dist`` being ``torch.distributed`` (passed in:
    the core imports no framework): a client of torchrun's agent store where the agent hosts one
    (TORCHELASTIC_USE_AGENT_STORE), else served by rank 0 (multi-tenant, so a later
    init_process_group on the same port shares it). Keys under hvdp/<restart>/<generation>/."""
    import datetime
    environ = os.environ if environ is None else environ
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(launcher.addr, launcher.port, launcher.size,
                          is_master=launcher.rank == 0 and not agent,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S), multi_tenant=True)
    _STORES.append(store)
    _GENERATION[0] += 1
    return dist.PrefixStore(f"hvdp/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_GENERATION[0]}/", store)


def group_store(dist):
    """The store of torch's initialised default process group (``dist`` = ``torch.distributed``),
    keys under hvdp/group/<generation>/: every rank of the group reaches it already."""
    _GENERATION[0] += 1
    return dist.PrefixStore(f"hvdp/group/{_GENERATION[0]}/", dist.distributed_c10d._get_default_store())


def as_launched(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` as the launcher left it: without the Horovod variables this process's own
    bootstrap set (where they are still there unchanged). A second ``hvd.init()`` after
    ``hvd.shutdown()`` must bootstrap a new job, not read them as horovodrun's: that rejoined the
    first job's RendezvousServer, where Horovod 0.28.1 can leave the first job's keys of the local
    scope (its ``finished_list.clear()`` in ``do_DELETE`` drops one rank's finish when another
    scope completes between the two), and a rank that came first connected to the other rank's
    closed address from the first job: Gloo's uncaught IoException ("connect ...: Connection
    refused") aborted Horovod's background thread (seen under Ray Train, tests/parallel/test_ray.py)."""
    for env in reversed(_SET):
        if all(environ.get(k) == v for k, v in env.items()):
            return {k: v for k, v in environ.items() if k not in env}
    return environ


def init(horovod_init: Callable, horovod_size: Callable[[], int], is_initialized: Callable[[], bool],
         comm=None, process_sets=None, make_store: Optional[Callable[[Launcher], object]] = None,
         environ=None, group: Optional[Callable[[], Optional[tuple]]] = None,
         uses_gpu: Callable[[], bool] = lambda: False) -> None:
    """hvdp's ``hvd.init(comm=None, process_sets=None)``: bootstrap Gloo where the launcher needs
    it (``make_store(launcher)`` gives the store; None: refuse naming horovodrun/mpirun), set
    Horovod's cycle time for a job without a GPU where none is set (``hvdp.cluster.cycle``;
    ``uses_gpu()`` says), call Horovod's init, then refuse a job smaller than the launcher's world.
    ``group()``: (rank, size, name) of the framework's initialised process group, or None; used
    where no launcher's variables are present (the store is then the group's, ``make_store`` of a
    ``group`` launcher)."""
    environ = os.environ if environ is None else environ
    launched = as_launched(environ)
    launcher = detect(launched)
    if launcher.kind == "none" and group is not None:
        found = group()
        if found and found[1] > 1:
            launcher = Launcher("group", found[2], found[0], found[1], addr=environ.get("MASTER_ADDR") or None,
                                port=env_int(environ, "MASTER_PORT"), variables=("its rank and world size",))
    if comm is None and launcher.bootstraps and not is_initialized():
        if not launcher.addr and launcher.kind != "group":
            raise RuntimeError(f"{launcher.name} started {launcher.size} processes but gives no "
                               "rendezvous host (MASTER_ADDR, or SLURM_JOB_NODELIST for srun): "
                               f"export MASTER_ADDR and MASTER_PORT, or {FIX}")
        if make_store is None:
            raise RuntimeError(f"{launcher.name} started {launcher.size} processes; hvdp starts "
                               "Horovod's Gloo controller from its variables through torch's "
                               f"TCPStore, and torch is not installed here: {FIX}")
        store = make_store(launcher)
        env = bootstrap(launcher, store, environ=launched)
        _SET.append(env)
        environ.update(env)
    if not is_initialized():
        cycle.apply(uses_gpu, environ)
    horovod_init(comm=comm, process_sets=process_sets)
    if comm is None:
        check_size(launcher, horovod_size())


def describe(environ: Mapping[str, str]) -> List[str]:
    """Lines for ``python -m hvdp doctor``: the launcher detected and what hvdp would set."""
    try:
        la = detect(environ)
    except ValueError as e:
        return [f"launcher: unreadable variables: {e}"]
    lines = [f"launcher: {la.name}" + (f" (rank {la.rank} of {la.size}: {', '.join(la.variables)})"
                                       if la.kind != "none" else "")]
    if la.bootstraps:
        iface = environ.get("HOROVOD_GLOO_IFACE")
        if not iface:
            try:
                iface = f"lo if every rank is on one host, else {choose_iface(la.addr, environ, False)}"
            except RuntimeError as e:
                iface = f"lo if every rank is on one host, else none found ({e})"
            iface += f" (the interface routing to {la.addr})"
        lines.append(f"  hvd.init() starts Horovod's Gloo controller: bootstrap store at {la.addr}:{la.port}, "
                     "rank 0 runs Horovod's RendezvousServer, each rank sets HOROVOD_GLOO_RENDEZVOUS_ADDR/"
                     "PORT, HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_RANK/SIZE/"
                     f"LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE, HOROVOD_HOSTNAME; HOROVOD_GLOO_IFACE={iface}")
    elif la.kind in ("horovod", "mpi"):
        lines.append("  hvd.init() is Horovod's; hvdp sets nothing and checks the size afterwards")
    elif la.kind != "none":
        lines.append("  a one-process job: hvd.init() is Horovod's, hvdp sets nothing")
    return lines
