"""Which launcher started this process, and what it implies (``hvdp.cluster.bootstrap`` starts
Horovod from it): ``detect`` reads the environment, ``parse_nodelist`` expands Slurm's node
lists, ``plan`` gives every rank Horovod's local/cross ranks from the host names, and
``check_size`` refuses a Horovod job smaller than the launcher's world.

Example::

    launcher = detect(os.environ)          # Launcher(kind="torchrun", rank=1, size=2, ...)
    plan(["a", "a", "b"])[2]               # Slot(hostname="b", rank=2, local_rank=0, cross_rank=1, ...)
    parse_nodelist("node[01-03,07],gpu5")  # ['node01', 'node02', 'node03', 'node07', 'gpu5']
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

HOROVOD_VARS = ("HOROVOD_RANK", "HOROVOD_GLOO_RENDEZVOUS_ADDR")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_BASE_PORT = 29400          # srun without MASTER_PORT: this + SLURM_JOB_ID % 20000
FIX = ("launch with `horovodrun -np N -H host:slots python train.py` (or `--gloo`), or with "
       "`mpirun -np N python train.py`")


@dataclass(frozen=True)
class Launcher:
    """What the environment says about the job. ``kind``: horovod, mpi, torchrun, slurm, group (a
    framework's initialised process group) or none;
    ``size``/``local_size`` None where the launcher does not say; ``addr``/``port``: the bootstrap
    store (torchrun's MASTER_ADDR:MASTER_PORT, or Slurm's first host)."""
    kind: str
    name: str
    rank: int = 0
    size: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    addr: Optional[str] = None
    port: Optional[int] = None
    variables: tuple = ()

    @property
    def bootstraps(self) -> bool:
        """Whether hvdp starts Horovod's Gloo controller itself for this launcher."""
        return self.kind in ("torchrun", "slurm", "group") and (self.size or 1) > 1


@dataclass(frozen=True)
class Slot:
    """One rank's place, as Horovod's ``SlotInfo`` (horovod.runner.common.util.hosts)."""
    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def env_int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw, 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number: the launcher's variables are "
                         "broken; unset it or relaunch") from None


def _seen(environ, names) -> tuple:
    return tuple(n for n in names if n in environ)


def detect(environ: Mapping[str, str]) -> Launcher:
    """The launcher that started this process, from its variables (Horovod's first, then MPI's,
    torchrun's, Slurm's: a torchrun inside an ``srun`` step is torchrun)."""
    e = environ
    if any(n in e for n in HOROVOD_VARS):
        return Launcher("horovod", "horovodrun", env_int(e, "HOROVOD_RANK", 0), env_int(e, "HOROVOD_SIZE"),
                        env_int(e, "HOROVOD_LOCAL_RANK"), env_int(e, "HOROVOD_LOCAL_SIZE"),
                        variables=_seen(e, HOROVOD_VARS + ("HOROVOD_SIZE",)))
    if "OMPI_COMM_WORLD_SIZE" in e:
        return Launcher("mpi", "mpirun (Open MPI)", env_int(e, "OMPI_COMM_WORLD_RANK", 0),
                        env_int(e, "OMPI_COMM_WORLD_SIZE"), env_int(e, "OMPI_COMM_WORLD_LOCAL_RANK"),
                        env_int(e, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                        variables=_seen(e, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")))
    pmi = [n for n in ("PMIX_RANK", "PMI_RANK", "PMI_SIZE") if n in e]
    if pmi:  # PMIx gives no size in the environment: no size check then
        return Launcher("mpi", "an MPI launcher (PMI/PMIx)", env_int(e, pmi[0], 0), env_int(e, "PMI_SIZE"),
                        variables=tuple(pmi))
    if "RANK" in e and "WORLD_SIZE" in e:
        name = "torchrun" if "TORCHELASTIC_RUN_ID" in e else "a torchrun-style launcher"
        return Launcher("torchrun", name, env_int(e, "RANK"), env_int(e, "WORLD_SIZE"), env_int(e, "LOCAL_RANK"),
                        env_int(e, "LOCAL_WORLD_SIZE"), e.get("MASTER_ADDR") or None,
                        env_int(e, "MASTER_PORT"), _seen(e, TORCHRUN_VARS))
    # SLURM_PROCID alone is also set in a batch script's own shell: only an srun step counts
    if "SLURM_PROCID" in e and ("SLURM_STEP_ID" in e or "SLURM_STEP_NUM_TASKS" in e):
        nodelist = next((e[n] for n in SLURM_NODELISTS if e.get(n)), "")
        hosts = parse_nodelist(nodelist) if nodelist else []
        port = env_int(e, "MASTER_PORT") or SLURM_BASE_PORT + (env_int(e, "SLURM_JOB_ID", 0) % 20000)
        size = env_int(e, "SLURM_STEP_NUM_TASKS") or env_int(e, "SLURM_NTASKS")
        return Launcher("slurm", "srun", env_int(e, "SLURM_PROCID"), size, env_int(e, "SLURM_LOCALID"),
                        None, e.get("MASTER_ADDR") or (hosts[0] if hosts else None), port,
                        _seen(e, ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID")
                              + SLURM_NODELISTS + ("MASTER_ADDR", "MASTER_PORT")))
    return Launcher("none", "no launcher (a single process)")


def parse_nodelist(nodelist: str) -> List[str]:
    """Slurm's compressed host list in order: ``node[01-03,07],gpu5`` -> node01 node02 node03
    node07 gpu5 (zero padding kept; several bracket groups in one name expand as a product)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if nodelist[start:i].strip():
                names.extend(_expand(nodelist[start:i].strip()))
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in the Slurm node list {nodelist!r}")
    return names


def _expand(name: str) -> List[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if not m:
        return [name]
    head, tail, out = name[:m.start()], name[m.end():], []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot read {part!r} in the Slurm node list {name!r}")
        width = len(lo)
        out.extend(f"{head}{n:0{width}d}" for n in range(int(lo), int(hi or lo) + 1))
    return [h + t for h in out for t in _expand(tail)] if "[" in tail else [h + tail for h in out]


def plan(hostnames: Sequence[str]) -> List[Slot]:
    """Horovod's placement for ranks whose hosts are ``hostnames[rank]``: local rank = place among
    the host's ranks (in rank order); cross rank = place of the host among those with that local
    rank (hosts in order of their first rank), as ``get_host_assignments`` gives horovodrun."""
    size, by_host, local = len(hostnames), {}, []
    for h in hostnames:
        local.append(by_host.get(h, 0))
        by_host[h] = local[-1] + 1
    cross: Dict[int, List[str]] = {}
    for h, lr in zip(hostnames, local):
        cross.setdefault(lr, []).append(h)
    return [Slot(h, r, lr, cross[lr].index(h), size, by_host[h], len(cross[lr]))
            for r, (h, lr) in enumerate(zip(hostnames, local))]


def check_size(launcher: Launcher, size: int) -> None:
    """Raise when the launcher started more processes than Horovod joined: each would train alone."""
    if launcher.size is None or launcher.size <= size:
        return
    why = {"horovod": "Horovod's variables say otherwise than the job Horovod joined; relaunch "
                      "with horovodrun",
           "mpi": "Horovod did not join the MPI world: it was built without MPI or against another "
                  "MPI than this mpirun's (`python -m hvdp doctor`; rebuild with "
                  "`python -m hvdp install-horovod`)",
           "torchrun": "hvdp bootstraps Horovod's Gloo controller from these variables only inside "
                       "hvdp's hvd.init() without comm=; call hvdp.torch/hvdp.keras's init, not "
                       "horovod's, or " + FIX,
           "slurm": "hvdp bootstraps Horovod's Gloo controller from these variables only inside "
                    "hvdp's hvd.init() without comm=; or " + FIX,
           "group": "hvdp bootstraps Horovod's Gloo controller from an initialised process group only "
                    "inside hvdp's hvd.init() without comm=; call hvdp.torch's init, not horovod's, or "
                    + FIX}[launcher.kind]
    raise RuntimeError(
        f"{launcher.name} started {launcher.size} processes ({', '.join(launcher.variables)}), but "
        f"Horovod initialised a job of size {size}: each process would train alone on its own "
        f"model. Fix: {why}.")


# --- the network interface ----------------------------------------------------------------------
