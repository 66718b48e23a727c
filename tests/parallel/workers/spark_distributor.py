"""Spark's TorchDistributor, local mode, 2 processes (tests/parallel/test_spark.py).

    python spark_distributor.py OUT_DIR

A local SparkSession (``local[2]``); ``TorchDistributor(num_processes=2, local_mode=True,
use_gpu=False).run(<file>, *args)`` runs torchrun on the driver, which starts the two processes:
first hvdp's torchrun checks (workers/torchrun_checks.py: hvd.init() bootstraps Horovod's Gloo
controller from torchrun's variables; int8 step within bound; five losses), then
examples/torch_digits.py with int8 (rank 0 writes OUT_DIR/digits.json). What the processes print
comes through the driver's output. Prints 'SPARK_RUN_S <seconds>' per run.
"""
import os
import sys
import time

from pyspark.ml.torch.distributor import TorchDistributor
from pyspark.sql import SparkSession

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def main(out):
    spark = SparkSession.builder.master("local[2]").appName("hvdp-torchdistributor") \
        .config("spark.ui.enabled", "false").getOrCreate()
    try:
        runs = [(os.path.join(HERE, "torchrun_checks.py"), ()),
                (os.path.join(ROOT, "examples", "torch_digits.py"),
                 ("--compression", "int8", "--quiet", "--json-out", os.path.join(out, "digits.json")))]
        for script, args in runs:
            t0 = time.monotonic()
            TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(script, *args)
            print(f"SPARK_RUN_S {os.path.basename(script)} {time.monotonic() - t0:.1f}", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
