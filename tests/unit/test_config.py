"""hvdp.config: the environment variables hvdp reads, read in one place."""
from hvdp import config, mesh


def test_elastic_mode_reads_horovod_elastic(monkeypatch):
    assert config.HOROVOD_ELASTIC == "HOROVOD_ELASTIC"
    assert config.elastic_mode({"HOROVOD_ELASTIC": "1"})
    for off in ({}, {"HOROVOD_ELASTIC": "0"}, {"HOROVOD_ELASTIC": ""}):
        assert not config.elastic_mode(off), off
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert config.elastic_mode() and not config.elastic_mode({})  # a given mapping wins
    assert mesh.elastic_refusal() is not None
    monkeypatch.delenv("HOROVOD_ELASTIC")
    assert not config.elastic_mode() and mesh.elastic_refusal() is None
