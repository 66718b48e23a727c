"""The elastic order: every sample once per epoch across resets and resizes."""
import collections

import pytest

from hvdp.cluster.elastic import ElasticOrder


class World:
    def __init__(self, size):
        self.size = size


def run_epoch(n, b, sizes_by_step, seed=0, interrupt_at=None):
    """Simulate workers: the world size may change at given steps (a reset re-splits the rest)."""
    world = World(sizes_by_step[0])
    orders = {}
    seen = collections.Counter()
    state = None
    step = 0
    while True:
        size = sizes_by_step.get(step, world.size) if isinstance(sizes_by_step, dict) else world.size
        world.size = size
        orders = [ElasticOrder(n, b, get_rank=(lambda r=r: r), get_size=lambda: world.size, seed=seed)
                  for r in range(size)]
        for o in orders:
            if state:
                o.load_state_dict(state)
        iters = [iter(o) for o in orders]
        progressed = False
        for _ in range(orders[0].steps_left()):
            parts = [next(it) for it in iters]
            if interrupt_at == step:  # a failure: this step is lost, state rolls back
                interrupt_at = None
                break
            for part in parts:
                seen.update(part)
            for o in orders:
                o.record_batch()
            state = orders[0].state_dict()
            step += 1
            progressed = True
            if step in sizes_by_step:
                break
        else:
            return seen
        if not progressed and state is None:
            state = orders[0].state_dict()


@pytest.mark.parametrize("sizes", [{0: 3}, {0: 3, 4: 2}, {0: 2, 3: 3, 7: 2}, {0: 1, 2: 4}])
def test_every_sample_exactly_once(sizes):
    seen = run_epoch(101, 4, sizes)
    assert sorted(seen) == list(range(101)) and set(seen.values()) == {1}


def test_a_lost_step_is_redone_not_skipped():
    seen = run_epoch(50, 3, {0: 3}, interrupt_at=5)
    assert sorted(seen) == list(range(50)) and set(seen.values()) == {1}


def test_order_depends_on_epoch_and_seed_and_short_last_block():
    o = ElasticOrder(10, 4, get_rank=lambda: 1, get_size=lambda: 2, seed=3)
    first = o.order()
    o.set_epoch(1)
    assert o.order() != first and sorted(o.order()) == list(range(10))
    steps = []
    for idx in o:
        steps.append(idx)
        o.record_batch()
    assert [len(s) for s in steps] == [4, 1]  # rank 1 of 2: 8-sample block, then the last 2
    with pytest.raises(ValueError):
        ElasticOrder(0, 4, get_rank=lambda: 0, get_size=lambda: 1)


def samplers(n, size, **kw):
    """Horovod's form (no batch size): one sampler per rank of a world of ``size``."""
    world = World(size)
    return world, [ElasticOrder(n, None, get_rank=(lambda r=r: r), get_size=lambda: world.size, **kw)
                   for r in range(size)]


def test_without_batch_size_every_rank_gets_the_same_count_and_the_rest_after_a_resize():
    world, s = samplers(50, 3, seed=1)
    parts = [list(o) for o in s]
    assert [len(p) for p in parts] == [len(o) for o in s] == [17, 17, 17]
    assert sorted(set(sum(parts, []))) == list(range(50))  # 51 slots: one sample repeated
    order = s[0].order()
    assert parts[1] == (order + order[:1])[1::3]  # elements r, r + size, ... (Horovod's split)
    for o in s:  # two data-loader batches of 4 per rank: 24 samples
        o.record_batch(0, 4)
        o.record_batch(1, 4)
    state = s[0].state_dict()
    world, s2 = samplers(50, 2, seed=1)
    for o in s2:
        o.load_state_dict(state)
    rest = [list(o) for o in s2]
    assert sorted(sum(rest, [])) == sorted(order[24:]) and [len(r) for r in rest] == [13, 13]


def test_without_batch_size_pads_a_short_rest_and_asks_for_horovods_record_batch():
    _, s = samplers(5, 4, shuffle=False)
    for o in s:
        o.record_batch(0, 1)  # 4 of 5 processed: one sample left for 4 ranks
    assert [list(o) for o in s] == [[4]] * 4
    with pytest.raises(ValueError, match=r"record_batch\(batch_idx, batch_size\)"):
        s[0].record_batch()
    with pytest.raises(TypeError, match="shuffle=False"):
        ElasticOrder(5, False, get_rank=lambda: 0, get_size=lambda: 1)
