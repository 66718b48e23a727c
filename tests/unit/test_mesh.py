"""hvdp.cluster.mesh: rank order, coordinates, groups, and the errors that name the fix (no processes)."""
import pytest

from hvdp.cluster import mesh
from hvdp.cluster.mesh import Coords, HorovodSets, MeshError, MeshLayout, ProcessMesh


def test_rank_order_tp_innermost_then_dp_then_pp():
    lay = MeshLayout(dp=2, tp=2, pp=2)
    assert [lay.coords(r) for r in range(8)] == [
        Coords(pp, dp, tp) for pp in range(2) for dp in range(2) for tp in range(2)]
    assert all(lay.rank_of(*lay.coords(r)) == r for r in range(8))


def test_groups_of_a_3d_mesh():
    lay = MeshLayout(dp=2, tp=2, pp=2)
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.group("dp", 5) == [5, 7] and lay.group("pp", 5) == [1, 5]
    # every rank lies in exactly one group per axis, and groups of different axes meet in one rank
    for axis in ("dp", "tp", "pp"):
        assert sorted(r for g in lay.groups(axis) for r in g) == list(range(8))
    assert set(lay.group("dp", 3)) & set(lay.group("tp", 3)) & set(lay.group("pp", 3)) == {3}


def test_process_set_ranks_drop_the_world_and_repeats():
    # dp=4 alone: the DP group is the whole world (Horovod's global set); tp and pp are the same
    # singletons, listed once
    lay = MeshLayout(dp=4)
    assert lay.process_set_ranks() == [[0], [1], [2], [3]]
    assert MeshLayout(dp=2, tp=2).process_set_ranks() == [[0, 2], [1, 3], [0, 1], [2, 3], [0], [1], [2], [3]]
    assert len(MeshLayout(dp=2, tp=2, pp=2).process_set_ranks()) == 12


@pytest.mark.parametrize("kw", [dict(dp=0), dict(tp=-1), dict(pp=1.5), dict(dp=True)])
def test_bad_axis_size_is_named(kw):
    with pytest.raises(MeshError, match="int >= 1"):
        MeshLayout(**kw)


def test_world_mismatch_names_sizes_that_fit():
    with pytest.raises(MeshError, match=r"spans 6 ranks but the job has 4.*e.g. dp=2 .*-np 6"):
        MeshLayout(dp=3, tp=2).check_world(4)
    with pytest.raises(MeshError, match="unknown mesh axis 'xp'"):
        MeshLayout(dp=2).group("xp", 0)
    with pytest.raises(MeshError, match="outside"):
        MeshLayout(dp=2).coords(2)


def test_table_lists_every_rank():
    t = MeshLayout(dp=2, tp=2).table().splitlines()
    assert len(t) == 2 + 4 and t[-1].split()[:4] == ["3", "0", "1", "1"]


class FakeSet:
    def __init__(self, ranks):
        self.ranks, self.process_set_id = sorted(ranks), None


class FakeHorovod:
    """Horovod's process-set calls, recorded; ids assigned as Horovod does (global = 0)."""

    def __init__(self, rank, size):
        self.added, self.next_id = [], 1
        glob = FakeSet(range(size))
        glob.process_set_id = 0
        self.hv = HorovodSets(lambda: rank, lambda: size, FakeSet, self.add, glob)

    def add(self, ps):
        ps.process_set_id, self.next_id = self.next_id, self.next_id + 1
        self.added.append(ps.ranks)
        return ps

    def init_static(self, sets):  # hvd.init(process_sets=...) registers them
        for ps in sets:
            ps.process_set_id, self.next_id = self.next_id, self.next_id + 1


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(mesh, "_KNOWN", {})
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS", raising=False)
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)


def mesh_class(fake):
    return type("Mesh", (ProcessMesh,), {"hv": fake.hv})


def test_dynamic_sets_added_once_in_order(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    fake = FakeHorovod(rank=3, size=4)
    m = mesh_class(fake)(dp=2, tp=2)
    assert fake.added == MeshLayout(dp=2, tp=2).process_set_ranks()
    assert (m.dp.ranks, m.tp.ranks, m.pp.ranks) == ([1, 3], [2, 3], [3])
    assert (m.dp_rank, m.dp_size, m.tp_rank, m.pp_rank, m.dp_root, m.tp_root) == (1, 2, 1, 0, 1, 2)
    again = mesh_class(fake)(dp=2, tp=2)  # reuses: Horovod refuses duplicates
    assert len(fake.added) == 8 and again.dp is m.dp


def test_group_spanning_the_world_is_the_global_set(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    fake = FakeHorovod(rank=1, size=4)
    m = mesh_class(fake)(dp=4)
    assert m.dp.process_set_id == 0 and m.tp.ranks == [1] and m.dp_size == 4


def test_static_sets_registered_at_init_are_found():
    fake = FakeHorovod(rank=2, size=8)
    cls = mesh_class(fake)
    sets = cls.static_process_sets(dp=2, tp=2, pp=2)
    fake.init_static(sets)
    m = cls(dp=2, tp=2, pp=2)
    assert fake.added == [] and m.dp.ranks == [0, 2] and m.pp.ranks == [2, 6] and m.dp in sets


def test_static_sets_passed_explicitly_are_found():
    fake = FakeHorovod(rank=0, size=4)
    sets = [FakeSet(g) for g in MeshLayout(dp=2, tp=2).process_set_ranks()]
    fake.init_static(sets)
    m = mesh_class(fake)(dp=2, tp=2, process_sets=sets)
    assert fake.added == [] and m.dp is sets[0]


def test_no_dynamic_sets_and_none_registered_names_both_fixes():
    fix = r"process_sets='dynamic'.*HOROVOD_DYNAMIC_PROCESS_SETS=1.*static_process_sets\(dp=2, tp=2, pp=1\)"
    with pytest.raises(MeshError, match=fix):
        mesh_class(FakeHorovod(rank=0, size=4))(dp=2, tp=2)


def test_wrong_world_size_is_refused_before_any_set_is_added(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    fake = FakeHorovod(rank=0, size=4)
    with pytest.raises(MeshError, match="spans 8 ranks but the job has 4"):
        mesh_class(fake)(dp=2, tp=2, pp=2)
    assert fake.added == []


def test_elastic_job_is_refused(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(MeshError, match="elastic.*process sets across a reset"):
        mesh_class(FakeHorovod(rank=0, size=4))(dp=2, tp=2)


def test_a_set_registered_elsewhere_is_named(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    fake = FakeHorovod(rank=0, size=4)

    def duplicate(ps):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    fake.hv = fake.hv._replace(add_process_set=duplicate)
    fix = r"already has a process set with ranks \[0, 2\].*process_sets=\[\.\.\.\]"
    with pytest.raises(MeshError, match=fix):
        mesh_class(fake)(dp=2, tp=2)


def test_dynamic_sets_switched_on_too_late_are_named(monkeypatch):
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")  # but Horovod started without it
    fake = FakeHorovod(rank=0, size=4)

    def refused(ps):
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after "
                         "Horovod initialization.")
    fake.hv = fake.hv._replace(add_process_set=refused)
    with pytest.raises(MeshError, match=r"must be on when Horovod starts.*before hvd.init"):
        mesh_class(fake)(dp=2, tp=2)
