"""Check a GPU node: Horovod built with NCCL, and hvdp's compression on CUDA tensors.

    python examples/gpu_check.py                 # one process (np=1), or:
    horovodrun -np 1 -H localhost:1 python examples/gpu_check.py

What it checks, printing one line per check:
  1. Horovod's torch extension has NCCL and CUDA built in (hvd.nccl_built(), hvd.cuda_built()).
  2. An allreduce of a CUDA tensor returns on the same device with the right value.
  3. Every codec (none, fp16, bf16, int8, topk) run with hvdp.torch.TorchOps on CUDA encodes to the
     same bytes as the numpy reference (hvdp.ops.NumpyOps) and decodes to the same values.
  4. hvdp.kernels selects the Triton int8 kernels for CUDA tensors; their payload equals numpy's.
  5. int8 training through those kernels equals the array-op path (HVDP_KERNELS=off) bit for bit.
  6. One DistributedOptimizer step of a small CUDA model with fp16, bf16 and int8 compression
     against the same step uncompressed, under each codec's error bound.
Exit status 1 if a check fails; 0 with "SKIP: no CUDA device" on a machine without a GPU.
"""
import sys
import time

import numpy as np
import torch

LR = 0.1
# Largest |compressed - uncompressed| of an updated parameter, as a multiple of LR * max|grad|:
# fp16/bf16 round each value once to 11/8 significant bits, the average once more (3 roundings
# at most); int8 errs by half a quantization step (block max / 254) when encoding and again
# when re-encoding the average, both below max|grad| / 254.
BOUND = {"fp16": 3 * 2.0 ** -11, "bf16": 3 * 2.0 ** -8, "int8": 2 / 254 * 1.001}
failures = []


def report(name, ok, detail):
    print(f"{'CHECK' if ok else 'FAIL '} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def check_build(hvd, dev):
    nccl = hvd.nccl_built()
    version = f"{nccl // 10000}.{nccl // 100 % 100}.{nccl % 100}" if nccl else "none"
    report("nccl_built", bool(nccl), f"NCCL {version} (hvd.nccl_built() = {nccl})")
    report("cuda_built", bool(hvd.cuda_built()), f"hvd.cuda_built() = {hvd.cuda_built()}")


def check_allreduce(hvd, dev):
    x = torch.arange(1024, dtype=torch.float32, device=dev) * (hvd.rank() + 1)
    got = hvd.allreduce(x, op=hvd.Average, name="gpu_check.allreduce")
    mean_factor = (hvd.size() + 1) / 2  # average of rank + 1 over ranks
    want = torch.arange(1024, dtype=torch.float32, device=dev) * mean_factor
    ok = got.device == x.device and torch.allclose(got, want, rtol=1e-6)
    report("allreduce_cuda", ok, f"average of {x.numel()} floats on {got.device}, size {hvd.size()}")


def check_codecs(hvd, dev):
    from hvdp import codecs
    from hvdp.ops import NumpyOps

    rng = np.random.default_rng(7)
    x = (rng.standard_normal(8192) * rng.uniform(0.01, 100, 8192)).astype(np.float32)
    x[100], x[5000] = np.inf, np.nan  # non-finite values must travel as on the CPU
    for name in ("none", "fp16", "bf16", "int8", "topk"):
        codec = codecs.get(name)
        ref_payload = codec.encode(NumpyOps(), x)
        ref = codec.decode(NumpyOps(), ref_payload, x.size)
        payload = codec.encode(hvd.TorchOps(), torch.from_numpy(x.copy()).to(dev))
        got_t = codec.decode(hvd.TorchOps(), payload, x.size)
        got = got_t.cpu().numpy()
        same_bytes = np.array_equal(payload.cpu().numpy(), ref_payload)
        # NaN bit patterns may differ by framework; where they are, and every other value, may not
        same_values = (np.array_equal(np.isnan(got), np.isnan(ref))
                       and np.array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)]))
        ok = same_values and payload.device == got_t.device == torch.device(dev)
        report(f"codec_{name}_cuda", ok,
               f"{x.size} values on {got_t.device}; payload {payload.numel()} B, "
               f"{'identical to' if same_bytes else 'differing (NaN bit patterns) from'} numpy's; "
               f"decoded values {'equal to' if same_values else 'DIFFERENT from'} numpy's")


def check_kernels(hvd, dev):
    """hvdp.kernels picks the Triton kernels for int8 on CUDA, and they match numpy's bytes."""
    from hvdp import codecs
    from hvdp.kernels import registry
    from hvdp.ops import NumpyOps

    codec = codecs.get("int8")
    x = torch.randn(1 << 20, device=dev) * 5
    kern, why = registry.explain(codec, hvd.TorchOps(), x)
    path = getattr(kern, "path", None)
    report("kernel_selected_cuda", path == "cuda-triton", f"int8 on {dev}: {path or 'array ops'} {why}")
    if kern is not None:
        ref = codec.encode(NumpyOps(), x.cpu().numpy())
        same = np.array_equal(kern.encode(x).cpu().numpy(), ref)
        report("kernel_payload_cuda", same,
               f"{x.numel()} values: payload {'identical to' if same else 'DIFFERENT from'} numpy's")


def check_kernel_training(hvd, dev, steps=5, width=4096):
    """int8 training through the Triton kernels equals the array-op path bit for bit; step times."""
    import os
    results = {}
    for path in ("kernels", "array ops"):
        os.environ["HVDP_KERNELS"] = "auto" if path == "kernels" else "off"  # read at the first step
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, 10)).to(dev)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=[(f"{path}.{k}", p) for k, p in model.named_parameters()],
                                       compression="int8")
        g = torch.Generator(device="cpu").manual_seed(5)
        times = []
        for _ in range(steps):
            x = torch.randn(256, width, generator=g).to(dev)
            y = torch.randint(0, 10, (256,), generator=g).to(dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        results[path] = (model, sorted(times[1:])[len(times[1:]) // 2], opt.compression_stats().get("paths"))
    os.environ.pop("HVDP_KERNELS")
    (mk, tk, pk), (ma, ta, pa) = results["kernels"], results["array ops"]
    same = all(torch.equal(a, b) for a, b in zip(mk.parameters(), ma.parameters()))
    report("training_int8_kernels_equal_arrayops_cuda", same and "cuda-triton" in str(pk),
           f"{steps} int8 SGD steps of a {sum(p.numel() for p in mk.parameters()) / 1e6:.1f}M-parameter "
           f"model: parameters {'bit-identical' if same else 'DIFFERENT'}; paths {pk} vs {pa}; median step "
           f"{tk * 1e3:.2f} ms (kernels) vs {ta * 1e3:.2f} ms (array ops)")


def one_step(hvd, dev, compression):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    g = torch.Generator(device="cpu").manual_seed(100 + hvd.rank())
    x = torch.randn(64, 256, generator=g).to(dev)
    y = torch.randint(0, 10, (64,), generator=g).to(dev)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    torch.cuda.synchronize()
    return model, opt


def check_optimizer(hvd, dev):
    ref, ref_opt = one_step(hvd, dev, "none")
    # the reference's averaged gradients bound every codec's error
    gmax = max(p.grad.abs().max().item() for p in ref.parameters())
    for name in ("fp16", "bf16", "int8"):
        model, opt = one_step(hvd, dev, name)
        err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        bound = LR * gmax * BOUND[name]
        on_cuda = all(p.device.type == "cuda" for p in model.parameters())
        stats = opt.compression_stats()
        ok = on_cuda and err <= bound and np.isfinite(err) and name in str(stats["codec"])
        report(f"optimizer_{name}_cuda", ok,
               f"one SGD step vs uncompressed: max |diff| {err:.3g} <= bound {bound:.3g}; "
               f"codec {stats['codec']}, params on cuda: {on_cuda}")


def main():
    if not torch.cuda.is_available():
        print(f"SKIP: no CUDA device (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none: a CPU-only build'})")
        return 0
    import hvdp.torch as hvd

    t0 = time.time()
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    dev = f"cuda:{hvd.local_rank()}"
    print(f"gpu_check: rank {hvd.rank()}/{hvd.size()} on {torch.cuda.get_device_name(dev)}, "
          f"torch {torch.__version__} (CUDA {torch.version.cuda})", flush=True)
    for check in (check_build, check_allreduce, check_codecs, check_kernels, check_kernel_training,
                  check_optimizer):
        try:
            check(hvd, dev)
        except Exception as e:  # a crash in one check must not hide the others' results
            report(check.__name__, False, f"{type(e).__name__}: {e}")
    print(f"gpu_check: {'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'} "
          f"in {time.time() - t0:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
