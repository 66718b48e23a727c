"""Lightning's view of a Horovod job: ranks and sizes come from Horovod, and the processes were
started outside Lightning (horovodrun, torchrun, srun), so Lightning never launches any."""
import os

import hvdp.torch as hvd
from lightning.fabric.plugins.environments import ClusterEnvironment


def ensure_init() -> None:
    """``hvd.init()`` unless the script already called it (hvdp's init bootstraps torchrun / srun)."""
    if not hvd.is_initialized():
        hvd.init()


class HorovodEnvironment(ClusterEnvironment):
    """Rank, local rank, node and world size as Horovod reports them.

    Example::

        env = HorovodEnvironment()
        env.global_rank(), env.world_size()      # hvd.rank(), hvd.size()
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        # Horovod rendezvouses by itself; Lightning asks for this only to start torch.distributed
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return "HOROVOD_RANK" in os.environ or hvd.is_initialized()

    def world_size(self) -> int:
        ensure_init()
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        pass  # Horovod's size is the truth; HorovodStrategy refuses a Trainer asking for another

    def global_rank(self) -> int:
        ensure_init()
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        ensure_init()
        return hvd.local_rank()

    def node_rank(self) -> int:
        ensure_init()
        return hvd.cross_rank()
