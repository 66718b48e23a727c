"""``hvd.ProcessMesh`` on horovod.torch: the core's mesh (``hvdp.cluster.mesh``) with Horovod's process sets."""
import horovod.torch as _hvd

from hvdp.cluster import topology as _topology
from hvdp.cluster import mesh as _mesh

from .agreement import allgather_fixed
from .comm import TorchCollectives

HV = _mesh.HorovodSets(_hvd.rank, _hvd.size, _hvd.ProcessSet, _hvd.add_process_set, _hvd.global_process_set,
                       meet=_hvd.barrier)


class ProcessMesh(_mesh.ProcessMesh):
    __doc__ = _mesh.ProcessMesh.__doc__
    hv = HV


def hierarchical_process_sets():
    """The process sets ``DistributedOptimizer(..., hierarchical=True)`` needs, for
    ``hvd.init(process_sets=...)`` when dynamic process sets are off (from the launcher's
    environment: hosts filled with consecutive ranks, as horovodrun and mpirun do)."""
    return _topology.static_process_sets(HV)


def levels(process_set, instance):
    """(local, cross) collectives of a two-level reduction (``hvdp.cluster.topology.make_levels``)."""
    scope = f"hvdp.opt{instance}."
    local, cross, _ = _topology.make_levels(HV, _hvd.cross_rank(), _hvd.local_rank(), allgather_fixed(),
                                             lambda ps: TorchCollectives(ps, scope=scope), process_set)
    return local, cross
