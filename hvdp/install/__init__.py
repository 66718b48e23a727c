"""``python -m hvdp install-horovod``: Horovod built for the environment it runs in.

One recipe for every path (the developer set-up, the GPU image, a user's own environment):
read the interpreter's frameworks, MPI, compilers and CUDA (:mod:`.facts`), decide the build
(:mod:`.recipe`), build Horovod's sdist with hvdp's fixes or take the wheel from the cache
keyed by every version it is built against (:mod:`.build`), install it, and check it.

Example::

    pip install hvdp[torch]
    python -m hvdp install-horovod            # --dry-run shows the decisions first
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Optional

from . import build, facts, recipe
from .recipe import InstallError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hvdp install-horovod",
                                description="Build Horovod for this interpreter's torch / TensorFlow "
                                            "with hvdp's fixes, cache the wheel, install and check it.")
    p.add_argument("--frameworks", help="comma-separated subset of torch,tensorflow (default: all "
                                        "that this interpreter has)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", dest="gpu", action="store_true", default=None,
                   help="NCCL GPU operations (default when the frameworks are CUDA builds)")
    g.add_argument("--cpu", dest="gpu", action="store_false", help="no GPU operations")
    p.add_argument("--sdist", help="build from this Horovod sdist (machines without a package index)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    p.add_argument("--cache-dir", default=None, help="wheel cache (default: $HVDP_CACHE_DIR/wheels "
                                                     "or ~/.cache/hvdp/wheels)")
    p.add_argument("--force", action="store_true", help="allow framework versions outside the tested range")
    p.add_argument("--rebuild", action="store_true", help="build even when the cache has the wheel")
    p.add_argument("--dry-run", action="store_true", help="print what would be built and why, then stop")
    p.add_argument("--no-check", action="store_true", help="skip the checks after installing")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.time()

    def say(msg: str) -> None:
        print(f"[install-horovod {time.time() - t0:4.0f}s] {msg}", flush=True)

    if args.jobs < 1:
        print("install-horovod: --jobs must be >= 1", file=sys.stderr)
        return 2
    cache = args.cache_dir or build.default_cache()
    try:
        found = facts.gather(sys.executable)
        plan = recipe.decide(found, args.frameworks.split(",") if args.frameworks else None,
                             gpu=args.gpu, force=args.force)
        say(f"Horovod {plan.horovod} for {sys.executable} (Python {plan.python})")
        for line in plan.reasons:
            say("  " + line)
        for p in plan.patches():
            say(f"  patch {p.path}: {p.why}")
        hit = None if args.rebuild else build.cached_wheel(cache, plan)
        say(f"  cache key {plan.key()}: " + (f"hit ({hit})" if hit else "miss, will build"))
        if args.dry_run:
            return 0
        if hit is None:
            sdist = build.obtain_sdist(plan, cache, args.sdist, say)
            build.ensure_build_requirements(sys.executable, plan, say)
            os.makedirs(cache, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache, prefix=".build.") as out:
                log = os.path.join(cache, f"build-{plan.key()}.log")
                wheel = build.build_wheel(plan, sdist, out, args.jobs, log, say)
                hit = build.store(cache, plan, wheel)
            os.remove(log)
            say(f"built and cached: {hit}")
        build.install(sys.executable, hit, say)
        if not args.no_check:
            problems = build.check(sys.executable, plan, say)
            if problems:
                for p in problems:
                    print(f"install-horovod: PROBLEM: {p}", file=sys.stderr)
                return 1
    except InstallError as e:
        print(f"install-horovod: {e}", file=sys.stderr)
        return 1
    say("done: " + ", ".join(f"horovod.{f.name}" for f in plan.frameworks) +
        f" ready ({'MPI + ' if plan.mpi else ''}Gloo{' + NCCL' if plan.gpu else ''})")
    return 0
