"""The doctor's judgements, from facts written by hand (no probe, no processes)."""
from hvdp.doctor import framework_pitfalls, hang_settings


def test_doctor_names_a_framework_upgraded_after_the_build():
    versions = {"torch": "2.14.1+cu130", "tensorflow": "2.21.0"}
    loaded = {"torch": {"ok": False, "error": "undefined symbol: _ZN3c10..."}, "tensorflow": {"ok": True}}
    (problem, fix), = framework_pitfalls(versions, {"torch": "2.13.0+cpu", "tensorflow": "2.21.0"}, loaded)
    assert "built against torch 2.13.0+cpu, but torch 2.14.1+cu130 is installed" in problem
    assert "python -m hvdp install-horovod" in fix
    (problem, fix), = framework_pitfalls(versions, {"tensorflow": "2.21.0"}, loaded)
    assert "does not load" in problem and "built without torch" in fix
    assert framework_pitfalls(versions, {"torch": "2.14.1", "tensorflow": "2.21.0"},
                              {"torch": {"ok": True}, "tensorflow": {"ok": True}}) == []


def test_doctor_advises_on_what_ends_a_stalled_job():
    notes, problems = hang_settings({})
    assert problems == [] and any("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=600" in n for n in notes)
    assert any("hvdp's watchdog ends a stall in hvdp's collectives, and in Horovod's that the script calls "
               "through hvdp.torch / hvdp.keras, after 600 s" in n for n in notes)
    notes, _ = hang_settings({"HVDP_STALL_TIMEOUT_SECONDS": "0"})
    assert any("nothing ends it" in n for n in notes)
    assert hang_settings({"HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
                          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "600"}) == ([], [])
    _, problems = hang_settings({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"})
    assert "never shuts a stalled job down" in problems[0][0]
    _, problems = hang_settings({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "600"})
    assert "wait forever" in problems[0][0]
    notes, _ = hang_settings({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "600", "HVDP_CHECK_AGREEMENT": "0"})
    assert len(notes) == 1 and "hang" in notes[0]
