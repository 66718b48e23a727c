"""The two-level stage of ``make bench``: 4 ranks on a two-node cluster (network namespaces, a veth
pair throttled to ``--rate`` between the nodes, sshd per node: scripts/two_node.sh), each method's
step time and the bytes that cross the inter-node link per step (veth counters), side by side.

    python benchmarks/two_level.py [--runs mpi:1gbit,gloo:1gbit,mpi:100mbit] [--report-only]

Each run is a controller (Horovod over MPI: shared memory inside a node, TCP between; or Gloo:
TCP everywhere) and a rate between the nodes. Writes ``results/two_level_<controller>_<rate>.json``
and ``results/two_level.md``; needs root (skipped with the reason otherwise). Targets (issue 23),
at 1 Gbit/s: int8 two-level ÷ int8 flat inter-node bytes ≤ 0.55; step time int8 two-level
≤ 0.7 × int8 flat and ≤ 0.35 × none flat. 100 Mbit/s: the same methods where the link, not
these two cores, sets the step time (exchange : compute as on a GPU cluster).
"""
import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RES = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(ROOT, "tests", "parallel"))
from two_node import TwoNodeCluster  # noqa: E402

BYTES_TARGET, FLAT_TARGET, NONE_TARGET = 0.55, 0.7, 0.35
RUNS = (("mpi", "1gbit"), ("gloo", "1gbit"), ("mpi", "100mbit"))


def spread(xs):
    """(median, min, max) of a list."""
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2]), s[0], s[-1]


def paired(a, b):
    """Median and range of the per-round ratios a[i] / b[i] (rounds interleave the methods)."""
    return spread([x / y for x, y in zip(a, b)])


def run(controller, rate, out_json, extra=()):
    why = TwoNodeCluster.unavailable()
    if why:
        res = {"skipped": why}
    else:
        with TwoNodeCluster(rate=rate) as c:
            bps = c.speed(0.5)
            job = os.path.join(HERE, "two_level_bench.py")
            r = c.run(c.horovodrun(controller) + [sys.executable, job, "--iface", c.iface, "--json-out", out_json,
                                              *extra], timeout=1800)
            if r.returncode != 0:
                raise SystemExit(f"two_level_bench failed:\n{r.stdout[-4000:]}")
            with open(out_json) as f:
                res = json.load(f)
            res.update(rate=rate, controller=controller, measured_mbit_s=bps / 1e6)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)
    return res


def rows(res, where=""):
    """(measurement, value, target, met) rows; targets apply at 1 Gbit/s."""
    if "skipped" in res:
        return [(f"{where}two-level stage", "skipped: " + res["skipped"], "—", None)]
    m = res["methods"]
    target = res.get("rate") == "1gbit"
    out = []
    for name, v in m.items():
        med, lo, hi = spread(v["step_s"])
        cb, cblo, cbhi = spread(v["cross_bytes"])
        out.append((f"{where}{name}: step time (s); inter-node MB per step",
                    f"{med:.3f} [{lo:.3f}, {hi:.3f}]; {cb / 1e6:.1f} [{cblo / 1e6:.1f}, {cbhi / 1e6:.1f}]", "—", None))
    if "int8" in m and "int8 2L" in m:
        b = paired(m["int8 2L"]["cross_bytes"], m["int8"]["cross_bytes"])
        out.append((f"{where}inter-node bytes, int8 two-level ÷ int8 flat", f"{b[0]:.3f} [{b[1]:.3f}, {b[2]:.3f}]",
                    f"≤ {BYTES_TARGET}" if target else "—", b[0] <= BYTES_TARGET if target else None))
        t = paired(m["int8 2L"]["step_s"], m["int8"]["step_s"])
        out.append((f"{where}step time, int8 two-level ÷ int8 flat", f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]",
                    f"≤ {FLAT_TARGET}" if target else "—", t[0] <= FLAT_TARGET if target else None))
    if "int8 2L" in m and "none" in m:
        t = paired(m["int8 2L"]["step_s"], m["none"]["step_s"])
        out.append((f"{where}step time, int8 two-level ÷ none flat", f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]",
                    f"≤ {NONE_TARGET}" if target else "—", t[0] <= NONE_TARGET if target else None))
    if "none 2L" in m and "none" in m:
        b = paired(m["none 2L"]["cross_bytes"], m["none"]["cross_bytes"])
        out.append((f"{where}inter-node bytes, none two-level ÷ none flat", f"{b[0]:.3f} [{b[1]:.3f}, {b[2]:.3f}]",
                    "—", None))
    return out


def path(controller, rate):
    return os.path.join(RES, f"two_level_{controller}_{rate}.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=",".join(f"{c}:{r}" for c, r in RUNS))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    runs = [tuple(x.split(":")) for x in a.runs.split(",")]
    mark = {True: "met", False: "NOT met", None: ""}
    lines = [f"Two nodes x 2 ranks (network namespaces, scripts/two_node.sh); medians [min, max] over "
             f"interleaved rounds. Machine: {platform.machine()}, {os.cpu_count()} cores; load "
             f"{os.getloadavg()[0]:.1f} when written.", "",
             "| measurement | value | target | |", "|---|---|---|---|"]
    for controller, rate in runs:
        p = path(controller, rate)
        if a.report_only:
            with open(p) as f:
                res = json.load(f)
        else:
            rounds = a.rounds if rate == "1gbit" else max(3, a.rounds // 2)
            res = run(controller, rate, p, ["--rounds", str(rounds)])
        where = (f"{controller}, {rate} (measured {res.get('measured_mbit_s', float('nan')):.0f} Mbit/s, "
                 f"{res.get('grad_mb', 0):.0f} MB grads, {res.get('rounds', '?')}x{res.get('steps', '?')} steps): ")
        lines += [f"| {m} | {v} | {t} | {mark[k]} |" for m, v, t, k in rows(res, where)]
    with open(os.path.join(RES, "two_level.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
