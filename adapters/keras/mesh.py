"""``hvd.ProcessMesh`` on the Keras backend's Horovod (horovod.tensorflow or horovod.torch): the
core's mesh (``hvdp.cluster.mesh``) with that Horovod's process sets."""
from hvdp.cluster import topology as _topology
from hvdp.cluster import mesh as _mesh

from .agreement import allgather_fixed
from .backend import BACKEND as _B

_hvd = _B.hvd


def _meet():
    """Every rank of the job meets: horovod.torch's barrier; horovod.tensorflow has none, so an
    allreduce of one number there."""
    if hasattr(_hvd, "barrier"):
        _hvd.barrier()
    else:
        import numpy as np
        _hvd.allreduce(np.zeros(1, np.float32), name="hvdp.exit")


HV = _mesh.HorovodSets(_hvd.rank, _hvd.size, _hvd.ProcessSet, _hvd.add_process_set, _hvd.global_process_set,
                       meet=_meet)


class ProcessMesh(_mesh.ProcessMesh):
    __doc__ = _mesh.ProcessMesh.__doc__
    hv = HV


def hierarchical_process_sets():
    """The process sets ``DistributedOptimizer(..., hierarchical=True)`` needs, for
    ``hvd.init(process_sets=...)`` when dynamic process sets are off (see hvdp.reduce.hierarchy)."""
    return _topology.static_process_sets(HV)


def levels(process_set):
    """(local, cross) collectives of a two-level reduction (``hvdp.cluster.topology.make_levels``)."""
    local, cross, _ = _topology.make_levels(HV, _hvd.cross_rank(), _hvd.local_rank(), allgather_fixed(),
                                             _B.Collectives, process_set)
    return local, cross
