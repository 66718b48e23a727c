"""hvdp's collectives protocol on horovod.tensorflow's ops (TF executes them asynchronously)."""
import re

import horovod.tensorflow as _hvd

from hvdp.reduce.collectives import AVERAGE, ProcessSetCollectives


def op_name(name: str) -> str:
    """A TF op name made of a variable path ("dense/kernel:0" -> "dense/kernel_0")."""
    return re.sub(r"[^A-Za-z0-9_./-]", "_", name).lstrip("_/") or "t"


class TFCollectives(ProcessSetCollectives):
    def __init__(self, process_set=_hvd.global_process_set):
        super().__init__(process_set)

    def allreduce_async(self, x, name, op, prescale=1.0, postscale=1.0):
        return _hvd.allreduce(x, op=_hvd.Average if op == AVERAGE else _hvd.Sum,
                              prescale_factor=prescale, postscale_factor=postscale,
                              name=op_name(name), process_set=self.process_set)

    def alltoall_async(self, buf, name):
        return _hvd.alltoall(buf, name=op_name(name), process_set=self.process_set)

    def allgather_async(self, buf, name):
        return _hvd.allgather(buf, name=op_name(name), process_set=self.process_set)

    def wait(self, handle):
        return handle
