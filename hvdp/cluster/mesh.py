"""A process mesh: data parallelism as one axis of a DP x TP x PP layout.

Pure bookkeeping (rank <-> coordinates <-> groups); the adapters hand in Horovod's process-set
functions and get back this rank's ``dp``, ``tp`` and ``pp`` process sets. Rank order puts TP
innermost, then DP, then PP::

    rank = tp_index + TP * (dp_index + DP * pp_index)

so a TP group is a run of consecutive ranks (``horovodrun -H host:slots`` fills a host's slots
with consecutive ranks: the chattiest axis stays on one host), a DP group is every TP-th rank of
one pipeline stage, and a PP group holds one rank of each stage.

Example::

    layout = MeshLayout(dp=2, tp=2)          # 4 ranks
    layout.coords(3)                         # Coords(pp=0, dp=1, tp=1)
    layout.groups("dp")                      # [[0, 2], [1, 3]]
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..config import elastic_mode
from . import exits

AXES = ("pp", "dp", "tp")  # outermost first; the order of a rank's digits
HOROVOD_DYNAMIC_PROCESS_SETS = "HOROVOD_DYNAMIC_PROCESS_SETS"


class MeshError(ValueError):
    """A mesh that cannot be built as asked; the message names the fix."""


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class MeshLayout:
    """Axis sizes of a mesh; every rank's coordinates and groups follow from them."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MeshError(f"mesh axis {axis}={v!r}: every axis size must be an int >= 1 "
                                "(use 1 for an axis you do not split)")

    @property
    def size(self) -> int:
        """Number of ranks the mesh spans: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    def check_world(self, world_size: int) -> None:
        """Raise a :class:`MeshError` naming the fix unless the mesh spans exactly ``world_size``."""
        if self.size == world_size:
            return
        hint = []
        for axis in ("dp", "tp", "pp"):
            rest = self.size // getattr(self, axis)
            if world_size % rest == 0:
                hint.append(f"{axis}={world_size // rest}")
        fix = f"; e.g. {' or '.join(hint)} with the other axes unchanged" if hint else ""
        raise MeshError(f"ProcessMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}) spans {self.size} ranks "
                        f"but the job has {world_size}: choose axis sizes whose product is "
                        f"{world_size}{fix}, or launch with -np {self.size}")

    def rank_of(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        for axis, v in zip(AXES, (pp, dp, tp)):
            if not 0 <= v < getattr(self, axis):
                raise MeshError(f"{axis} index {v} outside 0..{getattr(self, axis) - 1}")
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} outside the mesh's 0..{self.size - 1}")
        tp, rest = rank % self.tp, rank // self.tp
        return Coords(pp=rest // self.dp, dp=rest % self.dp, tp=tp)

    def group(self, axis: str, rank: int) -> List[int]:
        """The ranks that share every coordinate with ``rank`` except ``axis`` (in axis order)."""
        self._check_axis(axis)
        c = self.coords(rank)._asdict()
        out = []
        for i in range(getattr(self, axis)):
            c[axis] = i
            out.append(self.rank_of(**c))
        return out

    def groups(self, axis: str) -> List[List[int]]:
        """Every group along ``axis``, ordered by its first rank."""
        self._check_axis(axis)
        seen: Dict[Tuple[int, ...], None] = {}
        for r in range(self.size):
            seen.setdefault(tuple(self.group(axis, r)), None)
        return [list(g) for g in seen]

    def process_set_ranks(self) -> List[List[int]]:
        """The distinct groups that need a Horovod process set, in the same order on every rank:
        dp, tp, pp groups, without repeats (two axes of size 1 give the same singletons) and
        without the whole world (Horovod's global process set already is that one)."""
        seen: Dict[Tuple[int, ...], None] = {}
        for axis in ("dp", "tp", "pp"):
            for g in self.groups(axis):
                if len(g) != self.size:
                    seen.setdefault(tuple(sorted(g)), None)
        return [list(g) for g in seen]

    def table(self) -> str:
        """Which rank holds what, one line per rank (the README's mesh picture)."""
        lines = [f"mesh dp={self.dp} x tp={self.tp} x pp={self.pp} ({self.size} ranks; TP innermost)",
                 "rank  stage(pp)  replica(dp)  shard(tp)  dp group        tp group        pp group"]
        for r in range(self.size):
            c = self.coords(r)
            lines.append(f"{r:>4}  {c.pp:>9}  {c.dp:>11}  {c.tp:>9}  "
                         + "  ".join(f"{str(self.group(a, r)):<14}" for a in ("dp", "tp", "pp")).rstrip())
        return "\n".join(lines)

    @staticmethod
    def _check_axis(axis: str) -> None:
        if axis not in AXES:
            raise MeshError(f"unknown mesh axis {axis!r}: use one of {', '.join(AXES)}")


class HorovodSets(NamedTuple):
    """What a mesh needs from an adapter's Horovod module (horovod.torch, horovod.tensorflow)."""

    rank: Callable[[], int]
    size: Callable[[], int]
    ProcessSet: Callable[[Sequence[int]], Any]
    add_process_set: Callable[[Any], Any]
    global_process_set: Any
    # a blocking collective over the whole job: once process sets smaller than the job are
    # registered, a rank's normal end waits for it (hvdp.cluster.exits); None: no such wait
    meet: Optional[Callable[[], None]] = None


def dynamic_enabled(environ=None) -> bool:
    v = (environ if environ is not None else os.environ).get(HOROVOD_DYNAMIC_PROCESS_SETS, "")
    return v.strip().lower() not in ("", "0", "false", "no", "off")


def elastic_refusal(environ=None) -> Optional[str]:
    """Why a mesh cannot be made in this job (Horovod elastic), or None."""
    if elastic_mode(environ):
        return ("hvdp: a ProcessMesh cannot be used in an elastic job: Horovod's elastic mode does "
                "not keep process sets across a reset (the mesh's groups would silently vanish or "
                "no longer fit the new world size). Launch without --elastic / --host-discovery-script "
                "for DP inside a mesh, or use plain data parallelism (no mesh) with hvd.elastic")
    return None


# Process sets made in this process, by their ranks: a second mesh over the same groups reuses
# them (Horovod refuses a duplicate), and static_process_sets() hands hvd.init the same objects
# that the mesh later finds registered.
_KNOWN: Dict[Tuple[int, ...], Any] = {}


def static_process_sets(hv: HorovodSets, layout: MeshLayout) -> List[Any]:
    """Process set objects for ``hvd.init(process_sets=...)`` (before init; no dynamic sets)."""
    return known_process_sets(hv, layout.process_set_ranks())


def _registered(ps) -> bool:
    return ps is not None and getattr(ps, "process_set_id", None) is not None


def make_process_sets(hv: HorovodSets, layout: MeshLayout, given: Sequence[Any] = (),
                      environ=None) -> Dict[Tuple[int, ...], Any]:
    """Every group of ``layout`` -> a registered Horovod process set (the same calls in the same
    order on every rank: adding a process set is a collective)."""
    why = elastic_refusal(environ)
    if why:
        raise MeshError(why)
    layout.check_world(hv.size())
    what = f"ProcessMesh(dp={layout.dp}, tp={layout.tp}, pp={layout.pp})"
    static = (f"hvd.init(process_sets=hvd.ProcessMesh.static_process_sets(dp={layout.dp}, "
              f"tp={layout.tp}, pp={layout.pp}))")
    sets = register_groups(hv, layout.process_set_ranks(), what, static, given, environ, MeshError,
                           "ProcessMesh(..., process_sets=[...])")
    return {tuple(range(layout.size)): hv.global_process_set, **sets}


def register_groups(hv: HorovodSets, groups: Sequence[Sequence[int]], what: str, static: str,
                    given: Sequence[Any] = (), environ=None, error=MeshError,
                    pass_as: str = "process_sets=[...]") -> Dict[Tuple[int, ...], Any]:
    """Each group (sorted ranks) -> a registered Horovod process set: found among those made
    at ``hvd.init`` or before (``given``, or by this module), else added now (dynamic process
    sets; the same calls in the same order on every rank). ``what`` and ``static`` name the
    caller and its static alternative in the messages; ``error`` is the exception raised."""
    for ps in given:
        if _registered(ps):
            _KNOWN[tuple(sorted(ps.ranks))] = ps
    groups = [sorted(g) for g in groups]
    missing = [g for g in groups if not _registered(_KNOWN.get(tuple(g)))]
    if missing and not dynamic_enabled(environ):
        raise error(
            f"hvdp: {what} needs {len(missing)} process set(s) that Horovod does not have (e.g. ranks "
            f"{missing[0]}), and dynamic process sets are off. Either enable them "
            f"(hvd.init(process_sets='dynamic'), or launch with {HOROVOD_DYNAMIC_PROCESS_SETS}=1 in the "
            f"environment of horovodrun), or register them at start-up: {static}")
    for g in missing:
        try:
            _KNOWN[tuple(g)] = hv.add_process_set(hv.ProcessSet(g))
        except ValueError as e:
            if "duplicate" not in str(e):  # e.g. the variable was set only after hvd.init
                raise error(f"hvdp: Horovod refused to add process set {g} ({e}); dynamic process "
                            "sets must be on when Horovod starts: hvd.init(process_sets='dynamic') "
                            f"or {HOROVOD_DYNAMIC_PROCESS_SETS}=1 before hvd.init") from e
            raise error(f"hvdp: Horovod already has a process set with ranks {g} (registered at "
                        "hvd.init or by hand), which hvdp cannot look up: pass those ProcessSet "
                        f"objects as {pass_as}") from e
    if hv.meet is not None and any(len(g) < hv.size() for g in groups):
        exits.arm(hv.meet)  # the same groups on every rank: every rank arms
    return {tuple(g): _KNOWN[tuple(g)] for g in groups}


def known_process_sets(hv: HorovodSets, groups: Sequence[Sequence[int]]) -> List[Any]:
    """Process set objects for ``hvd.init(process_sets=...)`` (before init), remembered so that
    :func:`register_groups` finds them registered later."""
    out = []
    for g in groups:
        key = tuple(sorted(g))
        ps = _KNOWN.get(key)
        if ps is None:
            ps = _KNOWN[key] = hv.ProcessSet(list(key))
        out.append(ps)
    return out


class ProcessMesh:
    """This rank's place in a DP x TP x PP mesh and its Horovod process sets.

    An adapter subclass sets ``hv`` (its Horovod functions); users reach it as
    ``hvd.ProcessMesh``. Made after ``hvd.init()``, on every rank, with the same sizes.

    Example::

        hvd.init(process_sets="dynamic")   # or static sets: see static_process_sets
        mesh = hvd.ProcessMesh(dp=2, tp=2)
        opt = hvd.DistributedOptimizer(opt, named_parameters=..., compression="int8",
                                       process_set=mesh.dp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=mesh.dp_root, process_set=mesh.dp)
    """

    hv: Optional[HorovodSets] = None

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, process_sets: Sequence[Any] = ()):
        self.layout = MeshLayout(dp=dp, tp=tp, pp=pp)
        self._sets = make_process_sets(self.hv, self.layout, process_sets)
        self.rank = self.hv.rank()
        self.coords = self.layout.coords(self.rank)

    @classmethod
    def static_process_sets(cls, dp: int = 1, tp: int = 1, pp: int = 1) -> List[Any]:
        """The process sets to pass to ``hvd.init(process_sets=...)`` when dynamic ones are off."""
        return static_process_sets(cls.hv, MeshLayout(dp=dp, tp=tp, pp=pp))

    def ranks(self, axis: str) -> List[int]:
        """Global ranks of this rank's group along ``axis``."""
        return self.layout.group(axis, self.rank)

    def process_set(self, axis: str):
        return self._sets[tuple(sorted(self.ranks(axis)))]

    # this rank's groups, as process sets to pass to Horovod's and hvdp's collectives
    dp = property(lambda self: self.process_set("dp"))
    tp = property(lambda self: self.process_set("tp"))
    pp = property(lambda self: self.process_set("pp"))
    # index within each group (= the coordinate) and group sizes
    dp_rank = property(lambda self: self.coords.dp)
    tp_rank = property(lambda self: self.coords.tp)
    pp_rank = property(lambda self: self.coords.pp)
    dp_size = property(lambda self: self.layout.dp)
    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    # Horovod's broadcast takes a *global* root rank even inside a process set
    dp_root = property(lambda self: self.ranks("dp")[0])
    tp_root = property(lambda self: self.ranks("tp")[0])
    pp_root = property(lambda self: self.ranks("pp")[0])

    def __repr__(self) -> str:
        c = self.coords
        return (f"ProcessMesh(dp={self.layout.dp}, tp={self.layout.tp}, pp={self.layout.pp}; rank {self.rank}: "
                f"pp={c.pp} dp={c.dp} tp={c.tp})")
