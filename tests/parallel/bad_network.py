"""A bad network between the two nodes, flat and two-level: does training go on with the clean
link's result, or end on every rank with an error, never hang?

    python tests/parallel/bad_network.py [--steps 80] [--json-out FILE]     (root; `make bad-network`)

For each link (clean; 1% and 5% of the packets dropped on arrival, by nftables in each node; the
link down for 10 s from the 5th training step, then up) and each reduction (flat int8; two-level
int8, ``hierarchical=True``), one job of tests/parallel/workers/bad_network_job.py on 2 + 2 ranks.
A case passes when every rank ends with the clean run's parameters (bit for bit: fusion off, so
the sums' order is fixed), or every rank ends with an error, within the job's deadline (hvdp's stall watchdog at
``HVDP_STALL_TIMEOUT_SECONDS`` = 60 s, Gloo's at 30 s). A job still running at 300 s is a hang.
Prints one line per case (result, training time against the clean link) and a JSON summary.

Delay and reordering are made in user space (tests/parallel/delay_relay.py: each node's packets to
the other through a TUN device, held 50 +- 20 ms, a quarter of them sent at once), as netem's
``delay 50ms 20ms reorder 25%`` would: the kernels this runs on have no netem qdisc
(CONFIG_NET_SCH_NETEM not set).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_node import ROOT, TwoNodeCluster  # noqa: E402

JOB = os.path.join(ROOT, "tests", "parallel", "workers", "bad_network_job.py")
LINKS = {  # name -> what is done to the link: ("drop", percent), ("delay", (ms, +-ms, share at once)),
    # ("down", seconds)
    "clean": None,
    "loss 1%": ("drop", 1),
    "loss 5%": ("drop", 5),
    "delay 50ms+-20ms, 25% reordered": ("delay", (50.0, 20.0, 0.25)),
    "down 10 s, then up": ("down", 10.0),
    "clean, again": None,  # the clean result is reproducible (else "same" would mean nothing)
}
MODES = ("flat", "two-level")
JOB_TIMEOUT = 300
ENV = {"HOROVOD_FUSION_THRESHOLD": "0", "HVDP_STALL_TIMEOUT_SECONDS": "60", "HOROVOD_GLOO_TIMEOUT_SECONDS": "30"}


RELAY = os.path.join(ROOT, "tests", "parallel", "delay_relay.py")


def delay_start(cluster, delay_ms, jitter_ms, reorder):
    """Each node's packets to the other through delay_relay.py. -> the relay processes."""
    macs = [subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{cluster.iface}/address"],
                           capture_output=True, text=True, check=True, timeout=30).stdout.strip()
            for ns in cluster.namespaces]
    procs = []
    for i, ns in enumerate(cluster.namespaces):
        ready = os.path.join(cluster.dir, f"relay-{i}-{time.time()}")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, RELAY, "--iface", cluster.iface,
             "--peer", cluster.addresses[1 - i], "--peer-mac", macs[1 - i], "--delay-ms", str(delay_ms),
             "--jitter-ms", str(jitter_ms), "--reorder", str(reorder), "--seed", str(i), "--ready", ready],
            stdout=subprocess.PIPE, text=True))
        deadline = time.time() + 30
        while not os.path.exists(ready):
            if procs[-1].poll() is not None or time.time() > deadline:
                delay_stop(procs)
                raise RuntimeError(f"delay_relay.py did not start in {ns}")
            time.sleep(0.05)
    return procs


def delay_stop(procs):
    """End the relays (their TUN devices and routes go with them). -> their packet counts."""
    counts = []
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            out, _ = p.communicate(timeout=30)
            counts.append(json.loads(out.strip().splitlines()[-1]))
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            p.kill()
            counts.append(None)
    return counts


def drop(cluster, percent):
    """Each node drops ``percent`` % of the packets arriving on the veth (nftables, at random);
    percent 0 removes the rule. -> packets the rules had dropped before (both nodes)."""
    dropped = 0
    for ns in cluster.namespaces:
        run = ["ip", "netns", "exec", ns, "nft"]
        listed = subprocess.run(run + ["list", "table", "inet", "hvdploss"], capture_output=True, text=True,
                                timeout=30).stdout
        dropped += sum(int(n) for n in re.findall(r"counter packets (\d+)", listed))
        subprocess.run(run + ["delete", "table", "inet", "hvdploss"], capture_output=True, timeout=30)
        if percent:
            rules = (f"table inet hvdploss {{\n chain inp {{\n  type filter hook input priority 0;\n"
                     f'  iifname "{cluster.iface}" numgen random mod 100 < {percent} counter drop\n }}\n}}\n')
            subprocess.run(run + ["-f", "-"], input=rules, text=True, check=True, capture_output=True, timeout=30)
    return dropped


def link_down_for(cluster, mark, down_s, log):
    """Once the job has made the file ``mark`` (rank 0, at its 5th step), node A's end of the
    veth down for ``down_s`` seconds, then both ends up."""
    def go():
        deadline = time.time() + JOB_TIMEOUT
        while not os.path.exists(mark) and time.time() < deadline:
            time.sleep(0.05)
        subprocess.run(["ip", "-n", cluster.namespaces[0], "link", "set", cluster.iface, "down"], check=True)
        log.append(("down", time.time()))
        time.sleep(down_s)
        for ns in cluster.namespaces:  # a veth pair: both ends up again
            subprocess.run(["ip", "-n", ns, "link", "set", cluster.iface, "up"], check=True)
        log.append(("up", time.time()))
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def run_case(cluster, mode, link, steps, min_s):
    how = LINKS[link]
    log, relays, relayed = [], None, None
    if how and how[0] == "delay":
        relays = delay_start(cluster, *how[1])
    if how and how[0] == "drop":
        drop(cluster, how[1])
    mark = os.path.join(cluster.dir, f"mark-{time.time()}")
    thread = link_down_for(cluster, mark, how[1], log) if how and how[0] == "down" else None
    t0 = time.time()
    try:
        r = cluster.run(cluster.horovodrun("gloo") + [sys.executable, JOB, mode, str(steps), str(min_s)],
                        timeout=JOB_TIMEOUT, env=dict(ENV, BAD_NETWORK_MARK=mark))
        out, rc, hang = r.stdout, r.returncode, False
    except subprocess.TimeoutExpired as e:
        out, rc, hang = e.output or "", None, True
    finally:
        if thread is not None:
            thread.join()
        dropped = drop(cluster, 0) if how and how[0] == "drop" else None
        if relays is not None:
            relayed = delay_stop(relays)
    results = {int(r): (d, float(s)) for r, d, s in re.findall(r"RESULT rank=(\d) digest=(\w+) seconds=([\d.]+)", out)}
    errors = {int(r): m for r, m in re.findall(r"ERROR rank=(\d) after=\S+ type=\S+ msg=(.*)", out)}
    return {"mode": mode, "link": link, "rc": rc, "hang": hang, "wall_s": round(time.time() - t0, 1),
            "results": results, "errors": errors, "link_events": log, "dropped_packets": dropped,
            "relayed": relayed,
            "tail": out[-3000:]}


def verdict(case, clean):
    """'same', 'error on every rank', or what went wrong."""
    if case["hang"]:
        return "HANG"
    digests = {d for d, _ in case["results"].values()}
    if len(case["results"]) == 4 and digests == {clean}:
        return "same"
    if len(case["results"]) == 4:
        return "WRONG RESULT" if clean is not None else "no clean result"
    if case["results"] and case["errors"]:  # neither outcome the matrix accepts: counted as bad
        same = sorted(r for r, (d, _) in case["results"].items() if d == clean)
        return f"SPLIT: ranks {same} the clean result, ranks {sorted(case['errors'])} raised"
    if case["rc"] != 0 and len(case["errors"]) >= 1:
        return f"error ({len(case['errors'])} ranks raised)"
    return f"UNEXPLAINED (rc {case['rc']})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--min-step-s", type=float, default=0.25)
    p.add_argument("--modes", default=",".join(MODES), help="flat,two-level")
    p.add_argument("--links", default=None, help="only links named so (prefixes, ';'-separated; clean runs)")
    p.add_argument("--json-out")
    args = p.parse_args()
    why = TwoNodeCluster.unavailable()
    if why:
        sys.exit(why)
    rows = []
    with TwoNodeCluster(rate="1gbit") as c:
        for mode in args.modes.split(","):
            clean = None
            for link in LINKS:
                if args.links and link != "clean" and not any(link.startswith(x) for x in args.links.split(";")):
                    continue
                case = run_case(c, mode, link, args.steps, args.min_step_s)
                if link == "clean":
                    got = {d for d, _ in case["results"].values()}
                    assert case["rc"] == 0 and len(case["results"]) == 4 and len(got) == 1, case["tail"]
                    clean, clean_s = got.pop(), max(s for _, s in case["results"].values())
                case["verdict"] = verdict(case, clean)
                secs = max((s for _, s in case["results"].values()), default=None)
                case["slowdown"] = round(secs / clean_s, 2) if secs else None
                print(f"{mode:9s} {link:34s} {case['verdict']:24s} training "
                      f"{secs if secs is not None else float('nan'):.1f} s ({case['slowdown']}x the clean link), "
                      f"job {case['wall_s']} s" + (f", {case['dropped_packets']} packets dropped"
                                                   if case["dropped_packets"] is not None else "")
                      + (f", relayed {case['relayed']}" if case["relayed"] is not None else ""), flush=True)
                if not case["verdict"].startswith(("same", "error")):
                    print(case["tail"], flush=True)
                rows.append({k: v for k, v in case.items() if k != "tail"})
    bad = [r for r in rows if not r["verdict"].startswith(("same", "error"))]
    summary = {"cases": len(rows),
               "hangs": sum(r.get("hang", False) for r in rows),
               "wrong_results": sum(r["verdict"] == "WRONG RESULT" for r in rows),
               "same": sum(r["verdict"] == "same" for r in rows), "bad": len(bad), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
