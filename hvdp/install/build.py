"""Carrying out a :class:`~hvdp.install.recipe.BuildPlan`: the sdist, the patched build, the wheel
cache, the installation and the checks afterwards."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable, List, Optional

from ..config import cache_dir
from .cuda import gpu_env
from .recipe import RUNTIME_REQUIREMENTS, BuildPlan, InstallError, apply_patch, build_requirements

Say = Callable[[str], None]


def default_cache() -> str:
    base = cache_dir() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvdp")
    return os.path.join(base, "wheels")


# --- cache --------------------------------------------------------------------------------------
def cached_wheel(cache: str, plan: BuildPlan) -> Optional[str]:
    """A cached wheel that serves ``plan``: the exact key first, else one whose build covers it
    (see :meth:`BuildPlan.covered_by`)."""
    exact = glob.glob(os.path.join(cache, plan.key(), "horovod-*.whl"))
    if exact:
        return exact[0]
    for meta in sorted(glob.glob(os.path.join(cache, f"horovod{plan.horovod}-*", "build.json"))):
        with open(meta) as f:
            built = json.load(f)
        wheels = glob.glob(os.path.join(os.path.dirname(meta), "horovod-*.whl"))
        if wheels and plan.covered_by(built):
            return wheels[0]
    return None


def store(cache: str, plan: BuildPlan, wheel: str) -> str:
    """Move a built wheel into the cache (atomically: a half-written entry is never found)."""
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".store.", dir=cache)
    shutil.copy2(wheel, tmp)
    with open(os.path.join(tmp, "build.json"), "w") as f:
        json.dump(dict(plan.describe(), key=plan.key(), reasons=list(plan.reasons)), f, indent=1)
    dest = os.path.join(cache, plan.key())
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return os.path.join(dest, os.path.basename(wheel))


# --- build --------------------------------------------------------------------------------------
def _pip(python: str, *args: str, log=None) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *args], stdout=log or subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def obtain_sdist(plan: BuildPlan, cache: str, given: Optional[str], say: Say) -> str:
    """The Horovod sdist: ``given``, else the cache's copy, else downloaded from the index once."""
    if given:
        if not os.path.isfile(given):
            raise InstallError(f"--sdist {given}: no such file")
        return given
    path = os.path.join(cache, "sdists", f"horovod-{plan.horovod}.tar.gz")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path))
        say(f"downloading the Horovod {plan.horovod} sdist")
        r = _pip(sys.executable, "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 f"horovod=={plan.horovod}", "-d", tmp)
        got = glob.glob(os.path.join(tmp, "horovod-*.tar.gz"))
        if r.returncode != 0 or not got:
            shutil.rmtree(tmp, ignore_errors=True)
            raise InstallError(f"could not download horovod=={plan.horovod} ({r.stdout.strip()[-300:]}); "
                               "on a machine without a package index pass --sdist PATH")
        os.replace(got[0], path)
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_build_requirements(python: str, plan: BuildPlan, say: Say) -> None:
    """Horovod's setup.py runs in the target environment (built without isolation, to see the
    installed frameworks): install what :func:`~hvdp.install.recipe.build_requirements` asks for
    there (setuptools, wheel, packaging, cffi for torch; a setuptools too old for the Python)."""
    code = ("import importlib.metadata as m, json\n"
            "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
            "print(json.dumps({n: v(n) for n in ('setuptools', 'wheel', 'packaging', 'cffi')}))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise InstallError(f"could not read the build requirements' versions in {python}: "
                           f"{(r.stderr or r.stdout).strip()[-300:]}")
    needed = build_requirements(plan.python, json.loads(r.stdout.strip().splitlines()[-1]), plan.frameworks)
    if needed:
        specs = [spec for spec, _ in needed]
        say("installing build requirements: " + "; ".join(f"{spec} ({why})" for spec, why in needed))
        r = _pip(python, "install", "--quiet", *specs)
        if r.returncode != 0:
            raise InstallError(f"pip could not install {' '.join(specs)}: {r.stdout.strip()[-300:]}")


def build_wheel(plan: BuildPlan, sdist: str, out: str, jobs: int, log_path: str, say: Say) -> str:
    """Unpack, patch, and build the wheel into ``out``; the compiler's output goes to ``log_path``."""
    work = tempfile.mkdtemp(prefix="hvdp-horovod-")
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(work)
        src = glob.glob(os.path.join(work, "horovod-*"))[0]
        for p in plan.patches():
            path = os.path.join(src, p.path)
            with open(path) as f:
                text = apply_patch(f.read(), p)
            with open(path, "w") as f:
                f.write(text)
        env = dict(os.environ, **plan.env(), MAKEFLAGS=f"-j{jobs}")
        if plan.gpu:
            env.update(gpu_env(sys.executable, plan.toolkit, os.path.join(work, "nccl-shim")))
        say(f"building Horovod {plan.horovod} with {jobs} job(s); log: {log_path}")
        with open(log_path, "w") as log:
            r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                                "-w", out, src], stdout=log, stderr=subprocess.STDOUT, env=env)
        wheels = glob.glob(os.path.join(out, "horovod-*.whl"))
        if r.returncode != 0 or not wheels:
            raise InstallError(f"the Horovod build failed (log: {log_path}):\n{_first_error(log_path)}")
        return wheels[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _first_error(log_path: str, context: int = 14) -> str:
    """The first compiler or CMake error of a build log (the last lines are pip's traceback)."""
    with open(log_path, errors="replace") as f:
        lines = f.readlines()
    # pip's own "error: subprocess-exited-with-error" says nothing about the cause: skip it
    first = next((i for i, ln in enumerate(lines) if re.search(r"CMake Error|\berror:|fatal error", ln)
                  and "subprocess-exited-with-error" not in ln), None)
    shown = lines[first:first + context] if first is not None else lines[-30:]
    return "".join(shown)


# --- install and check --------------------------------------------------------------------------
def install(python: str, wheel: str, say: Say) -> None:
    say(f"installing {os.path.basename(wheel)}")
    r = _pip(python, "install", "--quiet", "--no-deps", "--force-reinstall", wheel)
    if r.returncode == 0:
        r = _pip(python, "install", "--quiet", *RUNTIME_REQUIREMENTS)
    if r.returncode != 0:
        raise InstallError(f"pip install failed: {r.stdout.strip()[-500:]}")


# run by the target interpreter; the framework is imported there by name (hvdp's own modules
# import no framework)
_LOAD = ("import importlib; fw = importlib.import_module({fw!r}); "
         "h = importlib.import_module('horovod.{fw}'); h.init(); ")
_ALLREDUCE = {
    "torch": _LOAD.format(fw="torch")
    + "v = h.allreduce(fw.arange(4.0), op=h.Sum); assert v.tolist() == [0.0, 1.0, 2.0, 3.0], v",
    "tensorflow": _LOAD.format(fw="tensorflow")
    + "v = h.allreduce(fw.range(4.0), op=h.Sum); assert v.numpy().tolist() == [0.0, 1.0, 2.0, 3.0], v",
}


def check(python: str, plan: BuildPlan, say: Say) -> List[str]:
    """``horovodrun --check-build`` and a one-process allreduce per framework; the problems found."""
    problems = []
    bindir = os.path.dirname(python)
    exe = os.path.join(bindir, "horovodrun")
    r = subprocess.run([exe, "--check-build"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", "")))
    lines = [ln for ln in r.stdout.splitlines() if "[X]" in ln or "[ ]" in ln or "Available" in ln]
    say("horovodrun --check-build:\n    " + "\n    ".join(ln.rstrip() for ln in lines))
    wanted = {"torch": "PyTorch", "tensorflow": "TensorFlow"}
    for fw in plan.frameworks:
        if not any("[X]" in ln and wanted[fw.name] in ln for ln in lines):
            problems.append(f"horovodrun --check-build does not list {wanted[fw.name]}")
        # through horovodrun (Gloo is always built), which sets up what init needs
        r = subprocess.run([exe, "-np", "1", "-H", "localhost:1", "--gloo", python, "-c",
                            _ALLREDUCE[fw.name]], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), cwd=tempfile.gettempdir())
        if r.returncode == 0:
            say(f"one-process allreduce with horovod.{fw.name}: ok")
        else:
            problems.append(f"one-process allreduce with horovod.{fw.name} failed: "
                            f"{(r.stderr or r.stdout).strip()[-400:]}")
    for needed, name in ((plan.mpi, "MPI"), (True, "Gloo")):
        if needed and not any("[X]" in ln and ln.strip().endswith(name) for ln in lines):
            problems.append(f"horovodrun --check-build does not list {name}")
    return problems
