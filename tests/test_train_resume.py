"""Checkpoints of the trainer: resume gives the losses of an uninterrupted run, also on
another mesh; a kill mid-save or a SIGTERM loses nothing that was committed.

Runs are tiny (1 layer, d_model 64, batch 8 x 32) on the 8 fake CPU devices of conftest.py;
the ones that must be killed or need another device count run as subprocesses.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import mamba_jax
from bpe import EOS_ID, PAD_ID, VOCAB, bpe_tokenizer
from mamba_jax.cli import UserExit
from mamba_jax.data import DEFAULT_CORPUS, prepare
from mamba_jax.files import locked
from mamba_jax.generate import load_for_generation
from mamba_jax.tokenizer import load_tokenizer
from mamba_jax.train import main
from mesh_check import xla_flags

ROOT = Path(__file__).parents[1]
SMALL = ["--batch-size", "8", "--seq-len", "32", "--set", "d_model=64", "--set", "n_layer=1",
         "--set", "headdim=16", "--set", "d_state=16", "--set", "chunk_size=16",
         "--eval-every", "0", "--out", "none", "--warmup", "2"]
# The learning rate's schedule (--lr, --steps, --warmup) is compiled into the step: the runs
# here train --steps 2 or 10 (the resumed run's) where the count is theirs to choose, so
# that most of them run a step program compiled before (jax's compilation cache). They
# evaluate only where a test asks for it (--eval-every N after SMALL).


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def launch(args, devices=8, **kwargs):
    """The trainer in a process of its own with `devices` CPU devices."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices)}
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


def test_a_resume_that_changes_the_data_order_or_the_schedule_says_so(straight, tmp_path,
                                                                      capsys):
    _, ck = straight
    batches = ("(from the checkpoint's run): the steps from here train on other batches than "
               "that run would have")
    rates = "(from the checkpoint's run): the learning rate from here follows this run's " \
        "schedule, not that run's"
    # Each resume restores step 10 and is said to have nothing to train: the note comes
    # with the restore, before any step (a step of each would compile a program of its own).
    for changed, notes in (([], []), (["--seed", "7"], [f"--seed 0 -> 7 {batches}"]),
                           (["--batch-size", "16"], [f"--batch-size 8 -> 16 {batches}"]),
                           (["--steps", "9", "--lr", "0.001"],
                            [f"--lr 0.003 -> 0.001, --steps 10 -> 9 {rates}"])):
        shutil.rmtree(tmp_path / "ck", ignore_errors=True)
        shutil.copytree(ck, tmp_path / "ck")
        capsys.readouterr()
        main([*SMALL, "--steps", "10", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
              *changed])
        said = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("resumed with")]
        assert said == [f"resumed with {note}" for note in notes]


def test_a_resume_knows_its_data_and_tokenizer_by_their_contents(straight, tmp_path, capsys):
    """Not by the paths the flags gave: the same data elsewhere is no change (it was said
    to be one), other data at the same path is (it was not), and another tokenizer is
    refused where the folder's copy of the run's is gone (it trained on)."""
    from mamba_jax.train import _DATA_ORDER, _SCHEDULE, _note_changes

    _, ck = straight
    shutil.copytree(ck, tmp_path / "ck")  # resumed at step 10: nothing to train
    shutil.copy(DEFAULT_CORPUS, tmp_path / "corpus.txt")
    capsys.readouterr()
    main([*SMALL, "--steps", "10", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
          "--data", str(tmp_path / "corpus.txt")])
    assert "resumed with" not in capsys.readouterr().err
    run = {**dict.fromkeys(_DATA_ORDER + _SCHEDULE, 1), "data": ["d"],
           "data_identity": [[1.0, "a"]]}
    _note_changes(run, {**run, "data_identity": [[1.0, "b"]]})
    assert capsys.readouterr().err.startswith("resumed with --data ['d'] (its contents "
                                              "changed) (from the checkpoint's run)")
    (tmp_path / "ck" / "tokenizer.json").unlink()
    bpe_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(SystemExit, match=r"checkpoint 10 in \S+ was trained with another "
                                         r"tokenizer \(bytes\) than \S+tokenizer.json; pass "
                                         "that one with --tokenizer"):
        main([*SMALL, "--steps", "10", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
              "--tokenizer", str(tmp_path / "tokenizer.json")])


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


def test_sigkill_mid_save_resumes_from_the_last_complete_checkpoint(tmp_path, capsys, caplog):
    ck = tmp_path / "ck"
    run = launch([*SMALL, "--steps", "10000", "--save-every", "1", "--keep", "2",
                  "--checkpoint-dir", str(ck)])
    complete = lambda: sorted(int(p.name) for p in ck.glob("*") if p.name.isdigit())
    _wait_for(lambda: len(complete()) >= 2, run)
    run.send_signal(signal.SIGKILL)  # saving every step: most likely in the middle of one
    run.wait(timeout=30)
    steps = complete()
    # a killed save's folder of the step the resumed run saves (at its end)
    (ck / f"{steps[-1] + 2}.orbax-checkpoint-tmp").mkdir(exist_ok=True)
    main([*SMALL, "--steps", str(steps[-1] + 2), "--checkpoint-dir", str(ck), "--resume",
          "--metrics-file", str(tmp_path / "m")])
    # Orbax's "WARNING:absl:Attempted to create temporary directory ... already exists.
    # Removing existing directory since it is not finalized." as it saves that step again
    # is its bookkeeping: not printed
    assert "Attempted to create temporary directory" not in caplog.text
    assert "absl" not in capsys.readouterr().err
    resumed = [json.loads(line)["step"] for line in (tmp_path / "m").read_text().splitlines()]
    # It continued from a committed step (the newest, or the one before if that was torn).
    assert resumed[0] - 1 in steps and resumed[-1] == steps[-1] + 2
    assert np.all(np.isfinite(losses(tmp_path / "m")))


def test_sigterm_saves_a_checkpoint_at_the_current_step_and_exits_unfinished(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m"
    run = launch([*SMALL, "--steps", "10000", "--save-every", "10000",
                  "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)])
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, run)
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=60)
    # 128 + SIGTERM, as a shell reports it: `train && generate` stops, and a scheduler (a
    # Kubernetes job) sees a job to run again, which exit status 0 told it was done.
    assert run.returncode == 143, out
    assert "Traceback" not in out
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert "SIGTERM: stopped after step" in out
    assert sorted(p.name for p in ck.iterdir() if p.name.isdigit()) == [str(last)]


def test_ctrl_c_without_a_checkpoint_dir_says_that_nothing_was_saved(tmp_path):
    metrics = tmp_path / "m"
    run = launch([*SMALL, "--steps", "10000", "--metrics-file", str(metrics)])
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, run)
    run.send_signal(signal.SIGINT)  # Ctrl-C
    out, _ = run.communicate(timeout=60)
    assert run.returncode == 130, out
    assert "SIGINT: stopped after step" in out
    assert "nothing saved (--out is written when the run ends; --checkpoint-dir DIR" in out


def test_ctrl_c_outside_the_steps_is_one_line_and_status_130(capsys):
    # While a command compiles, restores or converts: it was a traceback of jax's frames.
    from mamba_jax.cli import command

    @command("python -m mamba_jax.convert")
    def interrupted(argv=None):
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as stop:
        interrupted()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "python -m mamba_jax.convert: interrupted\n"


def test_existing_checkpoints_need_resume_and_the_same_model(straight):
    _, ck = straight
    with pytest.raises(SystemExit, match="already holds checkpoints.*pass --resume"):
        main([*SMALL, "--steps", "12", "--checkpoint-dir", str(ck)])
    # the fields that differ, named as --set spells them, not the whole config
    with pytest.raises(SystemExit, match=r"is of another model: mamba2\.d_state 16 in the "
                       r"checkpoint, 8 here; use its --preset/--set"):
        main([*SMALL, "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
              "--set", "d_state=8"])
    with pytest.raises(SystemExit, match=r"another model: d_model 64 in the checkpoint, 32 "
                       r"here; mamba2\.headdim"):
        main([*SMALL, "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
              "--set", "d_model=32", "--set", "headdim=8"])


def test_a_resume_at_or_past_its_steps_says_there_is_nothing_to_train(straight, tmp_path,
                                                                      capsys):
    _, ck = straight
    shutil.copytree(ck, tmp_path / "ck")
    main([*SMALL, "--steps", "8", "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
          "--metrics-file", str(tmp_path / "m.jsonl")])
    assert "the checkpoint's step 10 is at --steps 8 or past it: nothing to train" in \
        capsys.readouterr().err
    assert losses(tmp_path / "m.jsonl") == []


def test_a_diverging_loss_stops_at_the_step_and_keeps_the_last_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    with pytest.raises(SystemExit, match=r"step \d+: the loss is nan") as stop:
        main([*SMALL, "--steps", "50", "--lr", "1e30", "--warmup", "1", "--save-every", "1",
              "--checkpoint-dir", str(ck)])
    # a float32 run is not told to use float32
    assert str(stop.value).endswith("Lower --lr, raise --warmup")
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


def test_the_evaluation_is_the_same_on_every_mesh(tmp_path):
    """Two datasets of 6 held-out windows each, on 8 data shards and on 2: every window
    counts once, each row alike (batches the shards did not divide were cut, or skipped,
    and their means averaged: the loss differed by mesh, or was NaN)."""
    text = DEFAULT_CORPUS.read_text()
    for name in ("a", "b"):
        for i in range(2):
            (tmp_path / f"{name}{i}.txt").write_text(text[i * 200:(i + 1) * 200])
        prepare([tmp_path / f"{name}0.txt", tmp_path / f"{name}1.txt"], "bytes",
                tmp_path / name, eval_fraction=0.5)
    evaluations = []
    for mesh in ("dp=8", "dp=2,tp=4"):
        metrics = tmp_path / f"{mesh}.jsonl"
        main([*SMALL, "--data", "0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "b"),
              "--steps", "10", "--eval-every", "10", "--mesh", mesh, "--metrics-file",
              str(metrics)])
        evaluations.append(json.loads(metrics.read_text().splitlines()[-1])["eval_loss"])
    assert np.isfinite(evaluations[0])
    # float32 sums in another order under tp; the old averages differed by 1.5e-3
    np.testing.assert_allclose(evaluations[0], evaluations[1], rtol=1e-5)


def test_a_dataset_without_held_out_windows_trains_without_evaluation_then_saves_and_exports(
        tmp_path, capsys):
    (tmp_path / "one.txt").write_text(DEFAULT_CORPUS.read_text()[:20000])
    prepare([tmp_path / "one.txt"], "bytes", tmp_path / "ds")  # one document: none held out
    ck, out = tmp_path / "ck", tmp_path / "out"
    main([*SMALL, "--data", str(tmp_path / "ds"), "--steps", "2", "--eval-every", "1",
          "--checkpoint-dir", str(ck), "--out", str(out)])
    err = capsys.readouterr().err
    assert "the held-out split has no window" in err and "this run does not evaluate" in err
    assert [p.name for p in ck.iterdir() if p.name.isdigit()] == ["2"]
    assert mamba_jax.from_pretrained(out).config.n_layer == 1
    # The example prompt comes from the training data.
    assert f"--checkpoint {out} --prompt 'Licence texts from'" in err
    config = json.loads((out / "config.json").read_text())
    assert [config[f"{t}_token_id"] for t in ("bos", "eos", "pad")] == [None] * 3  # bytes


def test_a_checkpoint_that_cannot_be_written_stops_the_run_at_once_keeping_the_one_before(
        tmp_path, monkeypatch, capsys):
    from orbax.checkpoint._src.serialization import serialization

    write = serialization.async_serialize_from_host

    async def disk_full_at_step_20(rslices, spec, **kwargs):
        if "/20.orbax-checkpoint-tmp/" in json.dumps(spec):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await write(rslices, spec, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", disk_full_at_step_20)
    ck, metrics = tmp_path / "ck", tmp_path / "m"
    with pytest.raises(SystemExit) as stopped:
        main([*SMALL, "--steps", "40", "--save-every", "10", "--checkpoint-dir", str(ck),
              "--metrics-file", str(metrics)])
    assert stopped.value.code == 2
    assert "checkpoint 20 could not be written" in str(stopped.value)
    assert "No space left on device" in str(stopped.value)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("could not be written") == 1
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["10"]  # no partial save
    # Stopped once the failure reached the trainer (within a step or two, more where the
    # cores are busy), before the next save, step 30, would have found it.
    assert max(json.loads(line)["step"] for line in metrics.read_text().splitlines()) < 30
    monkeypatch.undo()
    main([*SMALL, "--steps", "10", "--checkpoint-dir", str(ck), "--resume"])  # restored
    assert "resumed at step 10" in capsys.readouterr().err


def test_a_second_trainer_on_one_checkpoint_dir_is_refused_naming_it(tmp_path):
    with locked(tmp_path / "ck", "training run"):  # what a running trainer holds
        with pytest.raises(SystemExit, match=f"{tmp_path / 'ck'} is in use by another training "
                                             "run"):
            main([*SMALL, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck")])


def test_resume_without_a_checkpoint_is_refused_and_resume_if_exists_starts_fresh(tmp_path):
    typo = tmp_path / "typo"
    with pytest.raises(SystemExit, match=f"--resume: --checkpoint-dir {typo} does not exist"):
        main([*SMALL, "--steps", "1", "--checkpoint-dir", str(typo), "--resume"])
    assert not typo.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=f"--checkpoint-dir {empty} holds no checkpoint.*"
                                         "--resume-if-exists"):
        main([*SMALL, "--steps", "1", "--checkpoint-dir", str(empty), "--resume"])
    main([*SMALL, "--steps", "2", "--checkpoint-dir", str(empty), "--resume-if-exists"])
    assert (empty / "2").is_dir()


def test_a_resumed_run_logs_each_step_once(straight, tmp_path):
    full, ck = straight
    shutil.copytree(ck, tmp_path / "ck")
    shutil.copy(ck.parent / "m.jsonl", tmp_path / "m.jsonl")  # steps 1-10, as logged
    shutil.rmtree(tmp_path / "ck" / "10")  # killed after step 10, before its checkpoint
    main([*SMALL, "--steps", "10", "--save-every", "5", "--checkpoint-dir",
          str(tmp_path / "ck"), "--resume", "--metrics-file", str(tmp_path / "m.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11))
    np.testing.assert_array_equal([r["loss"] for r in rows], full)


def test_a_bpe_dataset_trains_and_exports_with_its_tokenizer_vocabulary_and_eos(tmp_path):
    tokenizer = bpe_tokenizer(tmp_path / "tokenizer.json")
    paragraphs = [p for p in DEFAULT_CORPUS.read_text().split("\n\n") if p.strip()][:200]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in paragraphs))
    prepare([tmp_path / "d.jsonl"], tmp_path / "tokenizer.json", tmp_path / "ds",
            eval_fraction=0.1)
    (tmp_path / "tokenizer.json").unlink()  # the dataset keeps a copy
    with pytest.raises(SystemExit, match=r"--data .*ds was prepared with .*ds/tokenizer.json, "
                                         r"not --tokenizer \(bytes\)"):
        main([*SMALL, "--data", str(tmp_path / "ds"), "--tokenizer", "bytes", "--steps", "1"])
    out = tmp_path / "out"
    main([*SMALL, "--data", str(tmp_path / "ds"), "--steps", "1", "--out", str(out)])
    assert load_tokenizer(out / "tokenizer.json").to_str() == tokenizer.to_str()
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 304  # the tokenizer's 300 (the preset has 256), padded
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        EOS_ID, EOS_ID, PAD_ID)
    _, loaded_tokenizer, eos = load_for_generation(out)
    assert eos == EOS_ID and loaded_tokenizer.get_vocab_size() == VOCAB


def test_a_trainers_checkpoint_dir_exports_and_generates_as_its_final_export(tmp_path,
                                                                             capsys,
                                                                             monkeypatch):
    from mamba_jax.convert import main as convert
    from mamba_jax.generate.__main__ import main as generate

    ck, final = tmp_path / "ck", tmp_path / "final"
    main([*SMALL, "--steps", "2", "--save-every", "1", "--checkpoint-dir", str(ck),
          "--out", str(final)])
    convert([str(ck), str(tmp_path / "hf"), "--to", "hf"])  # the newest step, 2
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == load_file(final / "model.safetensors").keys()
    for key, value in load_file(final / "model.safetensors").items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (final / "config.json").read_text())
    convert([str(ck), str(tmp_path / "one"), "--to", "mamba_ssm", "--step", "1"])
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"no checkpoint of step 7; it holds steps \[1, 2\]"):
        convert([str(ck), str(tmp_path / "seven"), "--to", "hf", "--step", "7"])
    capsys.readouterr()
    prompt = ["--prompt", "GNU", "--max-new-tokens", "6"]
    generate(["--checkpoint", str(ck), *prompt])
    from_checkpoint = capsys.readouterr().out
    generate(["--checkpoint", str(final), *prompt])
    assert from_checkpoint == capsys.readouterr().out and from_checkpoint.startswith("GNU")
    # Nothing else is written into a checkpoints folder: a model there hid its checkpoints
    # from generate and convert, and replaced its tokenizer and train_config.json copies.
    from mamba_jax.data import main as data_main
    before = sorted(p.name for p in ck.iterdir())
    for write, name, where in [
            (lambda: convert([str(ck), str(ck), "--to", "hf"]), "dst", "is"),
            (lambda: convert([str(final), str(ck / "9"), "--to", "hf"]), "dst", "is inside"),
            (lambda: main([*SMALL, "--steps", "1", "--out", str(ck)]), "--out", "is"),
            (lambda: data_main(["prepare", str(ROOT / "README.md"), "--tokenizer", "bytes",
                              "--out", str(ck)]), "prepare: --out", "is")]:
        with pytest.raises(SystemExit, match=rf"{name} \S+ {where} the training checkpoints "
                                             rf"folder {ck}, whose files are the run's: give "
                                             "a folder outside it"):
            write()
    assert sorted(p.name for p in ck.iterdir()) == before
    project = tmp_path / "project"  # a run's train_config.json copied there: no checkpoints
    project.mkdir()
    shutil.copy(ck / "train_config.json", project)
    convert([str(final), str(project / "hf"), "--to", "hf"])
    # A newest step that cannot be read (corrupt, or pruned by the run while read): the one
    # before, said in a line; it was TensorStore's traceback.
    torn = tmp_path / "torn"
    shutil.copytree(ck, torn)
    shutil.rmtree(torn / "2" / "state" / "ocdbt.process_0")
    capsys.readouterr()
    convert([str(torn), str(tmp_path / "from_1"), "--to", "hf"])
    out, err = capsys.readouterr()
    assert f"from step 1 of {torn}" in out and "Traceback" not in err
    assert re.fullmatch(rf"checkpoint {torn / '2'} cannot be read \(.*\): read step 1 instead "
                        r"\(train --resume would set step 2 aside\)\n", err)
    from mamba_jax import checkpoint
    monkeypatch.setattr(checkpoint, "_restore_failed", False)
    with pytest.raises(SystemExit, match=rf"checkpoint {torn / '2'} cannot be read \("):
        convert([str(torn), str(tmp_path / "from_2"), "--to", "hf", "--step", "2"])
    assert checkpoint._restore_failed  # so its reads' stragglers print nothing after it
    with pytest.raises(SystemExit, match=rf"--checkpoint-dir {final} holds a model \(its "
                                         r"config.json\), which the commands"):
        main([*SMALL, "--steps", "1", "--checkpoint-dir", str(final)])
    # The newest step's optimizer state damaged (a data file cut short), its weights whole:
    # generate and convert read the weights, and say what is damaged and what a resume
    # does, as train --resume then does (they read the weights without a word).
    damaged = tmp_path / "damaged"
    shutil.copytree(ck, damaged)
    _damage_the_optimizer_state_only(damaged, 2)
    capsys.readouterr()
    convert([str(damaged), str(tmp_path / "from_damaged"), "--to", "hf"])
    out, err = capsys.readouterr()
    assert f"from step 2 of {damaged}" in out
    assert re.fullmatch(rf"checkpoint {damaged / '2'}: its weights are read, but its "
                        r"optimizer state cannot be read \(.*\); train --resume would set step "
                        r"2 aside and resume from step 1\n", err)
    assert (tmp_path / "from_damaged" / "model.safetensors").read_bytes() == \
        (tmp_path / "hf" / "model.safetensors").read_bytes()
    generate(["--checkpoint", str(damaged), *prompt])
    out, err = capsys.readouterr()
    assert out == from_checkpoint and err.startswith(f"checkpoint {damaged / '2'}: its weights")
    main([*SMALL, "--steps", "2", "--checkpoint-dir", str(damaged), "--resume", "--out", "none"])
    err = capsys.readouterr().err
    assert "checkpoint 2 set aside as " in err and "the run goes on from step 1" in err


def _damage_the_optimizer_state_only(directory, step):
    """Write checkpoint `step` again with its optimizer state changed and its meta (the
    checksums of the arrays first saved) as it was: its weights read as saved, its optimizer
    state is not what was saved. (Cutting a data file short damaged the weights as well
    where Orbax had packed every array into one file.)"""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
    saved = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                           meta=ocp.args.JsonRestore()))
    state = {**saved.state, "opt_state": jax.tree_util.tree_map(lambda x: x + 1,
                                                                 saved.state["opt_state"])}
    manager.close()
    shutil.rmtree(directory / str(step))
    manager = ocp.CheckpointManager(directory, item_names=("state", "meta"))
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               meta=ocp.args.JsonSave(saved.meta)))
    manager.wait_until_finished()
    manager.close()


def test_an_out_that_holds_a_model_is_kept_unless_overwritten_or_the_same_run(
        tmp_path, capsys, monkeypatch):
    ck, out = tmp_path / "ck", tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    main([*SMALL, "--steps", "2", "--checkpoint-dir", "ck", "--out", "out"])
    first = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    # Another run into it is refused before it trains; the model stays as it was.
    with pytest.raises(SystemExit) as refused:
        main([*SMALL, "--steps", "2", "--seed", "1", "--out", str(out)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"python -m mamba_jax.train: --out {out} already holds a model (its "
                   "config.json), which this run's final export would replace: give another "
                   "--out, --out none, or --overwrite-out to replace it\n")
    assert (out / "model.safetensors").read_bytes() == first
    # A run that starts afresh in another checkpoint dir of that name is another run
    shutil.move(ck, tmp_path / "kept")
    with pytest.raises(SystemExit, match=f"--out {out} already holds a model"):
        main([*SMALL, "--steps", "2", "--checkpoint-dir", str(ck), "--resume-if-exists",
              "--out", str(out)])
    assert not ck.exists()  # refused before it made anything
    shutil.move(tmp_path / "kept", ck)
    # The run that wrote it, resumed to more steps (from another folder), exports there again.
    monkeypatch.chdir(ROOT)
    main([*SMALL, "--steps", "10", "--checkpoint-dir", str(ck), "--resume", "--out", str(out)])
    resumed = (out / "model.safetensors").read_bytes()
    assert resumed != first
    # --overwrite-out replaces it.
    main([*SMALL, "--steps", "2", "--seed", "1", "--out", str(out), "--overwrite-out"])
    assert (out / "model.safetensors").read_bytes() not in (first, resumed)


def test_a_model_written_into_out_while_the_run_trains_is_kept(tmp_path, monkeypatch,
                                                               capsys):
    """Another run's export into --out after this run's start check (two runs started with
    one --out): the export at the end goes beside it, to OUT-1, and says so; neither model
    is lost."""
    from mamba_jax import train
    out = tmp_path / "out"
    main([*SMALL, "--steps", "2", "--seed", "1", "--out", str(tmp_path / "theirs")])
    check = train._check_out

    def meanwhile(args, path, resumed):  # the other run exports once this one has checked
        check(args, path, resumed)
        shutil.copytree(tmp_path / "theirs", path)
    monkeypatch.setattr(train, "_check_out", meanwhile)
    capsys.readouterr()
    main([*SMALL, "--steps", "2", "--out", str(out)])
    assert (f"--out {out} came to hold a model while this run trained (another run's "
            f"export?), which this run may not replace: its model goes to {out}-1 instead"
            ) in capsys.readouterr().err
    theirs = (tmp_path / "theirs" / "model.safetensors").read_bytes()
    assert (out / "model.safetensors").read_bytes() == theirs
    ours = json.loads((tmp_path / "out-1" / "train_config.json").read_text())
    assert ours["train"]["steps"] == 2
    assert (tmp_path / "out-1" / "model.safetensors").read_bytes() != theirs


def test_a_step_out_of_device_memory_names_the_batch_and_the_fixes(tmp_path, monkeypatch,
                                                                   capsys):
    """XLA's RESOURCE_EXHAUSTED from the step (a batch too large for the device): one line
    naming the batch and what to change, exit 2, no traceback, the checkpoint saved before it
    kept; another XLA error is not dressed up as one."""
    from mamba_jax import train

    def failing(message, after):
        build = train.make_train_step

        def make(loss_fn, tx, **options):
            step, calls = build(loss_fn, tx, **options), []

            def run(*args):
                calls.append(1)
                if len(calls) > after:
                    raise jax.errors.JaxRuntimeError(message)
                return step(*args)
            return run
        return make

    ck = tmp_path / "ck"
    monkeypatch.setattr(train, "make_train_step", failing(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 42.00GiB.\nmore", 2))
    with pytest.raises(UserExit) as stop:
        train.main([*SMALL, "--steps", "10", "--save-every", "2", "--checkpoint-dir", str(ck)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "--batch-size 8 x --seq-len 32 does not fit in the device's memory " \
           "(RESOURCE_EXHAUSTED: Out of memory while trying to allocate 42.00GiB.)" in err
    assert "--grad-accum 2" in err and "--remat block or full" in err and "--scan-layers" in err
    assert "--dtype bfloat16" in err  # SMALL computes in float32
    assert [p.name for p in ck.iterdir() if p.name.isdigit()] == ["2"]
    # at its first step (its bfloat16 step is not compiled)
    monkeypatch.setattr(train, "make_train_step", failing(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 42.00GiB.\nmore", 0))
    with pytest.raises(UserExit):  # a bfloat16 run is not told to use bfloat16
        train.main([*SMALL, "--steps", "10", "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert "does not fit in the device's memory" in err and "--dtype" not in err
    monkeypatch.setattr(train, "make_train_step", failing("INTERNAL: something else", 0))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        train.main([*SMALL, "--steps", "2", "--out", "none"])


def test_a_resume_if_exists_run_that_restores_nothing_appends_to_the_metrics_file(tmp_path):
    """Only a run that restores a checkpoint supersedes the metrics logged after it; one that
    finds none to restore appends, as a fresh run does (it emptied the file)."""
    metrics = tmp_path / "m.jsonl"
    main([*SMALL, "--steps", "2", "--metrics-file", str(metrics)])
    main([*SMALL, "--steps", "2", "--metrics-file", str(metrics), "--checkpoint-dir",
          str(tmp_path / "ck"), "--resume-if-exists"])
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == \
        [1, 2, 1, 2]


def test_a_checkpoint_dir_inside_a_checkpoints_folder_is_refused_and_left_as_it_was(tmp_path):
    """--checkpoint-dir naming one of a run's steps (or a folder inside it): a
    --resume-if-exists run started afresh there, writing its steps and files into that
    checkpoint."""
    ck = tmp_path / "ck"
    main([*SMALL, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(ck)])
    before = sorted(p.relative_to(ck) for p in ck.rglob("*"))
    for inside in (ck / "2", ck / "2" / "new"):
        with pytest.raises(UserExit, match=rf"--checkpoint-dir {inside} is inside the training "
                                           rf"checkpoints folder {ck}: give that folder"):
            main([*SMALL, "--steps", "4", "--checkpoint-dir", str(inside),
                  "--resume-if-exists"])
    assert sorted(p.relative_to(ck) for p in ck.rglob("*")) == before


def test_an_out_with_braces_of_its_own_is_written_there(tmp_path):
    """--out fills in {preset} alone: another brace is the path's (it was str.format's
    KeyError, IndexError or ValueError)."""
    main([*SMALL, "--steps", "2", "--out", str(tmp_path / "runs{x}" / "{preset}-{")])
    assert (tmp_path / "runs{x}" / "tiny-{" / "config.json").is_file()


def test_a_metrics_file_that_holds_something_else_is_refused_and_kept(tmp_path):
    """--metrics-file naming a model's config.json: the rows appended to it broke the model
    (rc 0); refused before training, the file as it was."""
    config = tmp_path / "config.json"
    config.write_text('{\n  "d_model": 64\n}\n')
    with pytest.raises(UserExit, match=rf"--metrics-file {config} holds something else than "
                                       r"metrics"):
        main([*SMALL, "--steps", "1", "--metrics-file", str(config)])
    assert config.read_text() == '{\n  "d_model": 64\n}\n'


def test_evaluation_runs_in_the_steps_micro_batches(tmp_path, monkeypatch):
    """--grad-accum 2: evaluation's forward takes the step's 8 rows at a time (it took all
    16 at once: a run that fits by --grad-accum ran out of memory at its first evaluation),
    over as many windows as before (4 batches of 16)."""
    from mamba_jax.data import TokenDataset

    rows, original = [], TokenDataset.eval_batches

    def recording(self, *args):
        for batch in original(self, *args):
            rows.append(len(batch["inputs"]))
            yield batch
    monkeypatch.setattr(TokenDataset, "eval_batches", recording)
    main([*SMALL, "--steps", "1", "--batch-size", "16", "--grad-accum", "2", "--eval-every",
          "1", "--metrics-file", str(tmp_path / "m.jsonl")])
    assert rows == [8] * 8
    [row] = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert np.isfinite(row["eval_loss"])


def test_a_stop_request_during_the_last_step_completes_the_run(tmp_path, monkeypatch, capsys):
    """SIGTERM while the last step runs: the run is whole, so it exports and succeeds (it was
    "stopped after step 2", status 143, and no export)."""
    import os

    from mamba_jax import train

    build = train.make_train_step

    def make(loss_fn, tx, **options):
        step, calls = build(loss_fn, tx, **options), []

        def run(*args):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler
            return step(*args)
        return run
    monkeypatch.setattr(train, "make_train_step", make)
    main([*SMALL, "--steps", "2", "--out", str(tmp_path / "out")])
    assert "SIGTERM after the last step: the run is complete" in capsys.readouterr().err
    assert (tmp_path / "out" / "config.json").is_file()
