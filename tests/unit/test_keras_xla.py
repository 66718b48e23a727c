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
