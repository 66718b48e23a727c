"""The fused CPU codec kernels in real 2-worker torch training (Gloo and MPI): bit-identical to
the array-op path, close to uncompressed training (tests/parallel/workers/kernels_paths.py)."""
import os

import pytest

from conftest import CONTROLLERS, WORKERS, checks_passed, horovodrun

pytestmark = pytest.mark.parallel


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_kernel_and_array_paths_train_the_same(controller):
    pytest.importorskip("torch")
    rc, out = horovodrun([os.path.join(WORKERS, "kernels_paths.py")], controller=controller, timeout=300)
    passed = checks_passed(out)
    for name in ("kernels_int8", "kernels_bf16"):
        assert passed.get(name) == {"0", "1"}, f"{name} not passed on both ranks (rc={rc}):\n{out[-4000:]}"
    assert rc == 0, out[-4000:]


@pytest.mark.parametrize("backend,controller", [("tensorflow", "gloo"), ("torch", "mpi")])
def test_keras_kernel_and_array_paths_train_the_same(backend, controller):
    """hvdp.keras: eager TF runs the kernels on host copies, Keras-on-torch on the tensors."""
    rc, out = horovodrun([os.path.join(WORKERS, "kernels_paths_keras.py")], controller=controller,
                         timeout=300, env={"KERAS_BACKEND": backend})
    passed = checks_passed(out)
    for name in ("keras_kernels_int8", "keras_kernels_bf16"):
        assert passed.get(name) == {"0", "1"}, f"{name} not passed on both ranks (rc={rc}):\n{out[-4000:]}"
    assert rc == 0, out[-4000:]
