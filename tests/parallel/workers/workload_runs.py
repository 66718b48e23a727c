"""Run one workload example a few steps, uncompressed and with int8, in one horovodrun job.

    python workload_runs.py <torch_cnn|torch_gpt|keras_cnn> <out_dir>

Writes ``<out_dir>/<example>-<codec>.json`` (the example's --json-out); the CNN also runs outer
steps (``torch_cnn-outer.json``), and so does the main job's MLP, examples/torch_digits.py, in the
same job (``torch_cnn-digits-outer.json``: 2 epochs, 42 steps); the GPT also resumes from its
checkpoint for one more epoch (``torch_gpt-resumed.json``) and runs through torch DDP, plain and
with PowerSGD rank 4 (``torch_gpt-ddp.json``, ``torch_gpt-ddp-powersgd4.json``).
"""
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

SMALL = {
    "torch_cnn": ["--epochs", "3", "--max-steps", "30", "--width", "8", "--sync-bn", "--quiet"],
    "torch_gpt": ["--d-model", "64", "--heads", "2", "--layers", "2", "--context", "32", "--batch-size", "8",
                  "--accumulate", "2", "--epochs", "2", "--steps-per-epoch", "12", "--warmup", "4",
                  "--lr", "3e-3", "--val-windows", "16", "--quiet"],
    "keras_cnn": ["--epochs", "3", "--width", "8", "--warmup-epochs", "1"],
}


def main():
    name, out = sys.argv[1], sys.argv[2]
    run = importlib.import_module(name).main
    for codec in ("none", "int8"):
        extra = ["--checkpoint", os.path.join(out, f"{name}-{codec}.ckpt")] if name == "torch_gpt" else []
        run(SMALL[name] + extra + ["--compression", codec, "--json-out", os.path.join(out, f"{name}-{codec}.json")])
    if name == "torch_cnn":  # outer steps (--sync-every): 28 steps, the last one a sync at H = 4
        run(SMALL[name] + ["--compression", "int8", "--sync-every", "4", "--warmup-steps", "8", "--max-steps", "28",
                           "--json-out", os.path.join(out, f"{name}-outer.json")])
        from torch_digits import main as digits  # 21 steps an epoch: the last of 42 a sync at H = 6
        digits(["--epochs", "2", "--quiet", "--compression", "int8", "--sync-every", "6", "--warmup-steps", "6",
                "--json-out", os.path.join(out, f"{name}-digits-outer.json")])
    if name == "torch_gpt":  # the checkpoint holds 2 epochs: a third resumes from it
        args = list(SMALL[name])
        args[args.index("--epochs") + 1] = "3"
        run(args + ["--checkpoint", os.path.join(out, "torch_gpt-int8.ckpt"), "--compression", "int8",
                    "--json-out", os.path.join(out, "torch_gpt-resumed.json")])
        for hook, tag in (("none", "ddp"), ("powersgd4", "ddp-powersgd4")):  # the peers' path
            run(SMALL[name] + ["--ddp-hook", hook, "--powersgd-start", "4",
                               "--json-out", os.path.join(out, f"torch_gpt-{tag}.json")])


if __name__ == "__main__":
    main()
