"""hvdp's collectives protocol (``hvdp.collectives``) on horovod.torch's async ops."""
import horovod.torch as _hvd

from hvdp.collectives import AVERAGE, ProcessSetCollectives


class TorchCollectives(ProcessSetCollectives):
    def __init__(self, process_set=_hvd.global_process_set):
        super().__init__(process_set)

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        return _hvd.allreduce_async_(x, name=name, op=_hvd.Average if op == AVERAGE else _hvd.Sum,
                                     prescale_factor=prescale, postscale_factor=postscale,
                                     process_set=self.process_set)

    def alltoall_async(self, buf, name):
        return _hvd.alltoall_async(buf, name=name, process_set=self.process_set)

    def allgather_async(self, buf, name):
        return _hvd.allgather_async(buf, name=name, process_set=self.process_set)

    def wait(self, handle):
        out = _hvd.synchronize(handle)
        return out[0] if isinstance(out, tuple) else out  # alltoall also returns received splits
