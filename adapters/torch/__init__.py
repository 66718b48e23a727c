"""``import hvdp.torch as hvd``: everything ``horovod.torch`` offers, plus hvdp's compression.

Example::

    import hvdp.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="int8")
"""
from horovod.torch import *  # noqa: F401,F403  (every public name of horovod.torch)
from horovod.torch import elastic  # noqa: F401

from hvdp import __version__  # noqa: F401
from hvdp.plan import CompressionPolicy  # noqa: F401

from .compression import Compression  # noqa: F401
from .functions import broadcast_optimizer_state  # noqa: F401
from .ops import TorchOps  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
