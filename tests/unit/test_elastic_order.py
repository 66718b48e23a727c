"""The elastic order: every sample once per epoch across resets and resizes."""
import collections

import pytest

from hvdp.elastic import ElasticOrder


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
