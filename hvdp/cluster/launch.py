"""``python -m hvdp run ...``: horovodrun with its elastic mistakes caught first.

Without these checks horovodrun accepts an elastic job over MPI, waits on a discovery script that
is missing or not executable until its elastic timeout, or sits silently on min-np > max-np.
Every check here fails at once with what to do; then horovodrun is started with the same args.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import List, Optional

ELASTIC_FLAGS = ("--host-discovery-script", "--min-np", "--min-num-proc", "--max-np", "--max-num-proc")


class LaunchError(ValueError):
    pass


def _value(args: List[str], *names: str) -> Optional[str]:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def _int(args, *names):
    v = _value(args, *names)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise LaunchError(f"{names[0]} {v!r} is not a number") from None


def check_args(args: List[str], probe_timeout: float = 10.0) -> None:
    """Raise :class:`LaunchError` for an elastic launch that cannot work."""
    head = args[:args.index("--")] if "--" in args else args
    if not any(a.split("=")[0] in ELASTIC_FLAGS for a in head):
        return
    if "--mpi" in head:
        raise LaunchError("elastic training needs the Gloo controller and Horovod does not support "
                          "it over MPI: replace --mpi by --gloo")
    script = _value(head, "--host-discovery-script")
    if script is None:
        raise LaunchError("--min-np/--max-np make an elastic job, which needs "
                          "--host-discovery-script PATH (a program printing 'host:slots' lines)")
    if not os.path.isfile(script):
        raise LaunchError(f"host discovery script {script!r} does not exist")
    if not os.access(script, os.X_OK):
        raise LaunchError(f"host discovery script {script!r} is not executable: chmod +x {script}")
    np_ = _int(head, "-np", "--num-proc")
    lo, hi = _int(head, "--min-np", "--min-num-proc"), _int(head, "--max-np", "--max-num-proc")
    if lo is not None and hi is not None and lo > hi:
        raise LaunchError(f"--min-np {lo} is larger than --max-np {hi}: make min-np <= max-np")
    if np_ is not None and ((lo is not None and np_ < lo) or (hi is not None and np_ > hi)):
        raise LaunchError(f"-np {np_} is outside [--min-np {lo}, --max-np {hi}]")
    try:
        r = subprocess.run([os.path.abspath(script)], capture_output=True, text=True, timeout=probe_timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"host discovery script {script!r} did not answer within {probe_timeout:.0f}s; "
                          "it must print the current hosts and exit") from None
    except OSError as e:
        raise LaunchError(f"host discovery script {script!r} cannot run: {e} (a #! line is needed)") from None
    lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not lines or not all(re.fullmatch(r"[\w.\-]+(:\d+)?", ln) for ln in lines):
        raise LaunchError(f"host discovery script {script!r} must exit 0 and print 'host:slots' lines; "
                          f"it exited {r.returncode} and printed {r.stdout.strip()[:200]!r}")


def main(argv: List[str]) -> int:
    try:
        check_args(argv)
    except LaunchError as e:
        print(f"hvdp run: {e}", file=sys.stderr)
        return 2
    exe = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        print("hvdp run: horovodrun not found; run `make setup`", file=sys.stderr)
        return 2
    os.execv(exe, [exe] + argv)
    return 0  # not reached
