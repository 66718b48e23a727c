"""hvdp.keras under XLA (one process, Horovod of size 1: the refusals come while tracing)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

TAPE_UNDER_XLA = """
import tensorflow as tf
import hvdp.keras as hvd
hvd.init()
w = tf.Variable(tf.ones([4]))

@tf.function(jit_compile=True)
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    return hvd.DistributedGradientTape(tape).gradient(loss, [w])

try:
    step()
except Exception as e:
    print("ERROR", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
else:
    print("NO ERROR")
"""


def run(code):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    return r.stdout + r.stderr


def test_tape_under_xla_gets_hvdp_refusal():
    out = run(TAPE_UNDER_XLA)
    assert "ERROR RuntimeError hvdp.keras: DistributedGradientTape.gradient is XLA-compiled" in out, out[-3000:]
    assert "jit_compile=False" in out and "OpKernel" not in out, out[-3000:]


# What Keras does on a GPU node, simulated: its "auto" resolution sees a non-CPU device and
# picks XLA. Plain Keras must then say True (else the simulation shows nothing); hvdp's optimizer
# must make it False and train, and an explicit jit_compile=True must still be refused.
AUTO_ON_GPU = """
from unittest import mock
import numpy as np, keras, tensorflow as tf
import hvdp.keras as hvd
hvd.init()
GPU = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
real = tf.config.list_physical_devices

def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

def compiled(opt, **kw):
    m = model()
    with mock.patch.object(tf.config, "list_physical_devices", lambda *a: real(*a) + [GPU]):
        m.compile(optimizer=opt, loss="mse", **kw)
    return m

x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
print("PLAIN", compiled(keras.optimizers.SGD(0.1)).jit_compile)
m = compiled(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
print("HVDP", m.jit_compile)
w0 = m.get_weights()[0].copy()
m.fit(x, y, batch_size=4, epochs=1, verbose=0)
print("TRAINED", not np.array_equal(w0, m.get_weights()[0]))
print("PLAIN AGAIN", compiled(keras.optimizers.SGD(0.1)).jit_compile)
m = compiled(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), jit_compile=True)
try:
    m.fit(x, y, batch_size=4, epochs=1, verbose=0)
except RuntimeError as e:
    print("EXPLICIT", str(e).splitlines()[0])
"""


def test_auto_jit_compile_on_gpu_resolves_to_no_xla_for_hvdp():
    out = run(AUTO_ON_GPU)
    assert "PLAIN True" in out, out[-3000:]  # Keras itself picks XLA on the simulated GPU node
    assert "HVDP False" in out and "TRAINED True" in out, out[-3000:]
    assert "PLAIN AGAIN True" in out, out[-3000:]  # other models keep Keras' choice
    assert "EXPLICIT hvdp.keras: the train step is XLA-compiled" in out, out[-3000:]
