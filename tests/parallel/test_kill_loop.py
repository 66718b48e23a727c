"""The kill loop (tests/parallel/kill_loop.py) in short: 3 SIGKILLs of random workers at random
moments in one elastic job, int8 with hvdp.torch (writing checkpoints as it goes) and int4 with
hvdp.keras; ``make kill-loop`` runs the long one (20 kills)."""
import os

import pytest

import kill_loop as kl

pytestmark = pytest.mark.parallel

NUM_TRAIN = kl.NUM_TRAIN
KILLS = 3  # 5 took 200 s here and over pytest's 300 s on a slower CI machine; `make kill-loop`: 20
GAPS = dict(min_gap=3, max_gap=8)  # commits after the three workers are back, before the next kill


def run_with_retry(work, **kw):
    """One run; a second (another seed, a fresh directory) only where the first ended in Horovod's
    own C++ abort (kill_loop.HOROVOD_ABORT: not hvdp's to fix, docs/correctness.md); any other
    failure, or that one twice, fails the test."""
    kw = dict(GAPS, **kw)
    res = kl.run(str(work / "kills"), KILLS, **kw)
    if res["rc"] != 0 and res["horovod_abort"]:
        print(f"\nfirst run: Horovod's C++ abort after {len(res['kills'])} kills (hang: {res['hang']}); "
              "one more run")
        res = kl.run(str(work / "kills-again"), KILLS, **dict(kw, seed=kw["seed"] + 100))
    return res


def check_run(res, epochs):
    assert res["rc"] == 0, f"after {len(res['kills'])} kills (hang: {res['hang']}):\n" + res["out"][-4000:]
    assert len(res["kills"]) == KILLS, f"only {len(res['kills'])} of {KILLS} kills fell inside the job"
    steps, finals, superseded = kl.audit_chain(res["log_dir"], NUM_TRAIN, epochs)
    sizes = [s["size"] for s in steps]
    assert sizes.count(2) > 0 and sizes[-1] in (2, 3), sizes  # trained on through the kills
    assert all(k["recovery"] is not None for k in res["kills"]), res["kills"]
    print("\n" + kl.summary(res) + f"\n{len(steps)} committed steps, {superseded} superseded records, "
          f"test loss {finals[0].get('test_loss')}, accuracy {finals[0]['test_accuracy']:.4f}")
    return finals[0]


@pytest.mark.timeout(900)  # the reference, the kill run and a second one where Horovod aborted
def test_kill_loop_torch_int8_with_checkpoints(tmp_path):
    hosts, why = kl.three_hosts()
    if hosts is None:
        pytest.skip(why)
    epochs = 6
    ckpt = str(tmp_path / "ckpt.pt")
    extra = ["--checkpoint", ckpt, "--checkpoint-every", "7"]
    ref = kl.run(str(tmp_path / "reference"), 0, epochs=epochs, timeout=200)
    assert ref["rc"] == 0, ref["out"][-4000:]
    _, ref_finals, _ = kl.audit_chain(ref["log_dir"], NUM_TRAIN, epochs)
    res = run_with_retry(tmp_path, seed=1, epochs=epochs, timeout=300, extra=extra)
    final = check_run(res, epochs)
    # within noise of the run without kills (lr follows the number of workers, so not equal)
    ref_loss = ref_finals[0]["test_loss"]
    print(f"without kills: test loss {ref_loss:.4f}, accuracy {ref_finals[0]['test_accuracy']:.4f}")
    assert final["test_loss"] <= 1.5 * ref_loss + 0.02, (final["test_loss"], ref_loss)
    assert final["test_accuracy"] >= ref_finals[0]["test_accuracy"] - 0.03
    # the last checkpoint written is whole and loads; it is one of the committed steps
    import torch
    saved = torch.load(ckpt, weights_only=True)
    assert saved["extra"]["commits"] % 7 == 0 and saved["model"].keys()
    # a rank 0 killed while writing leaves its temporary file (.ckpt.pt.*.tmp), never a torn ckpt.pt
    left = [f for f in os.listdir(tmp_path) if f.startswith(".ckpt.pt.")]
    print(f"checkpoint: last saved at commit {saved['extra']['commits']}, {len(left)} temporary files left")


@pytest.mark.timeout(900)
def test_kill_loop_keras_int4(tmp_path):
    hosts, why = kl.three_hosts()
    if hosts is None:
        pytest.skip(why)
    epochs = 6
    res = run_with_retry(tmp_path, seed=2, compression="int4", script="keras_elastic.py", epochs=epochs,
                         timeout=400)
    final = check_run(res, epochs)
    assert final["test_accuracy"] >= 0.9, final
