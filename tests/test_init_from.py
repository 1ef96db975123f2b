"""`python -m mamba_jax.train --init-from DIR`: a published model (every layout of the
reference fixtures) or a trainer's checkpoint as the start of a run, its weights placed on
the mesh tensor by tensor, its config and tokenizer kept, its export in its own layout."""

import json
import re
import shutil
import subprocess
import sys
import weakref
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import mamba_jax
from mamba_jax import adapters, convert, init_from, parallel
from mamba_jax.chat import ChatTemplate
from mamba_jax.checkpoint import Checkpointer
from mamba_jax.cli import UserExit
from mamba_jax.convert import load_config, param_tensors
from mamba_jax.data import DEFAULT_CORPUS
from mamba_jax.init_from import InitSource, init_identity, placed_state
from mamba_jax.megatron_files import Legacy
from mamba_jax.model import Mamba2LM
from mamba_jax.sharding import param_name
from mamba_jax.tensors import open_tensors
from mamba_jax.train import main, parse_args

FIXTURES = Path(__file__).parent / "fixtures"
# Every layout, once: transformers' Mamba2 (tied with one group, untied with two), Mamba and
# FalconMamba, NemotronH; mamba_ssm's Mamba2, Mamba-1, hybrid and Mamba-3 (SISO; MIMO with MLPs)
LAYOUTS = ["hf_ngroups1_tied", "hf_ngroups2_untied", "mamba1_tied", "mamba1_falcon_untied",
           "nemotron_h_hybrid", "mamba_ssm_ngroups2_untied", "mamba1_mamba_ssm",
           "mamba_ssm_hybrid", "mamba_ssm_mamba3_siso", "mamba_ssm_mamba3_mimo"]
# One step at a learning rate of 0 on 8 rows of 16 tokens (the default mesh: dp=8), of a
# text too short to hold out a window: the run compiles its step and nothing else.
STEP = ["--steps", "1", "--lr", "0", "--batch-size", "8", "--seq-len", "16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A BPE tokenizer of 64 tokens (the fixtures' vocabulary is 100) and a text to train
    on, in one folder."""
    folder = tmp_path_factory.mktemp("init_from")
    text = DEFAULT_CORPUS.read_text()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<unk>"], limit_alphabet=40, show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "data.txt").write_text(text[:500])  # ~300 tokens: no held-out window of 17
    return folder


def train(files, *argv):
    main([*STEP, "--data", str(files / "data.txt"), *argv])


@pytest.mark.parametrize("case", LAYOUTS)
def test_one_step_at_lr_0_exports_the_source_tensors_in_its_layout(tmp_path, files, case):
    """Each layout from_pretrained reads starts a run, whose export after a step that changes
    nothing is the source checkpoint: its layout, config and every tensor, and the logits
    transformers' or mamba_ssm's model gave (within 1e-4 of the largest, float32)."""
    source = FIXTURES / case
    train(files, "--init-from", str(source), "--tokenizer", str(files / "tokenizer.json"),
          "--out", str(tmp_path / "out"))
    (cfg, layout), (written, written_layout) = load_config(source), load_config(tmp_path / "out")
    assert written_layout == layout and written == cfg
    ours, theirs = (load_file(d / "model.safetensors") for d in (tmp_path / "out", source))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    ids, expected = (np.load(source / f"{name}.npy") for name in ("input_ids", "logits"))
    model = mamba_jax.from_pretrained(tmp_path / "out")
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
    logits = logits[..., :expected.shape[-1]]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4
    recorded = json.loads((tmp_path / "out" / "train_config.json").read_text())["train"]
    assert recorded["init_from"] == str(source.absolute())
    assert recorded["init_identity"] == init_identity(source)


class Watched(Mapping):
    """A checkpoint's tensors (open_tensors') that check, as each is asked for, that it is
    in the checkpoint's dtype and that no tensor handed out before is still held."""

    def __init__(self, tensors, dtype):
        self.tensors, self.dtype, self.served = tensors, dtype, []

    def __getitem__(self, key):
        held = [name for name, ref in self.served if ref() is not None]
        assert not held, f"{held} still held when {key} is read"
        array = self.tensors[key]
        assert array.dtype == self.dtype, (key, array.dtype)
        self.served.append((key, weakref.ref(array)))
        return array

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def test_a_bf16_checkpoint_goes_onto_the_mesh_a_tensor_and_a_shard_at_a_time(monkeypatch):
    """nemotron-nano-9b-v2's shape (reduced, stored in bfloat16) onto dp=4 x fsdp=2: the
    host holds one tensor of the checkpoint at a time, in bfloat16, and makes float32 only
    of the pieces the devices take, each piece once (a dp replica shares it); each device
    holds its fsdp shard alone. The values are the checkpoint's."""
    source = FIXTURES / "nemotron_h_published" / "NVIDIA-Nemotron-Nano-9B-v2"
    watched = []
    monkeypatch.setattr(init_from, "open_tensors", lambda path: watched.append(
        Watched(open_tensors(path), ml_dtypes.bfloat16)) or watched[-1])
    pieces = []  # per placed array: its shape and the host pieces made for it
    make = jax.make_array_from_callback

    def recording(shape, sharding, callback):
        made = {}
        pieces.append((shape, made))

        def piece(index):
            array = callback(index)
            made[id(array)] = (array.dtype, array.nbytes)
            return array
        return make(shape, sharding, piece)
    monkeypatch.setattr(jax, "make_array_from_callback", recording)

    mesh = parallel.make_mesh("dp=4,fsdp=2")
    init = InitSource.open(source)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Mamba2LM(init.config,
                                                                   rngs=nnx.Rngs(0))))
    shardings = parallel.shardings(mesh, parallel.param_specs(abstract, mesh))
    params = init.load(abstract, shardings)
    assert watched and len(watched[0].served) == len(load_file(source / "model.safetensors"))
    for shape, made in pieces:
        assert {dtype for dtype, _ in made.values()} == {np.dtype(np.float32)}
        assert sum(nbytes for _, nbytes in made.values()) == 4 * np.prod(shape)
    expected = {name: np.asarray(value, np.float32) for name, value
                in param_tensors(open_tensors(source), init.config, init.layout)}
    split = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = param_name(path)
        for shard in leaf.addressable_shards:
            assert shard.data.shape == leaf.sharding.shard_shape(leaf.shape), name
            np.testing.assert_array_equal(np.asarray(shard.data), expected[name][shard.index])
        split += leaf.sharding.shard_shape(leaf.shape) != leaf.shape
    assert split > len(expected) // 2  # most are split over fsdp (d_model 70 is even)


def _model_with_tokenizer(tmp_path, files, case="hf_ngroups1_tied"):
    """A copy of fixture `case` with the tests' tokenizer beside its weights."""
    folder = tmp_path / case
    shutil.copytree(FIXTURES / case, folder)
    shutil.copy(files / "tokenizer.json", folder)
    return folder


def test_a_trainers_checkpoint_is_a_source_and_a_resume_keeps_to_its_own(tmp_path, files,
                                                                          capsys):
    """A run's --checkpoint-dir (a step folder of it) starts another run, whose export is
    the weights that run started from; a resume restores its own run's checkpoint, and is
    refused once the source it started from holds other weights, or without it."""
    model = _model_with_tokenizer(tmp_path, files)
    (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    first, second = tmp_path / "first", tmp_path / "second"
    train(files, "--init-from", str(model), "--checkpoint-dir", str(first), "--out", "none")
    train(files, "--init-from", str(first / "1"), "--checkpoint-dir", str(second),
          "--out", str(tmp_path / "out"))
    ours, theirs = (load_file(d / "model.safetensors") for d in (tmp_path / "out", model))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    # the chat template of the model a run starts from goes with it (text data gives none)
    for folder in (first, second, tmp_path / "out"):
        assert ChatTemplate.from_model_dir(folder).text == "{{ messages[0]['content'] }}"
    capsys.readouterr()

    def resume(*source):  # at --steps 1: the checkpoint restored, and nothing to train
        main([*STEP, "--data", str(files / "data.txt"), "--out", "none", "--resume",
              "--checkpoint-dir", str(first), *source])
    resume("--init-from", str(model))
    assert "resumed at step 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=rf"^checkpoint 1 in {first} was trained from "
                                         rf"--init-from {model}: pass it again"):
        resume("--tokenizer", str(files / "tokenizer.json"))
    weights = load_file(model / "model.safetensors")
    save_file({key: value + 1 for key, value in weights.items()}, model / "model.safetensors")
    with pytest.raises(SystemExit, match=rf"^checkpoint 1 in {first} was trained from "
                                         rf"--init-from {model} \(identity \w{{12}}\), and "
                                         rf"--init-from {model} is now \w{{12}}: its weights "
                                         "changed since"):
        resume("--init-from", str(model))


def test_set_may_change_what_keeps_every_parameter_and_nothing_else():
    """--set mamba2.chunk_size (the scan's blocking) applies; a field that would change a
    parameter's shape, the parameters or the layers is refused naming its value in the
    folder; and so is --preset."""
    source = FIXTURES / "hf_ngroups2_untied"
    _, cfg = parse_args(["--init-from", str(source), "--set", "mamba2.chunk_size=8"])
    assert cfg == load_config(source)[0].replace(**{"mamba2.chunk_size": 8})
    for field, value, theirs in (("mamba2.d_state", "8", "16"), ("n_layer", "3", "2"),
                                 ("tie_embeddings", "true", "False"),
                                 ("mamba2.learnable_init_state", "true", "False")):
        with pytest.raises(SystemExit, match=rf"^{field}=.* would change the model's "
                                             rf"parameters or layers, which come from "
                                             rf"--init-from {source.absolute()} \(its {field} "
                                             rf"is {theirs}\): leave it out"):
            parse_args(["--init-from", str(source), "--set", f"{field}={value}"])
    with pytest.raises(SystemExit, match=rf"^--preset tiny with --init-from {source}: the "
                                         "model is the one in that folder"):
        parse_args(["--init-from", str(source), "--preset", "tiny"])


def test_the_tokenizer_is_the_folders(tmp_path, files, capsys):
    """A --tokenizer or a --data prepared with another tokenizer than the folder's is
    refused naming both; a folder without one needs --tokenizer, whose vocabulary must fit
    the model's. One line each, before anything is compiled."""
    from mamba_jax.data import main as prepare

    model = _model_with_tokenizer(tmp_path, files)
    text = str(files / "data.txt")
    prepare(["prepare", text, "--tokenizer", "bytes", "--out", str(tmp_path / "bytes")])
    bare = FIXTURES / "hf_ngroups1_tied"
    for argv, refusal in (
            (["--init-from", str(model), "--data", text, "--tokenizer", "bytes"],
             rf"--tokenizer bytes is not the tokenizer of --init-from {model} "
             rf"\({model}/tokenizer.json\), which the model was trained with: leave it out"),
            (["--init-from", str(model), "--data", str(tmp_path / "bytes")],
             rf"--data {tmp_path}/bytes was prepared with bytes, not with the tokenizer of "
             rf"--init-from {model} \({model}/tokenizer.json\): prepare it again"),
            (["--init-from", str(bare), "--data", text],
             rf"--init-from {bare.absolute()} holds no tokenizer \(tokenizer.json or "
             "tokenizer.model\\): give the one the model was trained with as --tokenizer"),
            (["--init-from", str(bare), "--data", text, "--tokenizer", "bytes"],
             rf"the tokenizer has 256 tokens, more than the vocab_size 100 of --init-from "
             rf"{bare.absolute()}")):
        capsys.readouterr()
        with pytest.raises(UserExit, match="^" + refusal):
            main([*STEP, "--out", "none", *argv])
        assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("make,refusal", [
    (lambda p: p / "absent", r"{p}: no such folder; give a model's folder"),
    (lambda p: p, r"{p} holds no model: a model's folder holds config.json and "
                  r"model.safetensors"),
    (lambda p: (p / "config.json").write_text('{"model_type": "llama"}') and p,
     r"{p}/config.json: model_type 'llama' is no Mamba model"),
    (lambda p: shutil.copy(FIXTURES / "hf_ngroups1_tied" / "config.json", p) and p,
     r"{p}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"),
    (lambda p: (p / "latest_checkpointed_iteration.txt").write_text("5") and p,
     r"{p}/latest_checkpointed_iteration.txt names iteration 5, but {p}/iter_0000005 does "
     "not exist"),
], ids=["missing", "empty", "another-models-config", "no-weights", "megatron-iteration"])
def test_a_folder_that_holds_no_model_it_can_read_is_one_line(tmp_path, capsys, make, refusal):
    folder = make(tmp_path)
    with pytest.raises(UserExit, match="^--init-from " + refusal.format(p=folder)):
        main([*STEP, "--init-from", str(folder), "--out", "none"])
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.subprocess
def test_the_command_names_a_missing_folder_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mamba_jax.train", "--init-from",
                          str(tmp_path / "absent")], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr == (f"python -m mamba_jax.train: --init-from {tmp_path / 'absent'}: no "
                          "such folder; give a model's folder (config.json and its weights) "
                          "or a trainer's --checkpoint-dir\n")


def test_the_identity_follows_the_weights_not_the_folder(tmp_path):
    """The same files elsewhere have the same identity; other weights of the same shapes,
    or another config, another."""
    source = FIXTURES / "hf_ngroups1_tied"
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert init_identity(copy) == init_identity(source)
    weights = load_file(copy / "model.safetensors")
    save_file({key: value * 1.01 for key, value in weights.items()}, copy / "model.safetensors")
    changed = init_identity(copy)
    assert changed != init_identity(source)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-6}))
    assert init_identity(copy) not in (changed, init_identity(source))


# ---------------------------------------------------------------- LoRA and --train-only

LORA = ["--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "in_proj", "--base-dtype",
        "bfloat16", "--lr", "0.01", "--warmup", "2", "--batch-size", "8", "--seq-len", "32"]


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def lora_train(run: Path, *argv):
    """The LoRA run over run/model (a copy of trained_tiny, its tokenizer the folder's)."""
    main([*LORA, "--init-from", str(run / "model"), "--data", str(run / "data.txt"), *argv])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """4 LoRA steps over trained_tiny read as a bfloat16 base, checkpointing at 2 and 4,
    exporting the merged model and PEFT's adapter: (the run's folder, its losses)."""
    run = tmp_path_factory.mktemp("lora_from_a_model")
    shutil.copytree(FIXTURES / "trained_tiny", run / "model")
    (run / "data.txt").write_text(DEFAULT_CORPUS.read_text()[:600])  # no held-out window
    lora_train(run, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(run / "ck"),
               "--metrics-file", str(run / "m.jsonl"), "--out", str(run / "out"),
               "--export-adapter", str(run / "peft"))
    return run, losses(run / "m.jsonl")


def test_a_lora_run_from_a_model_stopped_and_resumed_gives_the_straight_runs_losses(
        lora_run, tmp_path):
    # The resume reads the frozen base from --init-from again (its checkpoints hold the
    # adapters alone): bit for bit the straight run's losses and export.
    run, straight = lora_run
    assert len(straight) == 4 and straight[-1] < straight[0]
    shutil.copytree(run / "ck", tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "4")  # as if the run had stopped after step 2
    lora_train(run, "--steps", "4", "--save-every", "2", "--checkpoint-dir",
               str(tmp_path / "ck"), "--resume", "--metrics-file", str(tmp_path / "m.jsonl"),
               "--out", str(tmp_path / "out"))
    np.testing.assert_array_equal(losses(tmp_path / "m.jsonl"), straight[2:])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (run / "out" / "model.safetensors").read_bytes()


def test_a_lora_checkpoint_names_its_source_as_its_base_and_is_read_onto_it(lora_run,
                                                                           tmp_path):
    # The base's identity is the source's; PEFT's adapter names it; convert reads the
    # checkpoints onto it (the run's --out, exactly); and a later --init-from of the
    # checkpoints reads them as that merged model, onto a mesh.
    run, _ = lora_run
    model = run / "model"
    recorded = json.loads((run / "ck" / "train_config.json").read_text())["train"]
    assert recorded["base"] == {"path": str(model), "hash": init_identity(model)}
    peft = json.loads((run / "peft" / "adapter_config.json").read_text())
    assert peft["base_model_name_or_path"] == str(model)
    convert.main([str(run / "ck"), str(tmp_path / "hf"), "--to", "hf"])
    out, converted = (load_file(d / "model.safetensors") for d in (run / "out", tmp_path / "hf"))
    assert out.keys() == converted.keys()
    for key in out:
        np.testing.assert_array_equal(converted[key], out[key], err_msg=key)
    source = InitSource.open(run / "ck")
    mesh = parallel.make_mesh("fsdp=2,tp=2,dp=2")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Mamba2LM(source.config,
                                                                   rngs=nnx.Rngs(0))))
    params = source.load(abstract, parallel.shardings(mesh, parallel.param_specs(abstract,
                                                                                mesh)))
    merged = convert.flat_params(mamba_jax.from_pretrained(run / "out"))
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        np.testing.assert_array_equal(value, merged[param_name(path)],
                                      err_msg=param_name(path))


def test_a_lora_checkpoint_whose_base_changed_or_is_gone_is_refused_naming_both(
        lora_run, tmp_path, capsys):
    # convert, generate (and serve) read the base where the run recorded it: a folder that
    # holds other weights, or none, is one line naming the checkpoint, both identities and
    # the fix; so is an --init-from of the checkpoints.
    from mamba_jax.generate.__main__ import main as generate

    run, _ = lora_run
    model, moved = run / "model", run / "model.moved"
    recorded = init_identity(model)[:12]
    said = (f"checkpoint 4 in {run / 'ck'} trained on the base {model} (sha256 {recorded})")
    model.rename(moved)
    try:
        capsys.readouterr()
        with pytest.raises(UserExit, match=re.escape(f"{said}, which is gone (no such "
                                                     f"folder): put that model back at "
                                                     f"{model}")):
            convert.main([str(run / "ck"), str(tmp_path / "hf"), "--to", "hf"])
        assert capsys.readouterr().err.count("\n") == 1
        shutil.copytree(moved, model)
        weights = load_file(model / "model.safetensors")
        save_file({key: value * 1.01 for key, value in weights.items()},
                  model / "model.safetensors")
        changed = init_identity(model)[:12]
        for command, argv in ((generate, ["--checkpoint", str(run / "ck"), "--prompt", "x"]),
                              (main, [*STEP, "--init-from", str(run / "ck"), "--out", "none"])):
            with pytest.raises(UserExit, match=re.escape(
                    f"and {model} now holds other weights (sha256 {changed}): what trained "
                    f"fits the base it trained on; put that model back at {model}")):
                command(argv)
            assert capsys.readouterr().err.count("\n") == 1
    finally:
        shutil.rmtree(model, ignore_errors=True)
        moved.rename(model)
    assert not (tmp_path / "hf").exists()


class Placements:
    """jax.make_array_from_callback, recording for each array placed the dtypes of the host
    pieces it is made of."""

    def __init__(self, monkeypatch):
        self.dtypes, make = [], jax.make_array_from_callback

        def recording(shape, sharding, callback):
            made = set()
            self.dtypes.append(made)

            def piece(index):
                array = callback(index)
                made.add(str(array.dtype))
                return array
            return make(shape, sharding, piece)
        monkeypatch.setattr(jax, "make_array_from_callback", recording)


def test_a_bfloat16_base_goes_onto_the_mesh_in_bfloat16(monkeypatch, tmp_path):
    # The frozen weights of a LoRA run with --base-dtype bfloat16 are read from the folder
    # (or a trainer's checkpoint, a layer at a time) into bfloat16 on their shards: each is
    # made of bfloat16 pieces, never placed in float32 first, and holds the source's values
    # rounded; A_log, D, dt_bias and the norms stay float32; the adapters are those a
    # fresh build draws.
    source = InitSource.open(FIXTURES / "trained_tiny")
    cfg = source.config
    tuning = adapters.Tuning(rank=2, base_dtype="bfloat16").check(cfg)
    build = tuning.build(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)), 0)
    _, whole = nnx.split(nnx.eval_shape(build))
    mesh = parallel.make_mesh("fsdp=2,tp=2,dp=2")
    shardings = parallel.shardings(mesh, parallel.param_specs(whole, mesh))
    placed = Placements(monkeypatch)
    state = placed_state(build, whole, shardings, source.load)
    kept = sorted(str(leaf.dtype) for leaf in jax.tree.leaves(nnx.split_state(
        whole, nnx.Param, ...)[0]))
    assert kept == sorted(dtype for made in placed.dtypes for dtype in made)
    assert set(kept) == {"bfloat16", "float32"}
    expected = {name: np.asarray(value, np.float32) for name, value
                in param_tensors(open_tensors(FIXTURES / "trained_tiny"), cfg, "hf")}
    wanted = dict(jax.tree_util.tree_leaves_with_path(whole))
    drawn = dict(jax.tree_util.tree_leaves_with_path(
        jax.jit(lambda: nnx.split(build())[1])()))
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name = param_name(path)
        assert leaf.dtype == wanted[path].dtype, name
        np.testing.assert_array_equal(leaf, expected[name].astype(leaf.dtype)
                                      if name in expected else drawn[path], err_msg=name)
    # A trainer's checkpoint of the same weights (float32): restored a layer at a time, its
    # checksums checked, and cast on the devices
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(1, {"params": nnx.state(mamba_jax.from_pretrained(FIXTURES / "trained_tiny")),
                  "opt_state": {"count": jnp.zeros(())}},
              {"step": 1, "config": {"model": cfg.to_dict(), "train": {"seed": 0}}})
    ckpt.close()
    restored = []
    restore_part = Checkpointer.restore_part
    monkeypatch.setattr(Checkpointer, "restore_part", lambda self, step, part: restored.append(
        sum(leaf.size for leaf in jax.tree.leaves(part))) or restore_part(self, step, part))
    from_checkpoint = placed_state(build, whole, shardings,
                                   InitSource.open(tmp_path / "ck").load)
    assert len(restored) == cfg.n_layer + 1 and max(restored) < sum(restored) / 2
    expected = dict(jax.tree_util.tree_leaves_with_path(state))
    for path, leaf in jax.tree_util.tree_leaves_with_path(from_checkpoint):
        assert leaf.dtype == expected[path].dtype, param_name(path)
        np.testing.assert_array_equal(leaf, expected[path], err_msg=param_name(path))


def test_peft_names_the_hub_id_of_the_source(tmp_path):
    # transformers 4's _name_or_path, or the hub cache's folder; else the folder itself
    folder = tmp_path / "models--state-spaces--mamba2-130m" / "snapshots" / "0123abc"
    shutil.copytree(FIXTURES / "hf_ngroups1_tied", folder)
    assert InitSource.open(folder).name() == "state-spaces/mamba2-130m"
    shutil.copytree(FIXTURES / "hf_ngroups1_tied", tmp_path / "plain")
    assert InitSource.open(tmp_path / "plain").name() == str(tmp_path / "plain")
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps(
        {**config, "_name_or_path": "AntonV/mamba2-130m-hf"}))
    assert InitSource.open(tmp_path / "plain").name() == "AntonV/mamba2-130m-hf"


# ---------------------------------------------------------------- Megatron-LM

def megatron_files_of(args):
    """Megatron's own TP=2 split of a NemotronH model (test_megatron's fixture) as
    megatron_files reads it, the saved arguments `args` (None: none saved); CI has no torch
    to read the .pt files themselves."""
    from test_megatron import FIXTURE, _safetensors

    tensors = _safetensors("legacy_tp2_ranks.safetensors")
    ranks = [{key.partition("/")[2]: value for key, value in tensors.items()
              if key.startswith(f"rank{r}/")} for r in range(2)]
    saved = json.loads((FIXTURE / "legacy_args.json").read_text()) if args else None
    return lambda path: Legacy([ranks], saved)


MEGATRON = FIXTURES / "megatron_hybrid"


def test_a_megatron_checkpoint_starts_a_run(tmp_path, files, monkeypatch, capsys):
    # Its saved arguments give the config; its ranks, joined as read, give the weights: the
    # export after a step at lr 0 is the NemotronH model Megatron's split was made of (with
    # NemotronH's dt clamp, which the export's layout computes). One that saved no arguments
    # takes its config from --set, and what that lacks is named in one line.
    from mamba_jax import megatron_files

    monkeypatch.setattr(megatron_files, "open_iteration", megatron_files_of(args=True))
    saved = parse_args(["--init-from", str(MEGATRON / "legacy_tp2")])[1]
    train(files, "--init-from", str(MEGATRON / "legacy_tp2"), "--tokenizer",
          str(files / "tokenizer.json"), "--out", str(tmp_path / "out"),
          "--set", "mamba2.dt_limit=0.001,inf")  # (NemotronH clamps dt; Megatron does not)
    assert load_config(tmp_path / "out")[1] == "nemotron_h"
    ours, theirs = (load_file(d / "model.safetensors")
                    for d in (tmp_path / "out", MEGATRON / "nemotron_h"))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key].astype(np.float32), err_msg=key)
    recorded = json.loads((tmp_path / "out" / "train_config.json").read_text())["train"]
    assert recorded["init_identity"] == init_identity(MEGATRON / "legacy_tp2")

    monkeypatch.setattr(megatron_files, "open_iteration", megatron_files_of(args=False))
    sizes = ["layer_pattern=M*-M-", "mamba2.d_state=8", "mamba2.headdim=8", "mamba2.ngroups=2",
             "mamba2.nheads=4", "attention.num_heads=4", "attention.num_heads_kv=2",
             "attention.head_dim=8", "mlp.d_intermediate=48", "mlp.activation=relu2"]
    given = lambda sets: ["--init-from", str(MEGATRON / "legacy_tp2"),
                          *[word for s in sets for word in ("--set", s)]]
    assert parse_args(given(sizes))[1] == saved
    capsys.readouterr()
    with pytest.raises(UserExit, match=re.escape(
            f"--init-from {MEGATRON / 'legacy_tp2'}: holds no saved arguments, and --set "
            "lacks attention.num_heads, attention.num_heads_kv, attention.head_dim for the "
            "layers 'M*-M-': give each")):
        main([*STEP, "--out", "none", *given(sizes[:5] + sizes[8:])])
    assert capsys.readouterr().err.count("\n") == 1
