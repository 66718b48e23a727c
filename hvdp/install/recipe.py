"""The Horovod build recipe: pure decisions from :class:`~hvdp.install.facts.Facts`.

Horovod 0.28.1 (2023) does not build from PyPI's sdist against today's frameworks. The whole fix
is the patch table of :mod:`hvdp.install.patches`, applied to a private copy of the sdist; each pattern must
match (a different sdist fails loudly). The rest is Horovod's own build (its ``HOROVOD_*``).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Tuple

from .facts import Facts, Framework, Toolkit
from .patches import Patch, cxx_standard, patches  # noqa: F401  (re-exported)
from .requirements import SETUPTOOLS, build_requirements  # noqa: F401  (re-exported)

HOROVOD_VERSION = "0.28.1"
# Raise when the build changes in a way the data below does not show (it invalidates the cache).
RECIPE_REVISION = 2
# Releases the recipe was built and tested with here (inclusive, by major.minor). Outside:
# refused unless --force (a newer framework may need another C++ standard or patch).
TESTED = {"torch": ((2, 1), (2, 14)), "tensorflow": ((2, 16), (2, 21))}
# Horovod's CMake names for the frameworks
_CMAKE_NAME = {"torch": "PYTORCH", "tensorflow": "TENSORFLOW"}
MIN_CMAKE = (3, 13)
# Horovod's own run-time requirements (its setup.py), installed beside the wheel
RUNTIME_REQUIREMENTS = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0")


class InstallError(RuntimeError):
    """A build that cannot work here; the message says what to do instead."""


def horovod_import_error(module: str, cause: BaseException) -> ImportError:
    """The error ``hvdp.torch`` / ``hvdp.keras`` raise when Horovod cannot be used: absent, built
    without this framework, or built against another version of it."""
    return ImportError(
        f"{module} needs Horovod built for this environment's framework, and importing it failed "
        f"({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}). "
        "Build and install it here with:  python -m hvdp install-horovod   (`python -m hvdp doctor` "
        "shows what is installed)")


def apply_patch(text: str, patch: Patch) -> str:
    new, n = re.subn(patch.pattern, patch.replacement, text, flags=re.M)
    if n == 0:
        raise InstallError(f"pattern {patch.pattern!r} not found in {patch.path}: this is not the "
                           f"Horovod {HOROVOD_VERSION} sdist the recipe was written for")
    return new


@dataclass(frozen=True)
class BuildPlan:
    """What to build, and why (``reasons``: one line per decision, printed by --dry-run)."""

    horovod: str
    python: str
    frameworks: Tuple[Framework, ...]
    mpi: Optional[str]                      # built with this MPI, or None (Gloo only)
    toolkit: Optional[Toolkit]              # NCCL GPU operations with this CUDA, or None
    reasons: Tuple[str, ...] = field(default=(), compare=False)
    cxx_version: Optional[str] = None       # "GNU 13.3.0": some compilers need patches
    cmake: Optional[str] = None             # "4.4.3": CMake 4 refuses Gloo's old minimum version

    @property
    def gpu(self) -> bool:
        return self.toolkit is not None

    def patches(self) -> Tuple[Patch, ...]:
        return patches(self.frameworks, self.gpu, self.cxx_version)

    def recipe_hash(self) -> str:
        """Identifies exactly what is done to the sources: the patches applied, and the recipe's
        revision (raised when the build changes in a way the patches do not show)."""
        data = [RECIPE_REVISION, [p.__dict__ for p in self.patches()]]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:8]

    def describe(self) -> dict:
        """What a cached wheel was built against (stored beside it)."""
        return {"horovod": self.horovod, "python": self.python, "mpi": self.mpi or "none",
                "gpu": f"cuda{self.toolkit.version}" if self.toolkit else "cpu",
                "frameworks": {f.name: f.version for f in self.frameworks},
                "revision": RECIPE_REVISION, "patches": [p.__dict__ for p in self.patches()]}

    def key(self) -> str:
        """A readable cache key naming every version the wheel is built against."""
        d = self.describe()
        fws = "-".join(f"{n}{v}" for n, v in sorted(d["frameworks"].items()))
        mpi = re.sub(r"[^A-Za-z0-9.]", "", d["mpi"]).lower()
        return f"horovod{self.horovod}-{fws}-py{self.python}-{mpi}-{d['gpu']}-r{self.recipe_hash()}"

    def env(self) -> Dict[str, str]:
        """Horovod's build settings (CUDA/NCCL locations are added by the builder)."""
        names = {f.name for f in self.frameworks}
        env = {"HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MXNET": "1"}
        env["HOROVOD_WITH_MPI" if self.mpi else "HOROVOD_WITHOUT_MPI"] = "1"
        for fw, cm in _CMAKE_NAME.items():
            env[f"HOROVOD_WITH_{cm}" if fw in names else f"HOROVOD_WITHOUT_{cm}"] = "1"
        if self.gpu:
            env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        if int((self.cmake or "0").split(".")[0] or 0) >= 4:
            # Gloo's CMakeLists asks for CMake < 3.5 compatibility, which CMake 4 removed
            env["CMAKE_POLICY_VERSION_MINIMUM"] = "3.5"
        return env

    def covered_by(self, built: dict) -> bool:
        """Whether a wheel built as ``built`` (a :meth:`describe`) serves this plan: the same
        Horovod, Python, MPI, GPU build and recipe revision, every framework here at the same
        version, and every patch of this plan applied (a wheel with one framework more serves an
        environment without it: that extension is simply never loaded)."""
        mine = self.describe()
        if any(built.get(k) != mine[k] for k in ("horovod", "python", "mpi", "gpu", "revision")):
            return False
        return (all(built.get("frameworks", {}).get(n) == v for n, v in mine["frameworks"].items())
                and all(p in built.get("patches", []) for p in mine["patches"]))


def _check_tools(facts: Facts) -> None:
    if not facts.cxx:
        raise InstallError("no C++ compiler found (c++, g++ or clang++ on PATH). Install one: "
                           "`apt-get install -y g++` (Debian/Ubuntu), `dnf install gcc-c++` (Fedora/RHEL) "
                           "or `conda install -c conda-forge cxx-compiler`")
    if not facts.cmake:
        raise InstallError("CMake not found. Install it: `pip install cmake` (into this environment), "
                           "`apt-get install -y cmake` or `conda install -c conda-forge cmake`")
    have = tuple(int(x) for x in re.findall(r"\d+", facts.cmake)[:2])
    if have and have < MIN_CMAKE:
        raise InstallError(f"CMake {facts.cmake} is too old (Horovod needs >= 3.13): `pip install cmake`")


def _frameworks(facts: Facts, wanted: Optional[Iterable[str]], force: bool) -> Tuple[Framework, ...]:
    wanted = list(wanted) if wanted else None
    for name in wanted or []:
        if name not in _CMAKE_NAME:
            raise InstallError(f"unknown framework {name!r}; choose from: {', '.join(_CMAKE_NAME)}")
    for name, err in facts.framework_errors.items():
        if wanted is None or name in wanted:
            raise InstallError(f"{name} is installed in {facts.python_exe} but does not import: {err}. "
                               "Fix that installation first (Horovod is built against it)")
    names = wanted or sorted(facts.frameworks)
    if not names:
        raise InstallError(f"neither torch nor tensorflow is installed in {facts.python_exe}: install "
                           "the framework first (e.g. `pip install torch`), then run this command with "
                           "that environment's python")
    missing = [n for n in names if n not in facts.frameworks]
    if missing:
        raise InstallError(f"--frameworks names {', '.join(missing)}, which {facts.python_exe} cannot "
                           "import: install it there, or leave it out")
    out = []
    for n in names:
        fw = facts.frameworks[n]
        lo, hi = TESTED[n]
        if not lo <= fw.release[:2] <= hi and not force:
            raise InstallError(
                f"{n} {fw.version} is outside the range this recipe is tested with ({n} "
                f"{lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.x): install a version in it, or pass --force to "
                f"try (C++{cxx_standard(fw)} will be used)")
        out.append(fw)
    return tuple(out)


def _toolkit(facts: Facts, fws: Tuple[Framework, ...], gpu: Optional[bool]) -> Optional[Toolkit]:
    if gpu is False:
        return None
    cuda = {f.name: f.cuda for f in fws if f.cuda}
    if gpu and len(cuda) < len(fws):
        cpu = [f"{f.name} {f.version}" for f in fws if not f.cuda]
        raise InstallError(f"--gpu needs CUDA builds of the frameworks, but {', '.join(cpu)} is a CPU "
                           "build: install its CUDA build, or build without --gpu")
    if not cuda:
        return None
    majors = {v.split(".")[0] for v in cuda.values()}
    if len(majors) > 1:
        raise InstallError("the frameworks are built for different CUDA major versions ("
                           + ", ".join(f"{n} CUDA {v}" for n, v in cuda.items()) + "): build each in "
                           "its own environment (--frameworks torch / --frameworks tensorflow)")
    major = majors.pop()
    want = next(iter(cuda.values()))
    for tk in facts.toolkits:
        if tk.version.split(".")[0] == major:
            return tk
    found = ", ".join(f"{t.home} ({t.version})" for t in facts.toolkits) or "none"
    who = ", ".join(f"{f.name} {f.version}" for f in fws if f.cuda)
    raise InstallError(
        f"{who} is a CUDA {want} build, but no CUDA {major} toolkit with nvcc was found (found: {found}). "
        f"Install the CUDA {major} toolkit (e.g. `apt-get install cuda-toolkit-{major}-0` or conda's "
        f"cuda-toolkit={major}) and set CUDA_HOME to it, or build without GPU operations: --cpu")


def decide(facts: Facts, frameworks: Optional[Iterable[str]] = None, gpu: Optional[bool] = None,
           force: bool = False, horovod: str = HOROVOD_VERSION) -> BuildPlan:
    """The build for ``facts``, or :class:`InstallError` naming the fix.

    Args:
        frameworks: build for these only (default: every framework the interpreter has).
        gpu: True: NCCL GPU operations (required); False: CPU only; None: NCCL when the
            frameworks are CUDA builds (a matching toolkit is then required).
        force: allow framework versions outside :data:`TESTED`.

    Example::

        plan = decide(gather(), gpu=False)
        print(plan.key(), *plan.reasons, sep="\\n")
    """
    _check_tools(facts)
    fws = _frameworks(facts, frameworks, force)
    toolkit = _toolkit(facts, fws, gpu)
    reasons = [f"{f.name} {f.version}{' (CUDA ' + f.cuda + ')' if f.cuda else ''}: extension "
               f"compiled as C++{cxx_standard(f)}" for f in fws]
    mpi = facts.mpi if (facts.mpi and facts.mpi_compiler) else None
    if mpi:
        reasons.append(f"controllers: MPI ({mpi}) and Gloo")
    elif facts.mpi:
        reasons.append(f"controllers: Gloo only ({facts.mpi} has no mpicxx/mpicc, so no headers to "
                       "build against; install its development package, e.g. libopenmpi-dev, for MPI)")
    else:
        reasons.append("controllers: Gloo only (no MPI found; install Open MPI, e.g. "
                       "`apt-get install libopenmpi-dev openmpi-bin`, for MPI)")
    if toolkit:
        reasons.append(f"GPU operations: NCCL, compiled with CUDA {toolkit.version} at {toolkit.home}")
    elif gpu is False and any(f.cuda for f in fws):
        reasons.append("GPU operations: none (--cpu), although the framework is a CUDA build")
    else:
        reasons.append("GPU operations: none (CPU builds of the frameworks)")
    return BuildPlan(horovod, facts.python, fws, mpi, toolkit, tuple(reasons),
                     cxx_version=facts.cxx_version, cmake=facts.cmake)
