"""Checkpoints of the trainer: resume gives the losses of an uninterrupted run, also on
another mesh; a kill mid-save or a SIGTERM loses nothing that was committed.

Runs are tiny (1 layer, d_model 64, batch 8 x 32) on the 8 fake CPU devices of conftest.py;
the ones that must be killed or need another device count run as subprocesses.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mamba_jax.data import prepare
from mamba_jax.train import main

ROOT = Path(__file__).parents[1]
SMALL = ["--batch-size", "8", "--seq-len", "32", "--set", "d_model=64", "--set", "n_layer=1",
         "--set", "headdim=16", "--set", "d_state=16", "--set", "chunk_size=16",
         "--eval-every", "1000", "--out", "none", "--warmup", "2"]


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def launch(args, devices=8, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-m", "mamba_jax.train", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """10 steps in one go, checkpointing at 5 and 10: (losses, checkpoint dir)."""
    tmp = tmp_path_factory.mktemp("straight")
    main([*SMALL, "--steps", "10", "--save-every", "5", "--checkpoint-dir", str(tmp / "ck"),
          "--metrics-file", str(tmp / "m.jsonl")])
    return losses(tmp / "m.jsonl"), tmp / "ck"


def test_five_steps_then_resume_to_ten_gives_identical_losses(straight, tmp_path):
    full, ck = straight
    assert len(full) == 10 and np.all(np.isfinite(full))
    shutil.copytree(ck, tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "10")  # as if the run had stopped after step 5
    main([*SMALL, "--steps", "10", "--save-every", "5", "--checkpoint-dir",
          str(tmp_path / "ck"), "--resume", "--metrics-file", str(tmp_path / "m.jsonl")])
    np.testing.assert_array_equal(losses(tmp_path / "m.jsonl"), full[5:])


def test_remat_changes_memory_not_losses(straight, tmp_path):
    main([*SMALL, "--steps", "3", "--remat", "full", "--metrics-file", str(tmp_path / "m")])
    # float32; recomputation may reorder a few sums
    np.testing.assert_allclose(losses(tmp_path / "m"), straight[0][:3], rtol=1e-6)


def test_tp4_checkpoint_resumes_on_one_device_with_the_same_losses(tmp_path):
    main([*SMALL, "--steps", "10", "--save-every", "5", "--mesh", "tp=4,dp=2",
          "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "tp")])
    sharded = losses(tmp_path / "tp")
    shutil.rmtree(tmp_path / "ck" / "10")
    run = launch([*SMALL, "--steps", "10", "--checkpoint-dir", str(tmp_path / "ck"),
                  "--resume", "--metrics-file", str(tmp_path / "one")], devices=1)
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 0, out
    assert "resumed at step 5" in out and "cpu x 1" in out
    # The same float32 sums in another order (psum over tp vs one device).
    np.testing.assert_allclose(losses(tmp_path / "one"), sharded[5:], rtol=1e-5)


def _wait_for(predicate, process, timeout=90):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigkill_mid_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    run = launch([*SMALL, "--steps", "10000", "--save-every", "1", "--keep", "2",
                  "--checkpoint-dir", str(ck)])
    complete = lambda: sorted(int(p.name) for p in ck.glob("*") if p.name.isdigit())
    _wait_for(lambda: len(complete()) >= 2, run)
    run.send_signal(signal.SIGKILL)  # saving every step: most likely in the middle of one
    run.wait(timeout=30)
    steps = complete()
    main([*SMALL, "--steps", str(steps[-1] + 2), "--checkpoint-dir", str(ck), "--resume",
          "--metrics-file", str(tmp_path / "m")])
    resumed = [json.loads(line)["step"] for line in (tmp_path / "m").read_text().splitlines()]
    # It continued from a committed step (the newest, or the one before if that was torn).
    assert resumed[0] - 1 in steps and resumed[-1] == steps[-1] + 2
    assert np.all(np.isfinite(losses(tmp_path / "m")))


def test_sigterm_saves_a_checkpoint_at_the_current_step_and_exits_cleanly(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m"
    run = launch([*SMALL, "--steps", "10000", "--save-every", "10000",
                  "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)])
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, run)
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 0, out
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert "SIGTERM: stopped after step" in out
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == [str(last)]


def test_existing_checkpoints_need_resume_and_the_same_model(straight):
    _, ck = straight
    with pytest.raises(SystemExit, match="already holds checkpoints.*pass --resume"):
        main([*SMALL, "--steps", "12", "--checkpoint-dir", str(ck)])
    with pytest.raises(SystemExit, match="is of another model"):
        main([*SMALL, "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
              "--set", "d_state=8"])


def test_a_diverging_loss_stops_at_the_step_and_keeps_the_last_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    with pytest.raises(SystemExit, match=r"step \d+: the loss is nan"):
        main([*SMALL, "--steps", "50", "--lr", "1e30", "--warmup", "1", "--save-every", "1",
              "--checkpoint-dir", str(ck)])
    assert [p.name for p in ck.iterdir() if p.name.isdigit()]


def test_prepared_data_with_document_boundaries_and_tensorboard(tmp_path):
    docs = [{"text": f"document number {i}: " + "abc " * (i % 7)} for i in range(200)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    prepare([tmp_path / "d.jsonl"], "bytes", tmp_path / "ds", eval_fraction=0.1)
    common = [*SMALL, "--steps", "2", "--data", str(tmp_path / "ds")]
    main([*common, "--metrics-file", str(tmp_path / "packed"), "--tensorboard",
          str(tmp_path / "tb")])
    main([*common, "--metrics-file", str(tmp_path / "docs"), "--no-cross-document-state"])
    # The same tokens: the loss differs only through the state reset at boundaries.
    assert losses(tmp_path / "packed")[0] != losses(tmp_path / "docs")[0]
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
