"""Spark's TorchDistributor running hvdp (in `make test`; alone: `make spark-check`). `make setup`
installs pyspark and, as root, a Java runtime where none is; without either the test skips and
says which.

TorchDistributor(num_processes=2, local_mode=True, use_gpu=False) on a local SparkSession runs
torchrun on the driver (workers/spark_distributor.py): hvdp's torchrun checks (hvd.init()
bootstraps Horovod's Gloo controller from torchrun's variables; int8), then
examples/torch_digits.py with int8. Both must match horovodrun --gloo: the five losses bit for
bit and the test accuracy."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, WORKERS, checks_passed
from test_torchrun import CHECKS, clean_env, horovodrun_reference, losses

pytestmark = pytest.mark.parallel
DRIVER = os.path.join(WORKERS, "spark_distributor.py")


def test_torchdistributor_matches_horovodrun_with_int8(tmp_path):
    if importlib.util.find_spec("pyspark") is None:
        pytest.skip("pyspark is not installed: `make setup` (scripts/setup.sh) installs it")
    if shutil.which("java") is None:
        pytest.skip("no Java runtime: as root, `make setup` installs Debian's default-jre-headless")
    hout, ref_json = horovodrun_reference(tmp_path)
    out = tmp_path / "spark"
    out.mkdir()
    env = dict(clean_env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # torchrun of this venv
    r = subprocess.run([sys.executable, DRIVER, str(out)], capture_output=True, text=True, timeout=420,
                       env=env, cwd=ROOT)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-6000:]
    seen = checks_passed(text)
    assert all(seen.get(c) == {"0", "1"} for c in CHECKS), (seen, text[-4000:])
    assert "size=2 local_size=2 cross_size=1 controller=gloo" in text, text[-4000:]
    assert losses(text) == losses(hout)  # bit for bit, as under horovodrun
    got, ref = json.load(open(out / "digits.json")), json.load(open(ref_json))
    assert (got["size"], got["codec"]) == (2, ref["codec"]) and got["test_accuracy"] == ref["test_accuracy"], (got, ref)
    times = [ln for ln in text.splitlines() if ln.startswith("SPARK_RUN_S")]
    print(f"\nSpark TorchDistributor: losses {' '.join(losses(text))}; torch_digits int8 test accuracy "
          f"{got['test_accuracy']:.4f} (horovodrun {ref['test_accuracy']:.4f}); {'; '.join(times)}")
