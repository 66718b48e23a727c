"""Ray Train's TorchTrainer, 2 workers, on the Ray cluster at ADDRESS (tests/parallel/test_ray.py).

    python ray_train.py ADDRESS OUT_DIR

Checks that two Ray nodes are alive (the test starts the driver once both `ray start` said so),
then fits a TorchTrainer (gloo process group, 1 CPU per worker)
whose training function runs, in each worker, hvdp's checks under torchrun
(workers/torchrun_checks.py: hvd.init() bootstraps Horovod's Gloo controller from the variables
Ray Train sets; int8 step within bound; five losses) and then examples/torch_digits.py with
int8 (rank 0 writes its accuracy to OUT_DIR/digits.json). Each worker writes what it printed to
OUT_DIR/rank<R>.log and its Ray node id to OUT_DIR/node<R>.txt. Prints 'RAY_FIT_S <seconds>'.
A fatal signal prints every thread's Python stack (faulthandler, all threads; Ray's own
``faulthandler.enable`` leaves an enabled one as it is).
"""
import contextlib
import faulthandler
import io
import os
import runpy
import sys
import time

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def train(config):
    out, rank = config["out"], int(os.environ["RANK"])
    with open(os.path.join(out, f"node{rank}.txt"), "w") as f:
        f.write(ray.get_runtime_context().get_node_id())
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(os.path.join(HERE, "torchrun_checks.py"), run_name="__main__")
            sys.path.insert(0, os.path.join(ROOT, "examples"))
            import torch_digits
            torch_digits.main(["--compression", "int8", "--quiet",
                               "--json-out", os.path.join(out, "digits.json")])
    finally:
        with open(os.path.join(out, f"rank{rank}.log"), "w") as f:
            f.write(buf.getvalue())


def main(address, out):
    faulthandler.enable(all_threads=True)
    ray.init(address=address, log_to_driver=True)
    deadline = time.monotonic() + 30
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        if time.monotonic() > deadline:
            raise SystemExit(f"the Ray cluster at {address} has fewer than 2 alive nodes: {ray.nodes()}")
        time.sleep(0.5)
    trainer = TorchTrainer(train, train_loop_config={"out": out},
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                           torch_config=TorchConfig(backend="gloo"),
                           run_config=RunConfig(name="hvdp", storage_path=os.path.join(out, "results")))
    t0 = time.perf_counter()
    result = trainer.fit()
    print(f"RAY_FIT_S {time.perf_counter() - t0:.1f}", flush=True)
    if result.error:
        raise SystemExit(f"TorchTrainer failed: {result.error!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
