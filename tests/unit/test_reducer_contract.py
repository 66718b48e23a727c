"""The Reducer contract (hvdp.reduce.reducer): every reducer class in hvdp.reduce follows it with
nothing left abstract, the engine's optional calls have defaults there, and neither the core nor
the adapters probe a reducer for parts (no hasattr/getattr on one, no __getattr__ forwarding)."""
import importlib
import inspect
import pkgutil
import re

import numpy as np
import pytest

import hvdp.reduce
from hvdp import codecs
from hvdp.ops import NumpyOps
from hvdp.reduce.hierarchy import HierarchicalReducer
from hvdp.reduce.join import JoinableReducer
from hvdp.reduce.lowrank import LowRankReducer
from hvdp.reduce.mixed import MixedReducer
from hvdp.reduce.reducer import DictStore, Reducer
from hvdp.reduce.simcomm import FakeGroup
from hvdp.reduce.twophase import TwoPhaseReducer
from test_public_names import sources

KNOWN = {TwoPhaseReducer, LowRankReducer, HierarchicalReducer, MixedReducer, JoinableReducer}


def all_reducer_classes():
    for info in pkgutil.walk_packages(hvdp.reduce.__path__, "hvdp.reduce."):
        importlib.import_module(info.name)
    found, todo = set(), [Reducer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("hvdp."):
                found.add(sub)
                todo.append(sub)
    return found


def test_every_reducer_follows_the_contract():
    classes = all_reducer_classes()
    assert KNOWN <= classes, f"not Reducer subclasses: {KNOWN - classes}"
    for cls in classes:
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unwritten"
        assert "__getattr__" not in vars(cls), f"{cls.__name__} forwards attributes instead of naming them"
        for name in ("layout", "store_sizes", "set_shapes", "start", "exchange", "advance", "finish",
                     "state_dict", "load_state_dict"):
            assert callable(getattr(cls, name)), (cls.__name__, name)


def test_a_new_reducer_needs_only_the_abstract_methods():
    """What a sixth reducer must write: exactly these; everything else has a default."""
    assert Reducer.__abstractmethods__ == {"layout", "start", "exchange", "finish", "state_dict", "load_state_dict"}

    class Halve(Reducer):
        def __init__(self):
            self.worker, self.server = DictStore(), DictStore()

        def layout(self, n):
            return 0, n

        def start(self, name, flat):
            return flat

        def exchange(self, pend):
            pass

        def finish(self, pend):
            return pend / 2

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    r = Halve()
    assert r.error_feedback is False and r.store_sizes("b0", 7) == (0, 7)
    r.set_shapes({"b0": [(7,)]})
    pend = r.start("b0", np.ones(7, np.float32))
    r.exchange(pend)
    r.advance(pend)
    np.testing.assert_array_equal(r.finish(pend), np.full(7, 0.5, np.float32))
    assert r.worker_residual == {} and r.server_residual == {}


def test_join_control_names_the_inner_reducers_parts():
    """JoinableReducer states the inner reducer's parts explicitly: layout, stores, flags, state."""
    inner = TwoPhaseReducer(codecs.get("int8"), NumpyOps(), FakeGroup(2).comms[0], True)
    r = JoinableReducer(inner, lambda: False)
    assert r.layout(100) == inner.layout(100) == r.store_sizes("b0", 100)
    assert r.worker is inner.worker and r.server is inner.server and r.error_feedback is True
    assert r.codec is inner.codec and r.state_dict() == inner.state_dict()


def test_mixed_reducer_sizes_come_from_the_buckets_codec():
    ops = NumpyOps()
    r = MixedReducer(ops, FakeGroup(2).comms[0], lambda c, comm: TwoPhaseReducer(c, ops, comm, True))
    r.assign({"b0": codecs.get("none"), "b1": codecs.get("int8")})
    assert r.store_sizes("b0", 100) == (0, 0)
    assert r.store_sizes("b1", 100) == r.reducers[str(codecs.get("int8"))].layout(100)
    with pytest.raises(TypeError, match="store_sizes"):
        r.layout(100)


PROBE = re.compile(r"\b(?:hasattr|getattr)\(\s*(?:self\.)?(?:\w+\.)?(?:red|reducer)\b")


def test_no_one_probes_a_reducer():
    hits = [f"{path}:{i}: {line.strip()}" for path, text in sources()
            for i, line in enumerate(text.splitlines(), 1) if PROBE.search(line)]
    assert not hits, "a reducer probed for parts the contract should state:\n" + "\n".join(hits)


MARKER = re.compile(r"\b_hvdp_?[A-Za-z0-9_]*")


def test_private_hvdp_attributes_stay_in_the_module_that_owns_them():
    """Each private ``_hvdp...`` attribute (state on a user's object, a marker on an exception or
    a class) is written and read in one module; every other module asks that module."""
    where = {}
    for path, text in sources():
        for name in set(MARKER.findall(text)):
            where.setdefault(name, set()).add(path)
    spread = {name: sorted(paths) for name, paths in where.items() if len(paths) > 1}
    assert where, "no _hvdp attribute found: the pattern is broken"
    assert not spread, f"private attributes named in more than one module: {spread}"
