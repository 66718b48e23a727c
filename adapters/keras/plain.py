"""Horovod's own path for hvdp.keras (``hvdp.reduce.reducer.PlainPath``): one allreduce per tensor,
cast to the wire dtype (or through the user's Horovod compressor, as Horovod does), cast back.
Sparse gradients (``tf.IndexedSlices``) are gathered, never compressed, as in Horovod."""
import keras

from .backend import BACKEND as B

FLOATS = ("float16", "bfloat16", "float32", "float64")
_ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
         "int16": 2, "int32": 4, "int64": 8, "bool": 1}


def _dtype(x) -> str:
    return keras.backend.standardize_dtype(x.dtype)


def _nbytes(x) -> int:
    t = x.values if B.is_sparse(x) else x  # IndexedSlices: the values travel
    try:
        n = 1
        for d in t.shape:
            n *= int(d)
    except TypeError:  # a dimension unknown while traced
        return 0
    return n * _ITEM.get(_dtype(t), 4)


class KerasPlain:
    def __init__(self, comm, op: str, predivide: float, sparse_as_dense: bool, compressor=None):
        self.comm, self.op, self.predivide = comm, op, predivide
        self.sparse_as_dense, self.compressor = sparse_as_dense, compressor

    def is_sparse(self, g) -> bool:
        return B.is_sparse(g)

    def dense(self, g):
        return B.dense(g)

    def submit(self, grads, name, wire):
        out = []
        for g in grads:
            if B.is_sparse(g) and self.sparse_as_dense:
                g = B.dense(g)
            ctx, dtype = None, None if B.is_sparse(g) else _dtype(g)
            if dtype is None:
                send = g
            elif self.compressor is not None:  # every step, as hvdp.torch and Horovod do
                send, ctx = self.compressor.compress(g)
            elif dtype not in FLOATS or wire in (None, "float32"):
                send = g
            else:
                send = B.ops.cast(g, wire)
            handle = self.comm.allreduce_async(send, f"hvdp.ar.{name}", self.op, 1.0 / self.predivide,
                                               self.predivide)
            out.append(((handle, ctx, dtype), _nbytes(send)))
        return out

    def finish(self, pending):
        handle, ctx, dtype = pending
        out = self.comm.wait(handle)
        if dtype is None:
            return out
        if self.compressor is not None:
            out = self.compressor.decompress(out, ctx)
        return out if _dtype(out) == dtype else keras.ops.cast(out, dtype)
