"""hvdp in an environment of the user's: a fresh venv with only torch (no TensorFlow), hvdp's
wheel installed by pip, Horovod by ``python -m hvdp install-horovod``, then the main job."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

from hvdp.install.build import default_cache

pytestmark = pytest.mark.parallel

TORCH = next(ln.split("==")[1].split()[0] for ln in open(os.path.join(ROOT, "requirements", "deps.txt"))
             if ln.startswith("torch=="))


def run(cmd, timeout, **kw):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd[:4])} ... did not finish in {timeout}s: {e.stdout}")
    return r.returncode, r.stdout + r.stderr


# A cold cache builds Horovod (minutes on 2 cores); with `make setup` done it is a cache hit.
@pytest.mark.timeout(2400)
def test_fresh_torch_only_venv_pip_install_then_install_horovod(tmp_path):
    rc, out = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                   "-w", str(tmp_path / "dist"), ROOT], 300)
    assert rc == 0, out
    wheel = next((tmp_path / "dist").glob("hvdp-*.whl"))
    venv = tmp_path / "venv"
    rc, out = run([sys._base_executable, "-m", "venv", str(venv)], 120)
    assert rc == 0, out
    py, bindir = str(venv / "bin" / "python"), str(venv / "bin")
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    rc, out = run([py, "-m", "pip", "install", "--quiet", f"torch=={TORCH}", f"{wheel}[torch,examples]"],
                  900, env=env)
    assert rc == 0, out

    # the venv holds hvdp's own copy, torch, and no TensorFlow and no Horovod
    rc, out = run([py, "-c", "import hvdp, importlib.util as u; print(hvdp.__file__); "
                   "print(u.find_spec('tensorflow'), u.find_spec('horovod'))"], 60, env=env, cwd=tmp_path)
    assert rc == 0 and venv in Path(out.splitlines()[0]).parents and "None None" in out, out
    # without Horovod: an ImportError that names the command, and the doctor says the same
    rc, out = run([py, "-c", "import hvdp.torch"], 120, env=env, cwd=tmp_path)
    assert rc != 0 and "ImportError" in out and "python -m hvdp install-horovod" in out, out
    rc, out = run([py, "-m", "hvdp", "doctor"], 300, env=env, cwd=tmp_path)
    assert rc == 1 and "python -m hvdp install-horovod" in out and "UNUSABLE" in out, out

    rc, out = run([py, "-m", "hvdp", "install-horovod", "--cache-dir", default_cache()], 2300,
                  env=env, cwd=tmp_path)
    assert rc == 0, out
    assert "compiled as C++17" in out and "horovod.torch ready (MPI + Gloo)" in out, out
    assert "[X] PyTorch" in out and "one-process allreduce with horovod.torch: ok" in out, out
    print(out)  # shows (with -s) whether the cache served the wheel

    res = tmp_path / "res.json"
    rc, out = run([os.path.join(bindir, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", py,
                   os.path.join(ROOT, "examples", "torch_digits.py"), "--compression", "int8", "--quiet",
                   "--json-out", str(res)], 600, env=env, cwd=tmp_path)
    assert rc == 0, out[-3000:]
    got = json.loads(res.read_text())
    assert got["size"] == 2 and got["test_accuracy"] >= 0.90 and got["wire_ratio"] < 0.5, got
