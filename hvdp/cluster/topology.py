"""Which ranks share a node, for a two-level reduction (``hvdp.reduce.hierarchy``).

:func:`topology` turns every rank's (cross rank, local rank) into the two families of groups
and refuses layouts it cannot serve (uneven local sizes, ranks numbered across nodes in a way
Horovod's own local/cross ranks contradict); :func:`static_groups` predicts them from a
launcher's environment for ``hvd.init(process_sets=...)``; :func:`make_levels` gathers every
rank's place and gives this rank's (local, cross) collectives.

Example::

    topology([(0, 0), (0, 1), (1, 0), (1, 1)]).local     # ((0, 1), (2, 3))
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


class HierarchyError(ValueError):
    """A two-level reduction that cannot run on this job; the message names the fix."""


@dataclass(frozen=True)
class Topology:
    """Nodes as Horovod sees them: ``local[k]`` the ranks of node k, ``cross[i]`` the ranks with
    local rank i (one per node), both in rank order."""

    local: Tuple[Tuple[int, ...], ...]
    cross: Tuple[Tuple[int, ...], ...]

    @property
    def local_size(self) -> int:
        return len(self.local[0])

    @property
    def cross_size(self) -> int:
        return len(self.local)

    def groups(self) -> List[List[int]]:
        """The groups that need a process set (same order on every rank), without the whole
        world and without singletons: one node (cross sets of one rank) or one rank per node."""
        size = sum(len(g) for g in self.local)
        out = []
        for g in self.local + self.cross:
            if 1 < len(g) < size:
                out.append(list(g))
        return out


def topology(entries: Sequence[Tuple[int, int]]) -> Topology:
    """Every rank's ``(cross_rank, local_rank)``, indexed by rank -> the two families of groups.

    Raises :class:`HierarchyError` where the nodes hold different numbers of ranks or the
    ranks' own numbers contradict each other."""
    nodes: Dict[int, Dict[int, int]] = {}
    for rank, (cross, local) in enumerate(entries):
        node = nodes.setdefault(int(cross), {})
        if int(local) in node:
            raise HierarchyError(f"ranks {node[int(local)]} and {rank} both say they are local rank {local} of "
                                 f"node {cross}: Horovod's local/cross ranks are inconsistent")
        node[int(local)] = rank
    sizes = {k: len(v) for k, v in sorted(nodes.items())}
    if len(set(sizes.values())) > 1:
        per = ", ".join(f"node {k}: {n}" for k, n in sizes.items())
        raise HierarchyError(f"hierarchical=True needs the same number of ranks on every node, but the "
                             f"local sizes are uneven ({per}). Launch the same slots per host (e.g. "
                             f"horovodrun -H a:2,b:2), or use hierarchical=False")
    if sorted(nodes) != list(range(len(nodes))):
        raise HierarchyError(f"cross ranks {sorted(nodes)} are not 0..{len(nodes) - 1}")
    local = tuple(tuple(nodes[k][i] for i in sorted(nodes[k])) for k in sorted(nodes))
    width = len(local[0])
    if any(sorted(nodes[k]) != list(range(width)) for k in nodes):
        raise HierarchyError("local ranks on some node are not 0..local_size-1")
    cross = tuple(tuple(local[k][i] for k in range(len(local))) for i in range(width))
    return Topology(local, cross)


def static_groups(environ: Optional[Mapping[str, str]] = None) -> Optional[Topology]:
    """The topology a launcher will give, from its environment before ``hvd.init``: horovodrun
    (``HOROVOD_SIZE`` / ``HOROVOD_LOCAL_SIZE``) or Open MPI (``OMPI_COMM_WORLD_SIZE`` /
    ``OMPI_COMM_WORLD_LOCAL_SIZE``), hosts filled with consecutive ranks as both do by default.
    None where the environment does not say."""
    env = os.environ if environ is None else environ
    for size_var, local_var in (("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE"),
                                ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        if env.get(size_var) and env.get(local_var):
            size, width = int(env[size_var]), int(env[local_var])
            if width < 1 or size % width:
                raise HierarchyError(f"{local_var}={width} does not divide {size_var}={size}: the nodes hold "
                                     "uneven numbers of ranks; hierarchical=True needs the same number per node")
            return topology([(r // width, r % width) for r in range(size)])
    return None


class _Single:
    """The collectives of a group of one rank: never called (every level skips its collective
    at size 1)."""

    size, rank = 1, 0


STATIC_HINT = "hvd.init(process_sets=hvd.hierarchical_process_sets())"


def static_process_sets(hv, environ=None) -> list:
    """The process sets for ``hvd.init(process_sets=...)`` that ``hierarchical=True`` needs when
    dynamic process sets are off, predicted from the launcher's environment (``static_groups``)."""
    from .mesh import known_process_sets
    topo = static_groups(environ)
    if topo is None:
        raise HierarchyError("hvd.hierarchical_process_sets(): the launcher's environment does not say "
                             "how many ranks each node holds (HOROVOD_SIZE / HOROVOD_LOCAL_SIZE under "
                             "horovodrun, OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE under mpirun); "
                             "use hvd.init(process_sets='dynamic') instead")
    return known_process_sets(hv, topo.groups())


def make_levels(hv, cross_rank: int, local_rank: int, gather, collectives, process_set=None,
                environ=None) -> Tuple[Any, Any, Topology]:
    """This rank's ``(local, cross, topology)`` for a two-level reduction: every rank's place
    gathered, the groups checked, their Horovod process sets found or added (the same calls on
    every rank), each wrapped by ``collectives(process_set)``.

    ``hv``: the adapter's ``hvdp.cluster.mesh.HorovodSets``; ``gather``: ``(bytes, name) -> [bytes]``
    over the whole job; ``process_set``: the optimizer's (only the global one is served)."""
    import struct

    from ..config import elastic_mode
    from .mesh import register_groups
    if elastic_mode(environ):
        raise HierarchyError("hierarchical=True cannot be used in an elastic job: Horovod's elastic mode does "
                             "not keep process sets across a reset. Use hierarchical=False with hvd.elastic")
    if process_set is not None and process_set is not hv.global_process_set and \
            getattr(process_set, "process_set_id", 0) != 0:
        raise HierarchyError("hierarchical=True reduces over the whole job's nodes: it cannot combine "
                             "with process_set= (e.g. a mesh's DP group); use hierarchical=False there")
    got = gather(struct.pack("<ii", int(cross_rank), int(local_rank)), "hvdp.hierarchy.places")
    topo = topology([struct.unpack("<ii", b) for b in got])
    if topo.local_size == 1 or topo.cross_size == 1:
        shape = "one rank per node" if topo.local_size == 1 else "one node"
        import warnings
        warnings.warn(f"hierarchical=True on {shape}: there is nothing to split into two levels, so the "
                      "reduction is the flat one's in two steps", stacklevel=3)
    sets = register_groups(hv, topo.groups(), "hierarchical=True", STATIC_HINT, environ=environ,
                           error=HierarchyError)
    rank, world = hv.rank(), len(got)

    def comm_of(family):
        g = next(g for g in family if rank in g)
        if len(g) == 1:
            return _Single()
        if len(g) == world:
            return collectives(hv.global_process_set)
        return collectives(sets[tuple(sorted(g))])
    return comm_of(topo.local), comm_of(topo.cross), topo
