"""Peak host memory of one training step, per codec (issue 18 row 7).

One 50M-element float32 parameter (191 MB of gradient), torch adapter, SGD, 2 workers on
localhost. For each codec a separate ``horovodrun -np 2`` job runs plain torch steps first (what
the model itself costs: the gradient and autograd's temporaries), then hvdp steps. For each kind
the figure is the step after the first (steady state: residuals and buffers of step 1 exist):
extra = peak RSS during the step - RSS just before it. The peak comes from the kernel's VmHWM,
reset before each step through /proc/self/clear_refs; where that is not allowed, from a thread
sampling RSS every millisecond (which can miss short peaks).

Run alone: ``python benchmarks/memory_bench.py [--codecs none,bf16,int8] [--json-out F]``;
``benchmarks/run_all.py`` runs it as a stage.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 1e6


# --- worker side -------------------------------------------------------------------------------
def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


class PeakRSS:
    """Peak RSS (bytes) between ``reset()`` and ``peak()``."""

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampling"
            self._max, self._stop = 0, threading.Event()
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while not self._stop.is_set():
            self._max = max(self._max, _status_kb("VmRSS") * 1024)
            time.sleep(0.001)

    def reset(self):
        if self.method == "VmHWM":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._max = 0

    def peak(self):
        if self.method == "VmHWM":
            return _status_kb("VmHWM") * 1024
        return max(self._max, _status_kb("VmRSS") * 1024)


def worker(codec, numel, out):
    import torch
    import hvdp.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel) * 0.01)
    w = torch.randn(numel)  # loss = sum(p * w): the gradient is w, a fresh 191 MB tensor
    meter = PeakRSS()

    def measure(opt, steps=2):
        rows = []
        for _ in range(steps):
            base = _status_kb("VmRSS") * 1024
            meter.reset()
            t0 = time.perf_counter()
            opt.zero_grad()
            (p * w).sum().backward()
            opt.step()
            rows.append({"extra_mb": (meter.peak() - base) / MB, "step_s": time.perf_counter() - t0})
        return rows

    plain = measure(torch.optim.SGD([p], lr=1e-3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1e-3), named_parameters=[("p", p)],
                                   compression=codec)
    hv = measure(opt)
    red = opt.engine.reducer  # error-feedback residuals: allowed on top of the target
    res = [] if red is None else list(red.worker_residual.values()) + list(red.server_residual.values())
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump({"codec": codec, "numel": numel, "grad_mb": 4 * numel / MB, "method": meter.method,
                       "residual_mb": sum(4 * t.numel() for t in res) / MB, "plain": plain, "hvdp": hv}, f)


# --- driver ------------------------------------------------------------------------------------
def run_codec(codec, numel, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = ["horovodrun", "-np", "2", "-H", "localhost:2", sys.executable, os.path.abspath(__file__),
               "--worker", codec, "--numel", str(numel), "--out", out]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if r.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", default="none,bf16,int8")
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--json-out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, a.numel, a.out)
    results = {}
    print(f"{'codec':6} {'plain torch MB':>14} {'hvdp step MB':>12} {'÷ grad':>7} "
          f"{'hvdp - plain MB':>15} {'÷ grad':>7} {'step s':>7} {'target MB':>9}")
    for codec in a.codecs.split(","):
        r = run_codec(codec, a.numel, a.timeout)
        g, pl, hv = r["grad_mb"], r["plain"][-1], r["hvdp"][-1]
        # issue 18 row 7: a step's extra memory <= 2x the fp32 bucket plus the residuals
        target = 2 * g + r["residual_mb"]
        r["summary"] = {"extra_mb": hv["extra_mb"], "ratio": hv["extra_mb"] / g, "target_mb": target,
                        "over_plain_mb": hv["extra_mb"] - pl["extra_mb"],
                        "over_plain_ratio": (hv["extra_mb"] - pl["extra_mb"]) / g, "step_s": hv["step_s"]}
        results[codec] = r
        s = r["summary"]
        print(f"{codec:6} {pl['extra_mb']:14.0f} {s['extra_mb']:12.0f} {s['ratio']:7.2f} "
              f"{s['over_plain_mb']:15.0f} {s['over_plain_ratio']:7.2f} {s['step_s']:7.2f} {target:9.0f}", flush=True)
    print(f"(gradient {4 * a.numel / MB:.0f} MB fp32; peak via {r['method']})")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
