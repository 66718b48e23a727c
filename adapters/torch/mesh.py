"""``hvd.ProcessMesh`` on horovod.torch: the core's mesh (``hvdp.mesh``) with Horovod's process sets."""
import horovod.torch as _hvd

from hvdp import mesh as _mesh


class ProcessMesh(_mesh.ProcessMesh):
    __doc__ = _mesh.ProcessMesh.__doc__
    hv = _mesh.HorovodSets(_hvd.rank, _hvd.size, _hvd.ProcessSet, _hvd.add_process_set,
                           _hvd.global_process_set)
