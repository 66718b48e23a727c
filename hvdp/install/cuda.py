"""The CUDA side of a GPU build: where NCCL is, which GPU architectures to compile for, and the
variables Horovod's CMake reads for them.

NCCL is taken from the framework's own ``nvidia-nccl-cu*`` wheel when there is one (so the
framework and Horovod load one library), else from ``HOROVOD_NCCL_HOME`` or the system.
"""
from __future__ import annotations

import glob
import os
import subprocess
from typing import Dict, Optional, Tuple

from .facts import Toolkit
from .recipe import InstallError

# Horovod compiles its few CUDA kernels for every architecture nvcc knows unless told; this list
# (Turing .. Blackwell) keeps the build short. Each must be one nvcc accepts (CUDA 13 dropped
# everything before sm_75).
DEFAULT_CC_LIST = "75,80,86,89,90,100,120"

_NVIDIA_PATHS = "import nvidia; print('\\n'.join(nvidia.__path__))"


def _wheel_nccl(python: str) -> Optional[Tuple[str, str]]:
    r = subprocess.run([python, "-c", _NVIDIA_PATHS], capture_output=True, text=True)
    for root in r.stdout.split():
        # the header's place differs by wheel generation (nvidia/nccl, nvidia/cu13, ...)
        for header in sorted(glob.glob(os.path.join(root, "**", "include", "nccl.h"), recursive=True)):
            inc = os.path.dirname(header)
            return inc, os.path.join(os.path.dirname(inc), "lib")
    return None


def find_nccl(python: str) -> Tuple[str, str]:
    """(include dir, lib dir) of NCCL, or :class:`InstallError` naming what to install."""
    home = os.environ.get("HOROVOD_NCCL_HOME")
    if home:
        inc, lib = os.path.join(home, "include"), os.path.join(home, "lib")
    else:
        inc, lib = _wheel_nccl(python) or ("/usr/include", "/usr/lib/x86_64-linux-gnu")
    if not os.path.isfile(os.path.join(inc, "nccl.h")):
        raise InstallError(f"no nccl.h in {inc}: install NCCL (`pip install nvidia-nccl-cu13`, or the "
                           "one for your CUDA major; or libnccl-dev) or set HOROVOD_NCCL_HOME")
    if not glob.glob(os.path.join(lib, "libnccl.so*")):
        raise InstallError(f"no libnccl.so* in {lib}: set HOROVOD_NCCL_HOME to the NCCL root")
    return inc, lib


def _cc_list(toolkit: Toolkit) -> str:
    cc = os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST", DEFAULT_CC_LIST)
    r = subprocess.run([os.path.join(toolkit.home, "bin", "nvcc"), "--list-gpu-arch"],
                       capture_output=True, text=True)
    known = {a.replace("compute_", "") for a in r.stdout.split()}
    bad = [c for c in cc.split(",") if known and c not in known]
    if bad:
        raise InstallError(f"nvcc {toolkit.version} cannot build compute_{', compute_'.join(bad)}: set "
                           f"HOROVOD_BUILD_CUDA_CC_LIST to a subset of {','.join(sorted(known, key=int))}")
    return cc


def gpu_env(python: str, toolkit: Toolkit, shim_dir: str) -> Dict[str, str]:
    """The variables for Horovod's NCCL build. ``shim_dir``: a scratch directory for a
    ``libnccl.so`` link when only ``libnccl.so.2`` exists (wheels ship no unversioned name,
    which CMake's find_library wants); nothing installed is written to."""
    inc, lib = find_nccl(python)
    if not os.path.exists(os.path.join(lib, "libnccl.so")):
        so = sorted(glob.glob(os.path.join(lib, "libnccl.so*")))[0]
        os.makedirs(shim_dir, exist_ok=True)
        link = os.path.join(shim_dir, "libnccl.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(so, link)
        lib = shim_dir
    return {"HOROVOD_NCCL_INCLUDE": inc, "HOROVOD_NCCL_LIB": lib,
            # shared: the wheel has no static library, and the framework loads the same one
            "HOROVOD_NCCL_LINK": "SHARED",
            "HOROVOD_CUDA_HOME": toolkit.home, "CUDA_HOME": toolkit.home,
            "PATH": os.path.join(toolkit.home, "bin") + os.pathsep + os.environ.get("PATH", ""),
            "HOROVOD_BUILD_CUDA_CC_LIST": _cc_list(toolkit)}
