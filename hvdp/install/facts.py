"""What the build depends on, read from the running machine: the interpreter's frameworks, MPI,
the compilers, a CUDA toolkit. Measuring only; :mod:`hvdp.install.recipe` decides.

Frameworks are probed in a subprocess of the target interpreter, so hvdp imports no framework
and a framework that crashes on import is reported rather than taking the installer down.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

# Run by the target interpreter (see probe_frameworks): hvdp itself never imports a framework.
_FRAMEWORK_PROBE = r"""
import importlib, json

def cuda(name, module):  # the CUDA version the framework was built with, "" for a CPU build
    if name == "torch":
        return module.version.cuda or ""
    return module.sysconfig.get_build_info().get("cuda_version", "") or ""

out = {}
for name in ("torch", "tensorflow"):
    try:
        module = importlib.import_module(name)
        out[name] = {"version": module.__version__, "cuda": cuda(name, module)}
    except ImportError:
        pass
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
print("HVDP-FACTS " + json.dumps(out))
"""


@dataclass(frozen=True)
class Framework:
    """A framework found in the target interpreter. ``cuda``: the CUDA version it was built with
    ("" for a CPU build)."""

    name: str
    version: str
    cuda: str = ""

    @property
    def release(self) -> tuple:
        """The numeric release, e.g. (2, 14, 1) for "2.14.1+cu130"."""
        return tuple(int(x) for x in re.findall(r"\d+", self.version.split("+")[0])[:3])


@dataclass(frozen=True)
class Toolkit:
    home: str
    version: str


@dataclass(frozen=True)
class Facts:
    """Everything the recipe decides from. Built by :func:`gather`; tests build it by hand."""

    python: str                                   # "3.11.7"
    python_exe: str
    frameworks: Dict[str, Framework]              # by name: "torch", "tensorflow"
    framework_errors: Dict[str, str] = field(default_factory=dict)
    mpi: Optional[str] = None                     # "Open MPI 4.1.4", "MPICH 4.1", None
    mpi_compiler: bool = False                    # mpicxx / mpicc present (MPI headers usable)
    cxx: Optional[str] = None                     # path of the C++ compiler
    cmake: Optional[str] = None                   # "3.25.1"
    cxx_version: Optional[str] = None             # "GNU 13.3.0", "Clang 17.0.6"
    toolkits: List[Toolkit] = field(default_factory=list)  # CUDA toolkits found (nvcc)


def _run(cmd: List[str], timeout: float = 60) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout + r.stderr


def probe_frameworks(python: str) -> tuple:
    """(frameworks, errors) of the interpreter ``python``."""
    out = _run([python, "-c", _FRAMEWORK_PROBE], timeout=300)
    line = next((ln for ln in out.splitlines() if ln.startswith("HVDP-FACTS ")), None)
    if line is None:
        return {}, {"python": f"{python} did not answer the framework probe: {out.strip()[-300:]}"}
    found, errors = {}, {}
    for name, info in json.loads(line[len("HVDP-FACTS "):]).items():
        if "error" in info:
            errors[name] = info["error"]
        else:
            found[name] = Framework(name, info["version"], info["cuda"])
    return found, errors


def mpi_flavour() -> Optional[str]:
    """"Open MPI 4.1.4" / "MPICH 4.1" / the first line of ``mpirun --version``; None without MPI."""
    if not shutil.which("mpirun"):
        return None
    text = _run(["mpirun", "--version"])
    m = re.search(r"\(Open MPI\)\s*([\d.]+)", text)
    if m:
        return f"Open MPI {m.group(1)}"
    m = re.search(r"Version:\s*([\d.a-z]+)", text)
    if "HYDRA" in text and m:
        return f"MPICH {m.group(1)}"
    first = text.strip().splitlines()
    return first[0].strip() if first else "unknown MPI"


def cxx_version(cxx: Optional[str]) -> Optional[str]:
    """"GNU 13.3.0" / "Clang 17.0.6" from the compiler's ``--version``; None if unknown."""
    if not cxx:
        return None
    text = _run([cxx, "--version"])
    m = re.search(r"clang version ([\d.]+)", text)
    if m:
        return f"Clang {m.group(1)}"
    first = text.splitlines()[0] if text else ""
    m = re.search(r"(\d+\.\d+\.\d+)\s*$", first)  # "c++ (Debian 12.2.0-14) 12.2.0"
    return f"GNU {m.group(1)}" if m and "Free Software Foundation" in text else None


def cmake_version() -> Optional[str]:
    exe = shutil.which("cmake")
    if not exe:
        return None
    m = re.search(r"version\s+([\d.]+)", _run([exe, "--version"]))
    return m.group(1) if m else "unknown"


def nvcc_version(home: str) -> Optional[str]:
    nvcc = os.path.join(home, "bin", "nvcc")
    if not os.access(nvcc, os.X_OK):
        return None
    m = re.search(r"release ([\d.]+),", _run([nvcc, "--version"]))
    return m.group(1) if m else None


def find_toolkits() -> List[Toolkit]:
    """CUDA toolkits: $HOROVOD_CUDA_HOME / $CUDA_HOME when set, else /usr/local/cuda and
    /usr/local/cuda-* (newest first) and the nvcc on PATH."""
    given = os.environ.get("HOROVOD_CUDA_HOME") or os.environ.get("CUDA_HOME")
    if given:
        candidates = [given]
    else:
        versioned = [os.path.join("/usr/local", d) for d in os.listdir("/usr/local")
                     if d.startswith("cuda-")] if os.path.isdir("/usr/local") else []
        versioned.sort(key=lambda p: [int(x) for x in re.findall(r"\d+", p)], reverse=True)
        candidates = ["/usr/local/cuda"] + versioned
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    seen, found = set(), []
    for home in candidates:
        real = os.path.realpath(home)
        if real in seen:
            continue
        seen.add(real)
        ver = nvcc_version(home)
        # a toolkit to build with has the runtime's headers, not only a compiler
        if ver and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            found.append(Toolkit(home, ver))
    return found


def gather(python: str = sys.executable) -> Facts:
    """Read the facts of this machine for the interpreter ``python``."""
    frameworks, errors = probe_frameworks(python)
    pyver = _run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"]).strip()
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    return Facts(
        python=pyver or "unknown", python_exe=python, frameworks=frameworks,
        framework_errors=errors, mpi=mpi_flavour(),
        mpi_compiler=bool(shutil.which("mpicxx") or shutil.which("mpicc")),
        cxx=cxx, cxx_version=cxx_version(cxx), cmake=cmake_version(), toolkits=find_toolkits())
