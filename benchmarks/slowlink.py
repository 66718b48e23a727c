"""Slow link: step time by codec with both workers in a network namespace whose loopback is
limited by a token bucket (default 1 Gbit/s; its depth: ``burst_bytes``), Horovod over Gloo/TCP
on that loopback.

    python benchmarks/slowlink.py --json-out F [--rate 1gbit | 3gbit | none]

``--rate none``: the unthrottled loopback (no namespace, no root needed), same job otherwise.
A throttled rate needs root (namespace + tc). Traffic stays on the namespace's loopback; the
namespace is deleted afterwards, also on failure, Ctrl-C or SIGTERM.
"""
import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def horovod_cycle(environ=None) -> str:
    """Horovod's cycle time the benchmark's workers run at, as a report says it (they inherit
    ``HOROVOD_CYCLE_TIME``; without it hvd.init() sets hvdp.cluster.cycle's for a CPU job)."""
    from hvdp.cluster.cycle import CPU_CYCLE_MS
    v = (os.environ if environ is None else environ).get("HOROVOD_CYCLE_TIME")
    return f"{v} ms (HOROVOD_CYCLE_TIME set)" if v else f"{CPU_CYCLE_MS} ms (hvd.init()'s without a GPU)"


def cycle_words(saved: dict) -> str:
    """A saved result's cycle time; results saved before hvd.init() set one ran at Horovod's 1 ms."""
    return saved.get("horovod_cycle") or "1 ms (Horovod's default: run before hvd.init() set a cycle)"


BUCKET = "token bucket 2 ms at the rate (16-256 KiB), checked not to bank idle time"


def bucket_words(saved: dict) -> str:
    """The token bucket a saved result's throttled links ran with (``burst_bytes``)."""
    return saved.get("bucket") or "token bucket 256 KiB at every rate (before 2026-12-06: it banks idle time)"


def saved_or_run(stem, report_only, run, cycle=True) -> dict:
    """A stage's results: its saved ``stem.json`` (``report_only``), or ``run()`` (a dict) with the
    run's minutes, the load average at its end and (``cycle``) the Horovod cycle its workers ran
    at, saved there first."""
    if report_only:
        with open(stem + ".json") as f:
            return json.load(f)
    t0 = time.time()
    saved = dict(run())
    saved.update(minutes=(time.time() - t0) / 60, load=os.getloadavg()[0])
    saved.setdefault("bucket", BUCKET)
    if cycle:
        saved["horovod_cycle"] = horovod_cycle()
    with open(stem + ".json", "w") as f:
        json.dump(saved, f)
    return saved


def sh(*cmd, **kw):
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=60, **kw)


def measure_rate(ns, mib=64):
    """Gbit/s of one TCP stream over the namespace's loopback (a self-check of the limit)."""
    took = idle_send_s(ns, mib << 20, idle=0.0)
    return mib * 8 * 1.048576e6 / took / 1e9 if took else None


def bits_per_s(rate: str) -> float:
    """tc's rate notation ("100mbit", "1gbit", "500kbit") in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, mult in units.items():
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: give tc's notation, e.g. 100mbit or 1gbit")


def burst_bytes(rate: str) -> int:
    """The token bucket's depth: 2 ms at the rate, within [16 KiB, 256 KiB]. A bucket fills while
    the link is idle and then lets that many bytes through at once, which a real link does not:
    up to 2026-12-06 every rate had 256 KiB, so at 10 Mbit/s an exchange under 256 KiB that
    followed 0.2 s of compute crossed at once (0.2 s of line time free per step), and small-byte
    methods (int4, outer steps) were measured faster than the link allows."""
    return int(min(256 * 1024, max(16 * 1024, bits_per_s(rate) / 8 * 0.002)))


def idle_send_s(ns, nbytes, idle=0.5):
    """Seconds for ``nbytes`` over one TCP connection on the namespace's loopback (``ns`` None:
    the machine's), delivered and acknowledged, after ``idle`` seconds with nothing sent (a token
    bucket full)."""
    code = f"""
import socket, threading, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
def sink():
    c, _ = srv.accept(); n = 0
    while n < {nbytes}:
        n += len(c.recv(1 << 20))
    c.sendall(b"k")
threading.Thread(target=sink, daemon=True).start()
s = socket.create_connection(("127.0.0.1", srv.getsockname()[1]))
left = {nbytes} - 1; buf = b"x" * min(left, 1 << 20)
s.sendall(b"w"); time.sleep({idle})
t0 = time.perf_counter()
while left > 0:
    k = min(left, len(buf)); s.sendall(buf[:k]); left -= k
s.recv(1)
print(time.perf_counter() - t0)
"""
    prefix = ["ip", "netns", "exec", ns] if ns else []
    r = subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return float(r.stdout.strip()) if r.returncode == 0 else None


def check_no_bank(ns, rate, burst):
    """Refuse a link that lets an exchange through faster than its rate after idle time: 8 buckets'
    worth of bytes after 0.5 s idle must take at least 90% of the line time of the 7 beyond the
    first bucket."""
    nbytes = 8 * burst
    took = idle_send_s(ns, nbytes)
    floor = 7 * burst * 8 / bits_per_s(rate)
    if took is None or took < 0.9 * floor:
        raise SystemExit(f"slowlink: {nbytes} bytes after idle crossed the {rate} link in "
                         f"{'?' if took is None else f'{took * 1e3:.1f}'} ms, under 90% of the "
                         f"{floor * 1e3:.1f} ms its rate allows: the token bucket banks idle time")


def unavailable(rate, isolate=False):
    """Why a link cannot be made here (None: it can). A throttled link, or an isolated one, needs
    root and iproute2 (a network namespace, a tc qdisc)."""
    if rate.lower() == "none" and not isolate:
        return None
    if os.geteuid() != 0:
        return "not root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) missing: apt-get install iproute2"
    return None


@contextlib.contextmanager
def link(rate, isolate=False, burst=None):
    """A loopback limited to ``rate`` (tc's notation; "none": unthrottled) for the commands run
    under the yielded prefix; yields ``(prefix, measured Gbit/s)``. ``isolate``: a namespace even
    when unthrottled, so that its loopback's counters count the job's traffic alone. ``burst``:
    the bucket's bytes instead of ``burst_bytes(rate)``, not checked (to compare with a bucket
    that banks idle time)."""
    throttled = rate.lower() != "none"
    ns = f"hvdpbench{os.getpid()}" if (throttled or isolate) else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    try:
        if ns:
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if throttled:
            checked, burst = burst is None, burst or burst_bytes(rate)
            if burst < 65536:  # tbf drops a packet larger than its burst: lo's MTU is 64 KiB
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "mtu", "1500")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", "100ms")
            if checked:
                check_no_bank(ns, rate, burst)
        # 64 MiB takes 54 s at 10 Mbit/s: below 100 Mbit/s, 8 MiB (still seconds of the shaped rate)
        slow = throttled and bits_per_s(rate) < 100e6
        yield (["ip", "netns", "exec", ns] if ns else []), measure_rate(ns, mib=8 if slow else 64)
    finally:
        if ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)


def run_job(prefix, script, args, timeout=900, controller="gloo"):
    """``horovodrun -np 2 --gloo`` (or ``--mpi``: ``controller``) of a benchmark script (which
    writes ``--json-out``) under ``prefix``; returns its JSON."""
    out = os.path.join(HERE, f".job{os.getpid()}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_GLOO_IFACE="lo", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = prefix + [shutil.which("horovodrun", path=env["PATH"]), "-np", "2", "-H", "localhost:2", f"--{controller}",
                    sys.executable, os.path.join(HERE, script)] + args + ["--json-out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{script} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--codecs", default="none,fp16,bf16,int8,auto")
    ap.add_argument("--width", type=int, default=2560, help="2560: ~26 MB of float32 gradients")
    a = ap.parse_args()
    why = unavailable(a.rate)
    if why:
        print(f"SKIP slow link: {why}; it needs a network namespace and a tc qdisc")
        with open(a.json_out, "w") as f:
            json.dump({"skipped": why}, f)
        return
    with link(a.rate) as (prefix, gbit):
        res = run_job(prefix, "step_bench.py", [
            "--codecs", a.codecs, "--width", str(a.width), "--depth", "1", "--batch", "16",
            "--iters", "8", "--batches", "3",
            "--warmup", "14"])  # auto: probe + its trial (3 plans x (3 + 1) steps) before the timed ones
    res.update(rate=a.rate, measured_gbit_s=gbit, grad_mb=4 * res["params"] / 1e6)
    with open(a.json_out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
