"""``hvd.ProcessMesh`` on the Keras backend's Horovod (horovod.tensorflow or horovod.torch): the
core's mesh (``hvdp.mesh``) with that Horovod's process sets."""
from hvdp import mesh as _mesh

from .backend import BACKEND as _B

_hvd = _B.hvd


class ProcessMesh(_mesh.ProcessMesh):
    __doc__ = _mesh.ProcessMesh.__doc__
    hv = _mesh.HorovodSets(_hvd.rank, _hvd.size, _hvd.ProcessSet, _hvd.add_process_set,
                           _hvd.global_process_set)
