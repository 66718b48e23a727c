"""The names hvdp's messages and docstrings tell users to use resolve: every ``hvdp.<...>.<Name>``
written in the core (hvdp/) or the adapters (adapters/) is a real attribute, e.g. the torch
adapter's "policy must be an hvdp.CompressionPolicy"; and ``hvd.CompressionPolicy`` (hvd being
hvdp.torch or hvdp.keras, as in the examples) is that same class."""
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import hvdp
from hvdp.reduce.plan import CompressionPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOTTED = re.compile(r"\bhvdp(?:\.[a-z_][a-z_0-9]*)*\.[A-Z][A-Za-z_0-9]*")
ADAPTERS = ("hvdp.torch", "hvdp.keras")


def sources():
    """(path relative to the repository, text) of every .py file of hvdp/ and adapters/."""
    for top in ("hvdp", "adapters"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    with open(path, encoding="utf-8") as fh:
                        yield os.path.relpath(path, ROOT), fh.read()


def named_in_sources():
    """{dotted name: first file naming it} over the .py files of hvdp/ and adapters/."""
    names = {}
    for path, text in sources():
        for name in DOTTED.findall(text):
            names.setdefault(name, path)
    return names


def resolve(dotted):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_hvdp_exports_compression_policy():
    assert hvdp.CompressionPolicy is CompressionPolicy
    assert "CompressionPolicy" in hvdp.__all__


def test_core_names_in_messages_resolve():
    """Names under the core (not the adapters, which need a framework: next test)."""
    names = {n: p for n, p in named_in_sources().items() if not n.startswith(tuple(a + "." for a in ADAPTERS))}
    assert names, "no hvdp.<Name> found in the sources: the pattern is broken"
    missing = []
    for name, path in sorted(names.items()):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} (named in {path}): {type(e).__name__}: {e}")
    assert not missing, "names the code tells users about that do not exist:\n  " + "\n  ".join(missing)


def assert_nothing_missing(code):
    """Run ``code`` in a fresh interpreter (both adapters, Keras on its torch backend: no TensorFlow
    start-up); its last line must be ``MISSING []``."""
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "MISSING []", r.stdout[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None or importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("keras") is None, reason="needs torch, keras and Horovod")
def test_adapters_expose_the_same_compression_policy():
    """hvdp.torch and hvdp.keras (on Keras's torch backend: no TensorFlow start-up) give the core's
    class as ``hvd.CompressionPolicy``, and the adapter names the sources mention resolve."""
    adapter_names = sorted(n for n in named_in_sources() if n.startswith(tuple(a + "." for a in ADAPTERS)))
    code = ("import importlib, sys, hvdp, hvdp.torch, hvdp.keras\n"
            "assert hvdp.torch.CompressionPolicy is hvdp.CompressionPolicy, 'hvdp.torch.CompressionPolicy'\n"
            "assert hvdp.keras.CompressionPolicy is hvdp.CompressionPolicy, 'hvdp.keras.CompressionPolicy'\n"
            "missing = []\n"
            f"for name in {adapter_names!r}:\n"
            "    mod, _, attr = name.rpartition('.')\n"
            "    if not hasattr(importlib.import_module(mod), attr):\n"
            "        missing.append(name)\n"
            "print('MISSING', missing)")
    assert_nothing_missing(code)


# The public names users import, written down: hvdp's own and the adapters' (beside every name of
# horovod.torch / horovod.tensorflow.keras, checked in test_keras_adapter / test_horovod_compat).
# Moving code between internal modules must leave each of these where it is.
PUBLIC = {
    "hvdp": ["CompressionPolicy", "__version__"],
    "hvdp.torch": ["CompressionPolicy", "Compression", "DistributedOptimizer", "OuterOptimizer", "JoinRefused",
                   "ProcessMesh", "TorchOps", "broadcast_optimizer_state", "broadcast_parameters",
                   "hierarchical_process_sets", "init", "join", "load_checkpoint", "save_checkpoint", "elastic"],
    "hvdp.torch.elastic": ["ElasticSampler", "TorchState", "run"],
    "hvdp.keras": ["CompressionPolicy", "Compression", "DistributedOptimizer", "OuterOptimizer",
                   "DistributedGradientTape", "JoinRefused", "ProcessMesh", "SyncBatchNormalization",
                   "broadcast_global_variables", "broadcast_variables", "callbacks", "elastic",
                   "hierarchical_process_sets", "init", "join", "load_checkpoint", "load_model", "save_checkpoint"],
    "hvdp.keras.callbacks": ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "JoinCallback",
                             "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
                             "ModelCheckpoint"],
    "hvdp.keras.elastic": ["CommitStateCallback", "ElasticSampler", "KerasState", "ObjectState",
                           "TensorFlowKerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"],
}
if importlib.util.find_spec("lightning") is not None:  # hvdp.lightning needs Lightning (the [lightning] extra)
    PUBLIC["hvdp.lightning"] = ["HorovodEnvironment", "HorovodFabricStrategy", "HorovodStrategy"]


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None or importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("keras") is None, reason="needs torch, keras and Horovod")
def test_every_listed_public_name_is_where_users_import_it():
    code = ("import importlib\n"
            f"public = {PUBLIC!r}\n"
            "missing = [f'{m}.{n}' for m, names in public.items() for n in names\n"
            "           if not hasattr(importlib.import_module(m), n)]\n"
            "print('MISSING', missing)")
    assert_nothing_missing(code)
