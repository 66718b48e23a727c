"""``python -m hvdp doctor``: what this Horovod can do here, and the known pitfalls with their fixes.

The probes run in subprocesses, so a broken extension (an ABI mismatch that crashes on import)
is reported instead of taking the doctor down, and hvdp itself imports no framework.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

from .cluster import bootstrap, cycle
from . import config
from .kernels.registry import kernel_paths

_PROBE = r"""
import json, sys, os
out = {}
try:
    import horovod
    out["horovod_file"] = horovod.__file__
    from horovod.common import util
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"})); sys.exit(0)
mods = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow"}
for fw, mod in mods.items():
    try:
        m = __import__(mod, fromlist=["mpi_built"])
        out[fw] = {"ok": True, "mpi": bool(m.mpi_built()), "gloo": bool(m.gloo_built()),
                   "nccl": bool(m.nccl_built()), "ddl": bool(m.ddl_built()), "ccl": bool(m.ccl_built()),
                   "lib": getattr(m.mpi_ops if hasattr(m, "mpi_ops") else m, "__file__", "")}
    except ImportError as e:
        out[fw] = {"ok": False, "error": str(e)}
    except Exception as e:
        out[fw] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""

_MPI4PY_PROBE = r"""
import json
from mpi4py import MPI
import mpi4py.MPI as m
print(json.dumps({"library": MPI.Get_library_version().strip().splitlines()[0], "file": m.__file__}))
"""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run_probe(code: str, timeout: int = 120) -> dict:
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"probe timed out after {timeout}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"error": f"probe exited {r.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def _libmpi(path: str) -> str | None:
    """The libmpi a shared object resolves to (via ldd), or None."""
    if not path or not os.path.exists(path) or not shutil.which("ldd"):
        return None
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    m = re.search(r"libmpi\.so[.\d]*\s*=>\s*(\S+)", out)
    return os.path.realpath(m.group(1)) if m else None


def _horovod_libs(horovod_file: str) -> dict:
    root = os.path.dirname(horovod_file)
    libs = {}
    for fw in ("torch", "tensorflow"):
        d = os.path.join(root, fw)
        if os.path.isdir(d):
            for f in sorted(os.listdir(d)):
                if f.startswith("mpi_lib") and f.endswith(".so"):
                    libs[fw] = os.path.join(d, f)
    return libs


def _built_against(horovod_file: str) -> dict:
    """The framework versions Horovod was compiled against (its own metadata.json)."""
    try:
        with open(os.path.join(os.path.dirname(horovod_file), "metadata.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


_INSTALL = "run `python -m hvdp install-horovod` in this environment"
_METADATA_NAME = {"torch": "pytorch", "tensorflow": "tensorflow"}


def framework_pitfalls(versions: dict, built_against: dict, loaded: dict) -> list:
    """(problem, fix) pairs for each framework: Horovod built against another version than the
    installed one, or its extension not loading. ``loaded``: per framework {"ok", "error"}."""
    out = []
    for fw, info in loaded.items():
        have, was = versions.get(fw), built_against.get(fw)
        if have and was and was.split("+")[0] != have.split("+")[0]:
            out.append((f"Horovod was built against {fw} {was}, but {fw} {have} is installed now",
                        f"rebuild it for the installed {fw}: " + _INSTALL + " (cached by version)"))
        elif not info["ok"] and have:
            out.append((f"horovod.{fw} does not load: {info['error'][:200]}",
                        _INSTALL + (f" (Horovod was built without {fw})" if not was else "")))
    return out


STALL_ADVICE = "HOROVOD_STALL_CHECK_TIME_SECONDS=60 HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=600"


def hang_settings(environ) -> tuple:
    """(notes, problems) about what ends a job whose ranks stop agreeing: Horovod's stall
    inspector and hvdp's ranks-agree check, read from the environment horovodrun passes on."""
    notes, problems = [], []

    def number(name, default):
        try:
            return float(environ.get(name, default))
        except ValueError:
            problems.append((f"{name}={environ[name]!r} is not a number", f"export {name}=<seconds>"))
            return float(default)

    check = number("HOROVOD_STALL_CHECK_TIME_SECONDS", 60)
    shutdown = number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0)
    if environ.get("HOROVOD_STALL_CHECK_DISABLE", "0") not in ("", "0"):
        problems.append(("HOROVOD_STALL_CHECK_DISABLE is set: a rank that stops submitting makes the "
                         "others wait forever, with no warning", "unset it and export " + STALL_ADVICE))
    elif shutdown <= 0:
        try:
            watchdog = config.stall_timeout_s(environ)
        except ValueError:  # reported by config.problems (diagnose)
            watchdog = 600
        ends = (f"hvdp's watchdog ends a stall in hvdp's collectives, and in Horovod's that the script "
                f"calls through hvdp.torch / hvdp.keras, after {watchdog} s (HVDP_STALL_TIMEOUT_SECONDS), "
                "but nothing ends one in a collective Horovod runs on its own or inside a graph "
                "(hvd.SyncBatchNorm, an allreduce's gradient, a collective in a tf.function)"
                if watchdog > 0 else "with HVDP_STALL_TIMEOUT_SECONDS=0 nothing ends it")
        notes.append("a rank that stops submitting (stuck evaluation, dead data loader) makes the others "
                     f"wait: {ends}; for production export {STALL_ADVICE} (shutdown above your longest "
                     "pause that only some ranks take); Horovod 0.28.1's stall inspector acts over MPI "
                     "only, not over Gloo")
    elif shutdown < check:
        problems.append((f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={shutdown:g} is below "
                         f"HOROVOD_STALL_CHECK_TIME_SECONDS={check:g}: Horovod then never shuts a stalled "
                         "job down", "raise the shutdown time to at least the check time"))
    try:
        agreement_on = config.check_agreement(environ)
    except ValueError:  # a value that is not a boolean: reported by config.problems (diagnose)
        agreement_on = True
    if not agreement_on:
        notes.append("HVDP_CHECK_AGREEMENT=0: ranks that differ in parameters or settings hang in "
                     "their first step instead of failing at once with what differs")
    return notes, problems


# run by a child interpreter (the core itself imports no framework)
_CUDA_KERNEL_PROBE = r"""
import importlib, json
torch = importlib.import_module("torch")
if not torch.cuda.is_available():
    print(json.dumps({"lines": []})); raise SystemExit
import hvdp.torch  # registers the CUDA kernels
from hvdp.kernels.registry import kernel_paths
from hvdp.torch.ops import TorchOps
print(json.dumps({"lines": kernel_paths(TorchOps(), torch.zeros(4, device="cuda"), ("int8",))}))
"""


def _check_mpi4py(hvd_mpi: set, pit: list) -> dict:
    """mpi4py's probe; a pitfall where it does not load or uses another MPI than Horovod's."""
    m4 = _run_probe(_MPI4PY_PROBE)
    m4_lib = _libmpi(m4.get("file", "")) if "error" not in m4 else None
    if "error" in m4:
        pit.append((f"mpi4py does not load: {m4['error']}", "pip install --no-binary mpi4py mpi4py"))
    elif hvd_mpi and m4_lib and m4_lib not in hvd_mpi:
        pit.append((f"mpi4py uses {m4_lib} but Horovod uses {', '.join(sorted(hvd_mpi))}: "
                    "hvd.init(comm=...) will fail or hang",
                    "rebuild mpi4py against the same MPI: pip install --force-reinstall "
                    "--no-binary mpi4py mpi4py"))
    return m4


def diagnose() -> dict:
    """Collect versions, build facts and pitfalls. Pure data; ``main`` prints it."""
    mpirun = shutil.which("mpirun")
    mpi_version = None
    if mpirun:
        first = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout.splitlines()
        mpi_version = first[0].strip() if first else None
    report = {
        "versions": {
            "python": sys.version.split()[0], "hvdp": _version("hvdp"), "horovod": _version("horovod"),
            "torch": _version("torch"),
            "tensorflow": _version("tensorflow-cpu") or _version("tensorflow"),
            "keras": _version("keras"), "mpi4py": _version("mpi4py"), "mpi": mpi_version,
        },
        "pitfalls": [],
        "launcher": bootstrap.describe(os.environ),  # which launcher, what hvd.init() would set
    }
    pit = report["pitfalls"]
    pit.extend(config.problems(os.environ))  # HVDP_* values hvdp would refuse at its first read
    if not report["versions"]["horovod"]:
        pit.append(("Horovod is not installed", _INSTALL + " (it builds Horovod for the frameworks "
                    "installed here; `make setup` does it for the development environment)"))
        report["usable"] = False
        return report
    probe = _run_probe(_PROBE)
    report["probe"] = probe
    if "error" in probe:
        pit.append((f"importing horovod failed: {probe['error']}", _INSTALL))
        report["usable"] = False
        return report
    frameworks = {fw: probe[fw] for fw in ("torch", "tensorflow") if fw in probe}
    built = _built_against(probe["horovod_file"])
    report["built_against"] = {fw: built[_METADATA_NAME[fw]] for fw in frameworks if _METADATA_NAME[fw] in built}
    pit.extend(framework_pitfalls(report["versions"], report["built_against"], frameworks))
    libs = _horovod_libs(probe["horovod_file"])
    hvd_mpi = {_libmpi(p) for p in libs.values()} - {None}
    if report["versions"]["mpi4py"]:
        report["mpi4py"] = _check_mpi4py(hvd_mpi, pit)
    if report["versions"]["keras"] and report["versions"]["keras"].split(".")[0] >= "3":
        report["notes"] = ["horovod.tensorflow.keras does not work on Keras 3 (horovod issue #4290); "
                           "hvdp.keras is the replacement",
                           "Horovod's XLA ops are not built (TF 2.21): keep hvdp's ops out of "
                           "jit_compile=True functions"]
    if os.geteuid() == 0:
        report.setdefault("notes", []).append(
            "running as root: Open MPI needs --allow-run-as-root (horovodrun passes it)")
    report["kernels"] = {"host": kernel_paths()}
    if report["versions"]["torch"]:
        cuda = _run_probe(_CUDA_KERNEL_PROBE)
        if cuda.get("lines"):
            report["kernels"]["cuda"] = cuda["lines"]
    stall_notes, stall_problems = hang_settings(os.environ)
    report.setdefault("notes", []).extend(stall_notes)
    report["notes"].append(cycle.describe(os.environ, uses_gpu="cuda" in report["kernels"]))
    pit.extend(stall_problems)
    ok = [fw for fw, info in frameworks.items() if info["ok"]]
    report["frameworks"] = {fw: frameworks[fw] for fw in ok}
    report["usable"] = bool(ok) and any(frameworks[f]["mpi"] or frameworks[f]["gloo"] for f in ok)
    if not report["usable"]:
        pit.append(("no framework has a working Horovod with MPI or Gloo", _INSTALL))
    return report


def main(argv=None) -> int:
    r = diagnose()
    print("hvdp doctor")
    print("versions:")
    for k, v in r["versions"].items():
        print(f"  {k:<11} {v or 'not installed'}")
    for fw, info in r.get("frameworks", {}).items():
        name = {"torch": "PyTorch", "tensorflow": "TensorFlow"}[fw]
        ctl = [c for c in ("mpi", "gloo") if info[c]]
        ops = [o for o in ("nccl", "ddl", "ccl") if info[o]] + [c for c in ("mpi", "gloo") if info[c]]
        print(f"framework {name:<10} controllers: {', '.join(c.upper() if c == 'mpi' else c.capitalize() for c in ctl)}"
              f"   tensor ops: {', '.join(o.upper() if o != 'gloo' else 'Gloo' for o in ops)}"
              + (f"   built against {fw} {r['built_against'][fw]}" if fw in r.get("built_against", {}) else ""))
    if "mpi4py" in r and "library" in r["mpi4py"]:
        print(f"mpi4py MPI  {r['mpi4py']['library']}")
    for line in r.get("launcher", []):
        print(line)
    for where, lines in r.get("kernels", {}).items():
        print(f"codec kernels ({'host memory' if where == 'host' else 'CUDA tensors'}):")
        for line in lines:
            print(f"  {line}")
    for note in r.get("notes", []):
        print(f"note: {note}")
    for problem, fix in r["pitfalls"]:
        print(f"PROBLEM: {problem}\n  fix: {fix}")
    print("status: " + ("usable" if r["usable"] else "UNUSABLE"))
    return 0 if r["usable"] else 1
