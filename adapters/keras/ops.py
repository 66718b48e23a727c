"""hvdp's array-ops protocol (``hvdp.ops.ArrayOps``) filled with TensorFlow ops.

Works eagerly and inside a traced ``tf.function`` (Keras' train step): the fast-path guards
(``all_finite``, ``all_nonnegative``) answer False while tracing, so a codec takes its general
path, which is correct for any data.
"""
import math
import tensorflow as tf

_DT = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16, "float64": tf.float64,
       "int8": tf.int8, "uint8": tf.uint8, "int32": tf.int32, "int64": tf.int64}
_SIZE = {tf.float32: 4, tf.int32: 4, tf.float16: 2, tf.bfloat16: 2, tf.int8: 1, tf.uint8: 1}


def _t(x, like):
    if isinstance(x, (int, float)):
        return tf.constant(x, dtype=getattr(like, "dtype", tf.float32))
    return x


class TFOps:
    name = "tensorflow"
    writable_views = False  # a tensor's .numpy() is a copy: kernels read it, never write into it

    def zeros(self, n, dtype="float32", like=None):
        return tf.zeros([n], dtype=_DT[dtype])

    def empty(self, n, dtype="float32", like=None):
        return self.zeros(n, dtype, like)  # TF has no uninitialised tensors

    def size(self, x):
        shape = x.shape  # a residual an eager kernel wrote is a numpy array (a tuple shape)
        n = shape.num_elements() if hasattr(shape, "num_elements") else math.prod(shape)
        if n is None:
            raise ValueError("hvdp needs static tensor shapes inside tf.function")
        return int(n)

    def reshape(self, x, shape):
        return tf.reshape(x, shape)

    def cat(self, xs):
        return tf.concat([tf.reshape(x, [-1]) for x in xs], axis=0) if len(xs) else tf.zeros([0])

    def cast(self, x, dtype):
        return tf.cast(x, _DT[dtype])

    def dtype(self, x):
        return tf.as_dtype(x.dtype).name

    def to_bytes(self, x):
        x = tf.reshape(x, [-1])
        if x.dtype == tf.uint8:
            return x
        if x.dtype == tf.int8:
            return tf.bitcast(x, tf.uint8)
        return tf.reshape(tf.bitcast(x, tf.uint8), [-1])

    def from_bytes(self, b, dtype):
        dt = _DT[dtype]
        if dt == tf.uint8:
            return b
        if dt == tf.int8:
            return tf.bitcast(b, tf.int8)
        return tf.bitcast(tf.reshape(b, [-1, _SIZE[dt]]), dt)

    def abs(self, x):
        return tf.abs(x)

    def amax_rows(self, x2d):
        return tf.reduce_max(x2d, axis=-1)

    def round(self, x):
        return tf.round(x)  # banker's rounding, like numpy.rint and torch.round

    def clip(self, x, lo, hi):
        return tf.clip_by_value(x, lo, hi)

    def where(self, cond, a, b):
        ref = a if not isinstance(a, (int, float)) else b
        return tf.where(cond, _t(a, ref), _t(b, ref))

    def isfinite(self, x):
        return tf.math.is_finite(x)

    def all_finite(self, x):
        if not tf.executing_eagerly():
            return False
        return bool(tf.math.is_finite(tf.reduce_sum(x)))

    def all_nonnegative(self, x):
        if not tf.executing_eagerly():
            return False
        return bool(tf.reduce_min(x) >= 0) if self.size(x) else True

    def topk_rows(self, score2d, k):
        return tf.cast(tf.math.top_k(score2d, k=k, sorted=True).indices, tf.int32)

    def gather_rows(self, x2d, idx2d):
        return tf.gather(x2d, idx2d, axis=-1, batch_dims=1)

    def scatter_rows(self, rows, cols, idx2d, values2d):
        r = tf.repeat(tf.range(rows, dtype=tf.int32)[:, None], tf.shape(idx2d)[1], axis=1)
        coords = tf.stack([tf.reshape(r, [-1]), tf.reshape(idx2d, [-1])], axis=1)
        return tf.scatter_nd(coords, tf.reshape(tf.cast(values2d, tf.float32), [-1]), [rows, cols])

    # a traced graph has no buffers to write into: the functional forms
    def assemble(self, n, dtype, pieces, like=None):
        parts = [x for _, x in sorted(pieces, key=lambda kv: kv[0])]
        return tf.cast(self.cat(parts), _DT[dtype]) if n else tf.zeros([0], dtype=_DT[dtype])

    def add_(self, a, b):
        return a + b

    def mul_(self, a, s):
        return a * s

    def as_numpy(self, x):
        # eager tensors only: a graph being traced has no data yet (the array ops run there)
        if not tf.executing_eagerly() or not hasattr(x, "numpy"):
            return None
        return x.numpy()

    def from_numpy(self, a, like=None):
        return tf.convert_to_tensor(a)

    # the low-rank codec's (powersgd) optional members, graph-safe (no writes in place)
    def matmul(self, a, b):
        return tf.linalg.matmul(a, b)

    def transpose(self, x2d):
        return tf.transpose(x2d)

    def orthonormalize(self, x2d):
        r = int(x2d.shape[1])
        if r > 2:
            return tf.linalg.qr(x2d)[0]
        cols = [x2d[:, i:i + 1] for i in range(r)]
        for i in range(r):
            # scaled by a power of two first, as the numpy reference (hvdp/ops.py): the float32
            # sum of squares would overflow above ~1.8e19 and underflow below ~1e-19; 2^(127 - E)
            # for the biased exponent E of the largest |value|, kept a normal float32
            big = tf.reduce_max(tf.abs(cols[i]))
            biased = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.bitcast(big, tf.int32), 23), 255)
            scale = tf.bitcast(tf.bitwise.left_shift(tf.clip_by_value(254 - biased, 1, 253), 23), tf.float32)
            ok = tf.logical_and(big > 0, tf.math.is_finite(big))
            cols[i] = cols[i] * tf.where(ok, scale, tf.ones_like(scale))
            norm = tf.norm(cols[i])
            cols[i] = cols[i] / tf.where(norm > 0, norm, tf.ones_like(norm))  # a zero column stays zero
            for j in range(i + 1, r):
                cols[j] = cols[j] - tf.reduce_sum(cols[i] * cols[j], axis=0) * cols[i]
        return tf.concat(cols, axis=1)
