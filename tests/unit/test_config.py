"""hvdp.config: the environment variables hvdp reads, read in one place under one rule
(booleans 1/0/true/false/yes/no/on/off in any case; integers in range; anything else an error
naming the variable, the value and what it accepts)."""
import os
import re

import pytest

from hvdp.cluster import agreement, mesh

from hvdp import config
from hvdp.cluster.boards import DirBoard, board_from_env
from hvdp.kernels import registry
from hvdp.reduce.plan import DEFAULT_FUSION_BYTES, DEFAULT_MIN_ELEMENTS, CompressionPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ON = ["1", "true", "TRUE", "Yes", "on", " ON "]
OFF = ["0", "false", "False", "no", "NO", "off", "Off "]
NOT_BOOLEANS = ["2", "maybe", "enable", "y", "-1", "disabled"]
BOOLEAN_WORDS = "1, true, yes, on (on) or 0, false, no, off (off), in any case"


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


# --- booleans ---------------------------------------------------------------------------------
BOOLEANS = [  # (variable, its reader on a mapping, default)
    ("HVDP_COMPILE_CODECS", config.compile_codecs_default, False),
    ("HVDP_OVERLAP", config.overlap, True),
    ("HVDP_SLEEPING_WAIT", config.sleeping_wait, True),
    ("HVDP_CHECK_AGREEMENT", agreement.enabled, True),
    ("HVDP_FAILURE_BOARD", lambda env: board_from_env(dict(env, PMIX_NAMESPACE="job-7")) is not None, True),
]


@pytest.mark.parametrize("name,read,default", BOOLEANS, ids=[b[0] for b in BOOLEANS])
def test_booleans_take_the_words_and_refuse_anything_else(name, read, default):
    assert read({}) is default and read({name: ""}) is default and read({name: "  "}) is default
    for v in ON:
        assert read({name: v}) is True, v
    for v in OFF:
        assert read({name: v}) is False, v
    for v in NOT_BOOLEANS:
        with pytest.raises(ValueError) as e:
            read({name: v})
        msg = str(e.value)
        assert msg.startswith(f"{name}={v!r} is not a boolean: give one of {BOOLEAN_WORDS}"), msg
        assert f"default ({'on' if default else 'off'})" in msg


def test_booleans_read_the_process_environment(monkeypatch):
    monkeypatch.setenv("HVDP_CHECK_AGREEMENT", "no")
    assert not agreement.enabled() and not config.check_agreement()
    monkeypatch.setenv("HVDP_FAILURE_BOARD", "maybe")
    monkeypatch.setenv("PMIX_NAMESPACE", "job-7")
    with pytest.raises(ValueError, match="HVDP_FAILURE_BOARD='maybe' is not a boolean"):
        board_from_env()
    monkeypatch.setenv("HVDP_FAILURE_BOARD", "Yes")
    assert isinstance(board_from_env(), DirBoard)


def test_torch_optimizer_refuses_a_bad_hvdp_compile_codecs(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("horovod.torch")
    import hvdp.torch as hvd
    monkeypatch.setenv("HVDP_COMPILE_CODECS", "true-ish")
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="HVDP_COMPILE_CODECS='true-ish' is not a boolean"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)],
                                 compression="int8")


# --- choices ----------------------------------------------------------------------------------
def test_hvdp_kernels_is_auto_or_off(monkeypatch):
    assert config.kernels_mode({}) == "auto" and config.kernels_mode({"HVDP_KERNELS": ""}) == "auto"
    assert config.kernels_mode({"HVDP_KERNELS": "OFF"}) == "off"
    assert config.kernels_mode({"HVDP_KERNELS": "Auto"}) == "auto"
    for v in ("0", "fast", "no"):
        with pytest.raises(ValueError, match=f"HVDP_KERNELS='{v}' is not one of auto, off"):
            config.kernels_mode({"HVDP_KERNELS": v})
    monkeypatch.setenv("HVDP_KERNELS", "off")
    assert registry.mode() == "off"


# --- integers ---------------------------------------------------------------------------------
INTEGERS = [  # (variable, its reader on the process environment, default, smallest valid)
    ("HVDP_FUSION_THRESHOLD", lambda: CompressionPolicy().fusion_threshold_bytes, DEFAULT_FUSION_BYTES, 1),
    ("HVDP_MIN_COMPRESS_ELEMENTS", lambda: CompressionPolicy().min_elements, DEFAULT_MIN_ELEMENTS, 0),
]


@pytest.mark.parametrize("name,read,default,low", INTEGERS, ids=[i[0] for i in INTEGERS])
def test_integers_must_parse_and_be_in_range(monkeypatch, name, read, default, low):
    monkeypatch.delenv(name, raising=False)
    assert read() == default
    monkeypatch.setenv(name, "")
    assert read() == default
    for v, want in ((str(low), low), ("4096", 4096), (" 77 ", 77)):
        monkeypatch.setenv(name, v)
        assert read() == want, v
    valid = f"give a whole number >= {low}, or unset it for the default ({default})"
    for v in (str(low - 1), "-1", "-100"):
        monkeypatch.setenv(name, v)
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == f"{name}={v!r} is out of range: {valid}"
    for v in ("x", "16MiB", "1e6", "1.5"):
        monkeypatch.setenv(name, v)
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == f"{name}={v!r} is not an integer: {valid}"


def test_explicit_policy_values_ignore_the_environment(monkeypatch):
    monkeypatch.setenv("HVDP_FUSION_THRESHOLD", "0")  # not read when the policy gives a value
    assert CompressionPolicy(fusion_threshold_bytes=64, min_elements=0).fusion_threshold_bytes == 64


def test_ddp_port_and_address():
    assert config.ddp_port(29555, {}) == 29555 and config.ddp_port(1, {"HVDP_DDP_PORT": "29600"}) == 29600
    for v in ("0", "65536"):
        with pytest.raises(ValueError, match=f"HVDP_DDP_PORT='{v}' is out of range: give a whole number "
                                             "from 1 to 65535"):
            config.ddp_port(29555, {"HVDP_DDP_PORT": v})
    assert config.ddp_addr({}) == "127.0.0.1" and config.ddp_addr({"HVDP_DDP_ADDR": " 10.0.0.2"}) == "10.0.0.2"


# --- paths ------------------------------------------------------------------------------------
def test_hvdp_cache_dir_moves_the_wheel_cache(monkeypatch, tmp_path):
    from hvdp.install.build import default_cache
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path))
    assert config.cache_dir() == str(tmp_path) and default_cache() == os.path.join(str(tmp_path), "wheels")
    monkeypatch.setenv("HVDP_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir() is None and default_cache() == str(tmp_path / "xdg" / "hvdp" / "wheels")


# --- all of them at once, and only here -------------------------------------------------------
def test_problems_lists_every_refused_value():
    assert config.problems({}) == []
    assert config.problems({"HVDP_CHECK_AGREEMENT": "off", "HVDP_FUSION_THRESHOLD": "1024"}) == []
    bad = {"HVDP_COMPILE_CODECS": "2", "HVDP_CHECK_AGREEMENT": "maybe", "HVDP_FAILURE_BOARD": "maybe",
           "HVDP_KERNELS": "fast", "HVDP_FUSION_THRESHOLD": "0", "HVDP_MIN_COMPRESS_ELEMENTS": "-1",
           "HVDP_DDP_PORT": "http"}
    found = config.problems(bad)
    assert [p.split("=")[0] for p, _ in found] == list(bad), found
    assert all(fix == f"fix or unset {p.split('=')[0]}" for p, fix in found)


def test_doctor_reports_a_bad_value_instead_of_failing():
    from hvdp.doctor import hang_settings
    notes, problems = hang_settings({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "600", "HVDP_CHECK_AGREEMENT": "maybe"})
    assert notes == [] and problems == []  # config.problems, in diagnose(), names it


def test_no_other_module_reads_an_hvdp_variable():
    """Every read of an HVDP_* variable in hvdp/, adapters/, examples/ and benchmarks/ goes
    through hvdp.config (writes, e.g. a script setting HVDP_KERNELS for a child, are fine)."""
    read = re.compile(r"(environ|env)\s*(\.get\(|\[)\s*[\"']?HVDP_|getenv\(\s*[\"']?HVDP_")
    offenders = []
    for top in ("hvdp", "adapters", "examples", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(folder, f)
                if not f.endswith(".py") or path == os.path.join(ROOT, "hvdp", "config.py"):
                    continue
                with open(path) as fh:
                    for n, line in enumerate(fh, 1):
                        if read.search(line) and not re.search(r"\]\s*=[^=]|\.pop\(", line):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_hvdp_cache_dir_moves_the_kernel_cache_too(monkeypatch, tmp_path):
    from hvdp.kernels import build
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HVDP_CACHE_DIR", raising=False)
    assert build.cache_root() == str(tmp_path / "xdg" / "hvdp" / "kernels")
    monkeypatch.setenv("HVDP_CACHE_DIR", str(tmp_path / "moved"))
    assert build.cache_root() == str(tmp_path / "moved" / "kernels")
    assert build.places("k")[0] == (str(tmp_path / "moved"), ("kernels", "k"))
