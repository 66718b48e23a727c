"""The ranks-agree check (hvdp.cluster.agreement), with P simulated ranks on threads: no processes."""
import threading

import pytest

from hvdp.cluster import agreement
from hvdp.cluster.agreement import DisagreementError, check, describe, differences, explain

W = [("0.weight", (20, 10), "float32", True), ("0.bias", (20,), "float32", True)]


def desc(tensors=W, **kw):
    settings = dict(compression="none", policy="CompressionPolicy()", backward_passes_per_step=1,
                    op="average")
    settings.update(kw)
    return describe(tensors, buckets=kw.pop("buckets", ()), versions={"hvdp": "0.1.0", "horovod": "0.28.1"},
                    **{k: v for k, v in settings.items() if k != "buckets"})


class ThreadGather:
    """allgather_fixed for P ranks that run on threads; counts the collectives."""

    def __init__(self, size):
        self.size, self.calls = size, []
        self.barrier = threading.Barrier(size)
        self.slots = {}

    def fn(self, rank):
        def allgather_fixed(data, name):
            lengths = self.slots.setdefault(name, {})
            lengths[rank] = data
            self.barrier.wait()
            got = [lengths[r] for r in range(self.size)]
            assert len({len(g) for g in got}) == 1, f"{name}: unequal lengths {[len(g) for g in got]}"
            if rank == 0:
                self.calls.append(name)
            self.barrier.wait()
            return got
        return allgather_fixed


def run_ranks(descs, **kw):
    """Run ``check`` on one thread per rank; returns (error message or None per rank, calls)."""
    g = ThreadGather(len(descs))
    out = [None] * len(descs)

    def one(r):
        try:
            check(descs[r], g.fn(r), "the DistributedOptimizer", **kw)
        except DisagreementError as e:
            out[r] = str(e)

    ts = [threading.Thread(target=one, args=(r,)) for r in range(len(descs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not any(t.is_alive() for t in ts), "check hung"
    return out, g.calls


def test_agreeing_ranks_pay_one_digest_allgather():
    errs, calls = run_ranks([desc(), desc(), desc()])
    assert errs == [None, None, None]
    assert calls == ["hvdp.agree.digest"]


def test_extra_parameter_same_error_on_every_rank_naming_the_rank():
    extra = W + [("3.weight", (10, 10), "float32", True)]
    errs, calls = run_ranks([desc(), desc(extra)])
    assert errs[0] is not None and errs[0] == errs[1]
    assert "rank 1 has parameter '3.weight' [10, 10] float32 that rank 0 lacks" in errs[0]
    assert "HVDP_CHECK_AGREEMENT=0" in errs[0]
    assert calls == ["hvdp.agree.digest", "hvdp.agree.full.len", "hvdp.agree.full.data"]


def test_missing_parameter_wider_layer_and_flags():
    other = [("0.weight", (30, 10), "float32", True)]
    diffs = differences([desc(), desc(other)])
    assert "rank 0 has parameter '0.bias' [20] float32 that rank 1 lacks" in diffs
    assert "parameter '0.weight' has shape [20, 10] on rank 0 but [30, 10] on rank 1" in diffs
    frozen = [W[0], ("0.bias", (20,), "float16", False)]
    diffs = differences([desc(), desc(frozen)])
    assert "parameter '0.bias' has dtype float32 on rank 0 but float16 on rank 1" in diffs
    assert "parameter '0.bias' has requires_grad True on rank 0 but False on rank 1" in diffs


def test_settings_versions_and_grouped_ranks():
    d = [desc(), desc(compression="int8(block_size=256)"), desc(compression="int8(block_size=256)"),
         desc(backward_passes_per_step=2)]
    diffs = differences(d)
    assert "compression is 'none' on rank 0 but 'int8(block_size=256)' on ranks 1, 2" in diffs
    assert "backward_passes_per_step is '1' on rank 0 but '2' on rank 3" in diffs
    v = desc()
    v["versions"]["horovod"] = "0.28.0"
    assert differences([desc(), v])[0] == "horovod is '0.28.1' on rank 0 but '0.28.0' on rank 1"


def test_a_setting_only_one_rank_has():
    d = desc()
    d["settings"]["process_set"] = "1"
    assert differences([desc(), d]) == ["process_set is '<unset>' on rank 0 but '1' on rank 1"]


def test_order_and_buckets_only_when_nothing_else_differs():
    swapped = [W[1], W[0]]
    diffs = differences([desc(), desc(swapped)])
    assert diffs == ["the parameters come in another order on rank 1 than on rank 0 "
                     "(position 0: '0.weight' on rank 0, '0.bias' on rank 1)"]
    a, b = desc(), desc()
    a["buckets"], b["buckets"] = [[1, 0]], [[1], [0]]
    assert differences([a, b]) == ["the compressed buckets differ on rank 1 from rank 0's "
                                   "(bucket 0: [1, 0] on rank 0, [1] on rank 1)"]
    b["buckets"] = [[1, 0], [2]]
    assert differences([a, b]) == ["the compressed buckets differ on rank 1 from rank 0's "
                                   "(bucket 1: None on rank 0, [2] on rank 1)"]
    b["settings"]["policy"] = "other"
    assert not any("buckets" in x for x in differences([a, b]))


def test_message_caps_the_list_and_counts_the_rest():
    many = [(f"p{i}", (1,), "float32", True) for i in range(9)]
    msg = explain([desc(), desc(W + many)], "the DistributedOptimizer")
    assert msg.count("\n  - ") == agreement.MAX_SHOWN
    assert "... and 4 more" in msg
    assert msg.startswith("hvdp: the 2 ranks do not agree on the DistributedOptimizer")


def test_variable_length_exchange_and_digest_is_fixed_size():
    assert len(agreement.digest(desc())) == agreement.DIGEST_BYTES
    g = ThreadGather(3)
    res = [None] * 3
    data = [b"a", b"bbbb", b""]

    def one(r):
        res[r] = agreement.allgather_bytes(data[r], g.fn(r), "x")

    ts = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert res == [data] * 3


def test_switch_off(monkeypatch):
    monkeypatch.setenv("HVDP_CHECK_AGREEMENT", "0")
    assert not agreement.enabled()
    errs, calls = run_ranks([desc(), desc(compression="int8")])
    assert errs == [None, None] and calls == []
    monkeypatch.setenv("HVDP_CHECK_AGREEMENT", "1")
    assert agreement.enabled()


@pytest.mark.parametrize("what", ["parameter", "variable"])
def test_word_for_a_tensor(what):
    diffs = differences([desc(), desc(W[:1])], what=what)
    assert diffs == [f"rank 0 has {what} '0.bias' [20] float32 that rank 1 lacks"]
