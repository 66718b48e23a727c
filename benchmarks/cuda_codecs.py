"""Codec throughput on a CUDA device, as a fraction of the device's own memcpy, in one run.

    python benchmarks/cuda_codecs.py [--mib 16 256] [--json-out F]

For each size: device-to-device copy of the float32 buffer (the reference, 8 bytes moved per
element); the int8 codec's encode + decode through the Triton kernels (adapters/torch/
kernels_cuda.py) and through the generic torch array ops (the codec's reference code on CUDA
tensors); int8 + error feedback (encode with the residual, then decode); the owner's decode-sum
of P = 2 and 4 payloads; the bf16 cast there and back. A ratio is memcpy time / codec time
(1.0: as fast as a copy). Timed with CUDA events: the median of 50 runs after 10 warm-ups.
Needs no Horovod: the kernels are loaded by path. Exit 0 with a SKIP line without a GPU.
"""
import argparse
import importlib.util
import json
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvdp import codecs  # noqa: E402


def load_kernels():
    spec = importlib.util.spec_from_file_location("hvdp_kernels_cuda", ROOT / "adapters/torch/kernels_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def generic_ops():
    spec = importlib.util.spec_from_file_location("hvdp_torch_ops", ROOT / "adapters/torch/ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TorchOps()


def median_ms(fn, reps=50, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(mib, kc, ops):
    n = mib * 2 ** 20 // 4
    codec = codecs.get("int8")
    k = kc.CudaInt8Kernels(codec)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g) * 3
    dst = torch.empty_like(x)
    res_in, res_out = torch.zeros_like(x), torch.empty_like(x)  # the contract: no overlap
    payload = k.encode(x)
    nb = codec.payload_nbytes(n)
    recv = {p: payload.repeat(p) for p in (2, 4)}
    assert recv[2].numel() == 2 * nb
    out = torch.empty_like(x)
    rows = {
        "memcpy": lambda: dst.copy_(x),
        "int8 encode+decode (triton)": lambda: k.decode(k.encode(x, out=payload), n, out=out),
        "int8 + EF encode+decode (triton)": lambda: k.decode(k.encode(x, prev=res_in, residual=res_out, out=payload),
                                                            n, out=out),
        "owner decode-sum P=2 (triton)": lambda: k.decode_sum(recv[2], 2, n, 0.5, out=out),
        "owner decode-sum P=4 (triton)": lambda: k.decode_sum(recv[4], 4, n, 0.25, out=out),
        "int8 encode+decode (torch ops)": lambda: codec.decode(ops, codec.encode(ops, x), n),
        "bf16 cast there and back (torch)": lambda: x.to(torch.bfloat16).to(torch.float32),
        "fp16 cast there and back (torch)": lambda: x.to(torch.float16).to(torch.float32),
    }
    ms = {name: median_ms(fn) for name, fn in rows.items()}
    base = ms["memcpy"]
    result = {"mib": mib, "memcpy_ms": base,
              "memcpy_tb_s": 2 * 4 * n / base / 1e9,
              "rows": {name: {"ms": t, "ratio_to_memcpy": base / t} for name, t in ms.items()}}
    # exactness on this device, on the benchmark's own data: against the numpy reference
    from hvdp.ops import NumpyOps
    ref = torch.from_numpy(codec.encode(NumpyOps(), x.cpu().numpy()))
    result["triton_payload_equals_numpy"] = bool(torch.equal(k.encode(x).cpu(), ref))
    result["torch_ops_payload_equals_numpy"] = bool(torch.equal(codec.encode(ops, x).cpu(), ref))
    # launch shape: elements per program x warps, encode+decode
    sweep = {}
    for epp in (2048, 4096, 8192, 16384):
        for warps in (4, 8):
            kk = kc.CudaInt8Kernels(codec, elements_per_program=epp, warps=warps)
            pl = kk.encode(x)
            sweep[f"{epp}x{warps}"] = base / median_ms(lambda: kk.decode(kk.encode(x, out=pl), n, out=out))
    result["sweep_ratio_by_elements_x_warps"] = sweep
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--json-out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return
    kc, ops = load_kernels(), generic_ops()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": []}
    for mib in a.mib:
        r = measure(mib, kc, ops)
        results["sizes"].append(r)
        print(f"--- {mib} MiB float32 on {results['device']}: memcpy {r['memcpy_ms']:.4f} ms "
              f"({r['memcpy_tb_s']:.2f} TB/s read+write); payload == numpy reference: triton "
              f"{r['triton_payload_equals_numpy']}, torch ops {r['torch_ops_payload_equals_numpy']}")
        for name, row in r["rows"].items():
            print(f"{name:36s} {row['ms']:9.4f} ms   {row['ratio_to_memcpy']:6.3f} x memcpy")
        print("int8 encode+decode x memcpy by elements per program x warps:",
              ", ".join(f"{k} {v:.3f}" for k, v in r["sweep_ratio_by_elements_x_warps"].items()))
    if a.json_out:
        pathlib.Path(a.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
