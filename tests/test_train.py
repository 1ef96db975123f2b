import json
import os
import re
import struct

import jax
import numpy as np
import pytest
from flax import nnx

import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.metrics import MetricsWriter, Progress
from mamba_jax.optim import make_schedule, weight_decay_mask
from mamba_jax.sharding import param_name
from mamba_jax.tokenizer import load_tokenizer
from mamba_jax.train import main, parse_args, parse_overrides


def test_default_run_trains_tiny_with_a_falling_loss_and_saves_a_checkpoint(tmp_path):
    metrics = tmp_path / "m.jsonl"
    main(["--steps", "60", "--batch-size", "8", "--seq-len", "64", "--warmup", "10",
          "--eval-every", "30", "--metrics-file", str(metrics), "--out", str(tmp_path / "ck")])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 61))
    losses = [r["loss"] for r in records]
    assert np.all(np.isfinite(losses))
    # Bytes start near ln(256) = 5.5 nats; 60 steps on English text get well below 3.
    assert losses[0] > 4.5 and np.mean(losses[-10:]) < 3.0
    assert "eval_loss" in records[29] and "eval_loss" in records[-1]
    model = mamba_jax.from_pretrained(tmp_path / "ck")
    assert model.config.vocab_size == 256 and model.config.n_layer == 2
    tok = load_tokenizer(tmp_path / "ck" / "tokenizer.json")
    assert tok.encode("GNU").ids == list(b"GNU")


def test_set_overrides_config_fields(tmp_path):
    assert parse_overrides(["mamba2.ngroups=2", "mamba2.dt_limit=0.001,0.2",
                            "tie_embeddings=false", "norm_eps=1e-6", "attn_num_heads=4"]) == {
        "mamba2.ngroups": 2, "mamba2.dt_limit": (0.001, 0.2), "tie_embeddings": False,
        "norm_eps": 1e-6, "attn_num_heads": 4}  # the flat spelling of a section field too
    main(["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--set", "mamba2.ngroups=2", "--set", "tie_embeddings=false",
          "--eval-every", "0", "--out", str(tmp_path)])
    cfg = mamba_jax.from_pretrained(tmp_path).config
    assert cfg.mamba2.ngroups == 2 and not cfg.tie_embeddings


@pytest.mark.parametrize("line,refusal", [
    ('dtype = "float16"', "dtype = 'float16' must be one of ['bfloat16', 'float32'], as "
                          "--dtype takes"),
    ('scan_layers = "no"', "scan_layers = 'no' must be true or false, as --scan-layers takes"),
    ("steps = 3.5", "steps = 3.5 must be an integer, as --steps takes"),
    ("mesh = 8", "mesh = 8 must be a string, as --mesh takes"),
    ("data = 5", "data = 5 must be a string or a list of strings (and weights), as --data "
                 "takes"),
])
def test_a_recipes_values_are_checked_as_their_flags_are(tmp_path, line, refusal):
    """A recipe's values become the parser's defaults, which argparse does not check: a
    float16 dtype trained, "no" read as true, 3.5 steps ran, a number mesh was a traceback."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'preset = "tiny"\n{line}\n')
    with pytest.raises(SystemExit) as refused:
        parse_args(["--config", str(recipe)])
    assert str(refused.value) == f"--config {recipe}: {refusal}"


def test_a_metrics_file_in_a_folder_not_yet_made_is_written(tmp_path):
    """As --tensorboard's folder is made (it was "[Errno 2] No such file or directory")."""
    metrics = tmp_path / "logs" / "run" / "m.jsonl"
    # the step program of the other short runs here (--steps 2, the default --lr and --warmup)
    main(["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--metrics-file", str(metrics), "--out", "none"])
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_set_takes_fields_of_a_number_or_a_word():
    """Fields whose default is None or a word (mamba2.nheads, Nemotron Nano 2's; mamba1's
    dt_rank, "auto" or a number): --set mamba2.nheads=4 was a traceback, dt_rank=8 the
    string '8'."""
    assert parse_overrides(["mamba2.nheads=4", "mamba1.dt_rank=8", "mamba1.dt_rank=auto",
                            "mamba2.nheads=none"]) == {"mamba2.nheads": None,
                                                        "mamba1.dt_rank": "auto"}
    _, cfg = parse_args(["--set", "mamba2.nheads=4", "--set", "d_model=64"])
    assert cfg.mamba2.nheads == 4
    _, cfg = parse_args(["--preset", "tiny-mamba1", "--set", "mamba1.dt_rank=8"])
    assert cfg.mamba1.dt_rank == 8
    with pytest.raises(SystemExit, match=r"mamba2.nheads='four' must be an integer or null"):
        parse_args(["--set", "mamba2.nheads=four"])


@pytest.mark.parametrize("arg,match", [
    ("nope=1", r"no field 'nope'; fields are .* sections \['attention', 'bidirectional', "
               r"'mamba1', 'mamba2', 'mamba3', 'mlp'\]"),
    ("mamba2.nope=1", r"Mamba2Config.mamba2 has no field 'nope'; its fields are"),
    ("ngroups", "expected FIELD=VALUE"),
    ("mamba2.ngroups=two", "'two' is not a valid int for mamba2.ngroups"),
    ("bias=maybe", "not a valid bool")])
def test_bad_overrides_are_named(arg, match):
    with pytest.raises(SystemExit, match=match):
        parse_overrides([arg])


def test_missing_data_file_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit, match="python -m mamba_jax.data prepare") as refused:
        main(["--data", str(tmp_path / "absent"), "--steps", "1"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (f"python -m mamba_jax.train: {refused.value}\n")


@pytest.mark.parametrize("flag,where,refusal", [
    ("--out", "file", r"a file, not a folder; give another path"),
    ("--checkpoint-dir", "file/ckpt", r"file is a file, not a folder; give another path"),
    ("--metrics-file", "folder", r"a folder, not a file; give another path"),
    ("--tensorboard", "file", r"a file, not a folder; give another path"),
    ("--metrics-file", "locked/m.jsonl", r"locked is not writable by this user"),
    ("--out", "locked/out", r"locked is not writable by this user \(Permission denied\)"),
])
def test_paths_the_run_could_not_write_are_refused_before_it_trains(tmp_path, capsys,
                                                                   monkeypatch, flag, where,
                                                                   refusal):
    """Where the export at the end (or the first checkpoint or metrics line) would fail, the
    run stops at once, naming the flag and the path, rather than after its training."""
    import tempfile

    (tmp_path / "file").write_text("a user's file\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "locked").mkdir()
    made = tempfile.TemporaryFile  # as root every folder is writable: one this user may not

    def temporary_file(dir):
        if "locked" in str(dir):
            raise PermissionError(13, "Permission denied")
        return made(dir=dir)
    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    argv = ["--steps", "1", flag, str(tmp_path / where)]
    with pytest.raises(SystemExit, match=f"{flag} {tmp_path / where}: .*{refusal}") as refused:
        main(argv + ([] if flag == "--out" else ["--out", "none"]))
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "a user's file\n"


def test_a_recipe_that_is_no_toml_is_named(tmp_path):
    recipe = tmp_path / "notes.md"
    recipe.write_text("# notes\nsteps: 3\n")
    with pytest.raises(SystemExit, match=f"--config {recipe}: not a TOML recipe"):
        main(["--config", str(recipe)])


def test_no_weight_decay_on_A_log_D_dt_bias_norms_and_biases():
    cfg = Mamba2Config.preset("tiny", tie_embeddings=False, **{"mamba2.bias": True})
    _, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    mask = {param_name(p): v for p, v in
            jax.tree_util.tree_leaves_with_path(weight_decay_mask(params))}
    decayed = {name.replace("layers.0.", "") for name, v in mask.items()
               if v and not name.startswith("layers.1.")}
    assert decayed == {"embedding", "lm_head", "mixer.z_proj", "mixer.x_proj", "mixer.B_proj",
                       "mixer.C_proj", "mixer.dt_proj", "mixer.x_conv", "mixer.B_conv",
                       "mixer.C_conv", "mixer.out_proj"}


def test_wsd_schedule_warms_up_holds_then_decays(capsys):
    lr = make_schedule(1.0, steps=100, warmup=10, schedule="wsd")
    assert float(lr(0)) == 0.0 and float(lr(10)) == pytest.approx(1.0)
    assert float(lr(50)) == pytest.approx(1.0) and float(lr(79)) == pytest.approx(1.0)
    assert float(lr(90)) == pytest.approx(0.55) and float(lr(100)) == pytest.approx(0.1)
    # a warmup into the last fifth is shortened: the decay still reaches lr/10 (it ended at
    # 0.595 of the peak, cut off)
    lr = make_schedule(1.0, steps=100, warmup=90, schedule="wsd")
    assert float(lr(80)) == pytest.approx(1.0) and float(lr(100)) == pytest.approx(0.1)
    capsys.readouterr()
    main(["--steps", "10", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--warmup", "9", "--schedule", "wsd", "--out", "none"])
    assert ("--warmup 9 leaves --schedule wsd no room for its decay over the last 20% of "
            "--steps 10: the learning rate warms up over 8 steps instead") in \
        capsys.readouterr().err


def test_a_recipes_tokenizer_is_named_as_the_recipes_where_it_is_wrong(tmp_path, capsys):
    """A recipe's tokenizer against a dataset's, or a recipe's tokenizer.json not found from
    this folder: the message names the recipe (it named a --tokenizer never given)."""
    from bpe import bpe_tokenizer

    from mamba_jax.data import DEFAULT_CORPUS, prepare

    bpe_tokenizer(tmp_path / "tokenizer.json")
    prepare([DEFAULT_CORPUS], str(tmp_path / "tokenizer.json"), tmp_path / "ds")
    recipe = tmp_path / "r.toml"
    flags = ["--config", str(recipe), "--steps", "1", "--batch-size", "8", "--seq-len", "32",
             "--out", "none"]
    recipe.write_text('tokenizer = "bytes"\n')
    with pytest.raises(SystemExit):
        main([*flags, "--data", str(tmp_path / "ds")])
    assert (f"was prepared with {tmp_path / 'ds' / 'tokenizer.json'}, not the tokenizer of "
            f"--config {recipe} (bytes)") in capsys.readouterr().err
    recipe.write_text('tokenizer = "no/such/tokenizer.json"\n')  # beside the recipe
    missing = tmp_path / "no" / "such" / "tokenizer.json"
    with pytest.raises(SystemExit):
        main(flags)
    assert (f"the tokenizer of --config {recipe}: tokenizer file {missing} not "
            "found") in capsys.readouterr().err
    with pytest.raises(SystemExit):  # with a prepared --data: it named neither
        main([*flags, "--data", str(tmp_path / "ds")])
    assert capsys.readouterr().err.endswith(
        f"the tokenizer of --config {recipe}: tokenizer file {missing} not found"
        ": pass --tokenizer PATH/tokenizer.json or PATH/tokenizer.model (SentencePiece), or "
        "--tokenizer bytes for byte-level models; or leave it out of the recipe to train with "
        f"the tokenizer --data {tmp_path / 'ds'} was prepared with\n")


def test_a_recipes_paths_are_read_from_its_folder_and_data_brings_its_tokenizer(
        tmp_path, monkeypatch):
    """A recipe's tokenizer.json was looked for in the current folder (from the repository
    root: not found, though --data held its own). Its paths are its folder's now, and the
    recipes in train/ name no tokenizer: a dataset's own is used."""
    from pathlib import Path

    from bpe import bpe_tokenizer

    from mamba_jax.data import DEFAULT_CORPUS, prepare
    from mamba_jax.train import parse_command_line, resolve_tokenizer

    repo = Path(__file__).parents[1]
    bpe_tokenizer(tmp_path / "tokenizer.json")
    prepare([DEFAULT_CORPUS], str(tmp_path / "tokenizer.json"), tmp_path / "ds")
    monkeypatch.chdir(repo)
    args, _ = parse_command_line(["--config", "train/mamba2-130m.toml", "--data",
                                  str(tmp_path / "ds")])
    assert resolve_tokenizer(args) == str(tmp_path / "ds" / "tokenizer.json")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "r.toml").write_text(
        'data = [2, "a.txt", 1, "/abs/b"]\ntokenizer = "../tokenizer.json"\nout = "out"\n'
        'checkpoint_dir = "~/ck"\nmetrics_file = "m.jsonl"\ncompilation_cache = "off"\n')
    monkeypatch.chdir(tmp_path / "ds")  # anywhere else
    args, _ = parse_command_line(["--config", str(recipes / "r.toml")])
    assert args.data == ["2", str(recipes / "a.txt"), "1", "/abs/b"]
    assert (args.tokenizer, args.out) == (str(tmp_path / "tokenizer.json"), str(recipes / "out"))
    assert (args.checkpoint_dir, args.metrics_file, args.compilation_cache) == (
        "~/ck", str(recipes / "m.jsonl"), "off")
    args, _ = parse_command_line(["--config", str(recipes / "r.toml"), "--out", "here"])
    assert args.out == "here"  # the command line's, from the current folder


def test_recipe_file_sets_flags_and_model_and_the_command_line_wins(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('steps = 50\nbatch_size = 8\nseq_len = 32\nlr = 1e-3\n'
                      '[model]\nd_model = 64\n[model.mamba2]\nheaddim = 16\nd_state = 16\n')
    out = tmp_path / "out"
    main(["--config", str(recipe), "--steps", "2", "--set", "n_layer=1",
          "--set", "mamba2.d_state=32", "--eval-every", "0", "--out", str(out)])
    effective = json.loads((out / "train_config.json").read_text())
    assert effective["train"]["steps"] == 2 and effective["train"]["lr"] == 1e-3
    assert effective["model"]["d_model"] == 64 and effective["model"]["n_layer"] == 1
    assert effective["model"]["mamba2"]["headdim"] == 16
    assert mamba_jax.from_pretrained(out).config.mamba2.d_state == 32
    # A recipe in the flat spelling of configs before sections still loads.
    recipe.write_text('[model]\nd_model = 64\nheaddim = 16\nattn_num_heads = 4\n'
                      'attn_num_heads_kv = 4\nlayer_pattern = "M*"\nn_layer = 2\n')
    _, cfg = parse_args(["--config", str(recipe)])
    assert (cfg.mamba2.headdim, cfg.attention.num_heads) == (16, 4)
    recipe.write_text("stepz = 3\n")
    with pytest.raises(SystemExit, match=r"unknown keys \['stepz'\]"):
        main(["--config", str(recipe)])
    for table, name in (("[model]\ndmodel = 64\n", "Mamba2Config has no field 'dmodel'"),
                        ("[model.mamba2]\nstate = 16\n", "Mamba2Config.mamba2 has no field "
                                                          "'state'")):
        recipe.write_text(table)  # named as the recipe's, as its other keys are
        with pytest.raises(SystemExit, match=rf"--config {recipe} \[model\]: {name}"):
            main(["--config", str(recipe)])


def test_every_recipe_in_train_dir_parses_to_its_preset():
    from pathlib import Path

    recipes = sorted((Path(__file__).parents[1] / "train").glob("*.toml"))
    assert {r.stem for r in recipes} == {"tiny", "mamba2-130m", "mamba2-370m", "mamba2-780m",
                                         "mamba2-1.3b", "mamba2-2.7b", "megatron-hybrid-800m",
                                         "megatron-hybrid-8b", "mamba-130m"}
    for recipe in recipes:
        args, cfg = parse_args(["--config", str(recipe)])
        assert args.preset == recipe.stem and cfg == Mamba2Config.preset(recipe.stem)


def test_model_flops_count_each_layer_kind_by_its_own_weights():
    # A layer's forward matmul FLOPs per token are 2 x its matmul weights (plus, for
    # attention, the score and value products over l/2 keys on average); training is 3x.
    from mamba_jax.metrics import train_flops_per_token
    base = dict(d_model=64, n_layer=3, vocab_size=100, d_state=16, headdim=16, chunk_size=16,
                attn_num_heads=4, attn_num_heads_kv=2, attn_head_dim=16, d_intermediate=96)
    seq_len = 64
    hybrid = Mamba2Config(**base, layer_pattern="M*-")
    mamba = Mamba2Config(**base, layer_pattern="MMM")
    state = nnx.state(Mamba2LM(hybrid, rngs=nnx.Rngs(0)))
    weights = lambda layer, names: sum(state["layers"][layer]["mixer"][name][...].size
                                       for name in names)
    attention = 2 * weights(1, ("q_proj", "k_proj", "v_proj", "o_proj")) + 2 * 4 * 16 * seq_len
    mlp = 2 * weights(2, ("up_proj", "gate_proj", "down_proj"))
    two = mamba.replace(n_layer=2, layer_pattern="MM")
    mamba_layer = (train_flops_per_token(mamba, seq_len) - train_flops_per_token(two, seq_len)) / 3
    expected = train_flops_per_token(mamba, seq_len) + 3 * (attention + mlp - 2 * mamba_layer)
    np.testing.assert_allclose(train_flops_per_token(hybrid, seq_len), expected, rtol=1e-12)


def tensorboard_events(directory):
    """Every event of the TensorBoard event files in directory, file by file."""
    from tensorboardX.proto import event_pb2

    events = []
    for file in sorted(directory.glob("events.out.tfevents.*")):
        data, i = file.read_bytes(), 0
        while i < len(data):  # TFRecords: length (8 bytes), its CRC (4), data, its CRC (4)
            (length,) = struct.unpack("<Q", data[i:i + 8])
            events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + length]))
            i += 12 + length + 4
    return events


def test_metrics_of_a_resumed_run_supersede_what_the_killed_run_logged_after_it(tmp_path,
                                                                              capsys):
    from tensorboardX.proto.event_pb2 import SessionLog

    jsonl, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    killed = MetricsWriter(jsonl, tb)
    for step in range(1, 6):
        killed.write({"step": step, "loss": 1.0})
    killed.close()
    with open(jsonl, "a") as f:
        f.write('{"step": 6, "lo')  # the line a kill cut short
    resumed = MetricsWriter(jsonl, tb, resume_step=3)
    for step in range(4, 6):
        resumed.write({"step": step, "loss": 2.0})
    resumed.close()
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0),
                                                        (5, 2.0)]
    # The rows it superseded are kept beside it (the file may have been another run's), and
    # said; a second resume from that step keeps its own.
    aside = tmp_path / "m.jsonl.after-step-3"
    assert aside.read_text() == ('{"step": 4, "loss": 1.0}\n{"step": 5, "loss": 1.0}\n'
                                 '{"step": 6, "lo\n')
    assert capsys.readouterr().err == (f"--metrics-file {jsonl}: the 3 rows after step 3, "
                                       "which this run writes again from its checkpoint, "
                                       f"moved to {aside}\n")
    MetricsWriter(jsonl, resume_step=3).close()
    assert (tmp_path / "m.jsonl.after-step-3-2").read_text().count("\n") == 2
    assert aside.read_text().count("\n") == 3
    # TensorBoard drops the older events from the step of a SessionLog START on.
    starts = [e.step for e in tensorboard_events(tb)
              if e.HasField("session_log") and e.session_log.status == SessionLog.START]
    assert starts == [4]


def test_every_evaluation_prints_a_line(capsys):
    progress = Progress(40)  # not a terminal here: a line every 10% of the steps
    for step in range(1, 41):
        record = {"loss": 2.0, "tokens_per_s": 1000.0, "step_time_s": 0.01}
        if step % 3 == 0:
            record.update(eval_loss=1.5, eval_ppl=4.5)
        progress.update(step, record)
    lines = capsys.readouterr().err.splitlines()
    evaluated = [int(line.split("/")[0]) for line in lines if "eval 1.500" in line]
    assert evaluated == list(range(3, 40, 3))


def test_the_learning_rate_must_be_a_number_at_least_0():
    # 0 is a run that changes no weight (tests/test_init_from.py trains at it)
    assert parse_args(["--lr=0"])[0].lr == 0
    for lr in ("-1e-3", "nan", "inf"):
        with pytest.raises(SystemExit, match=f"--lr={float(lr)} must be a number >= 0"):
            parse_args([f"--lr={lr}"])


@pytest.mark.parametrize("flag,value,message", [
    ("--warmup", "-5", "--warmup=-5 must be >= 0"),
    ("--clip", "-1", "--clip=-1.0 must be a positive number"),
    ("--clip", "0", "--clip=0.0 must be a positive number"),
    ("--clip", "nan", "--clip=nan must be a positive number"),
    ("--weight-decay", "-0.1", "--weight-decay=-0.1 must be a number >= 0"),
    ("--weight-decay", "inf", "--weight-decay=inf must be a number >= 0"),
    ("--loss-chunk", "0", "--loss-chunk=0 must be >= 1"),
])
def test_optimizer_flags_that_would_train_wrongly_are_refused(flag, value, message):
    # a negative clip turns the gradients around and a negative decay grows the weights,
    # both without an error; a zero loss chunk divided by zero
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_args([flag, value])
    parse_args([flag, {"--warmup": "0", "--weight-decay": "0"}.get(flag, "1")])  # the edge


@pytest.mark.parametrize("flags,message", [
    (["--mesh", "dp=2,tp=4", "--batch-size", "8", "--grad-accum", "8"],
     "--batch-size 8 / --grad-accum 8 = micro-batches of 1 rows do not split over the mesh's "
     "dp x fsdp = 2 data shards: use a --batch-size that is a multiple of 16 (--grad-accum x "
     "dp x fsdp)"),
    (["--mesh", "dp=2,fsdp=2,tp=2", "--batch-size", "6"],
     "--batch-size 6 rows do not split over the mesh's dp x fsdp = 4 data shards: use a "
     "--batch-size that is a multiple of 4"),
    (["--mesh", "dp=8", "--batch-size", "8", "--grad-accum", "3"],
     "--batch-size 8 must be divisible by processes x --grad-accum = 1 x 3: use a multiple of "
     "3, or another --grad-accum"),
])
def test_a_batch_the_mesh_cannot_split_is_named_by_its_flags(flags, message, capsys):
    """The rows a step shards come from --batch-size and --grad-accum: the refusal names
    those, not the micro-batch alone (the 8 CPU devices of the tests)."""
    with pytest.raises(SystemExit) as refused:
        main([*flags, "--steps", "1", "--seq-len", "32", "--set", "d_model=64", "--set",
              "n_layer=1", "--out", "none"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(f"python -m mamba_jax.train: {message}\n")


def test_a_mamba_ssm_style_hybrid_exports_in_mamba_ssms_layout(tmp_path, capsys):
    """SwiGLU MLPs after each mixer and dt unclamped, as mamba_ssm's hybrids: NemotronH
    cannot hold it, so the default --out writes mamba_ssm's layout, and says so."""
    from mamba_jax.convert import load_config
    out = tmp_path / "out"
    main(["--steps", "1", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=4", "--set", "layer_pattern=M-*-", "--set",
          "mlp.d_intermediate=128", "--eval-every", "0", "--out", str(out)])
    assert f"saved {out} (mamba_ssm's layout); try:" in capsys.readouterr().err
    cfg, fmt = load_config(out)
    assert fmt == "mamba_ssm" and cfg.layers == "M-*-"


@pytest.mark.parametrize("inside", ["100", "export/hf", "."])
def test_an_out_inside_the_checkpoint_dir_is_refused(tmp_path, capsys, inside):
    """The checkpoint dir's folders are steps to Orbax: an --out named 100 there was later
    set aside as a corrupt checkpoint."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as refused:
        main(["--steps", "1", "--checkpoint-dir", str(ckpt), "--out", str(ckpt / inside)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"--out {ckpt / inside} is inside --checkpoint-dir {ckpt}, whose folders are the "
        "checkpoints: give an --out outside it\n")
    assert not ckpt.exists()


def test_a_hybrid_no_published_layout_holds_trains_and_exports_in_our_own(tmp_path, capsys):
    """The README's hybrid: SwiGLU MLP layers without a width (the default one), attention,
    dt unclamped. No published layout holds it: the run exported it in our own layout,
    said why in one line, and generate reads it (it stopped at the width, then refused
    the default --out in some 700 characters)."""
    from mamba_jax.convert import flat_params, load_config
    from mamba_jax.init_from import load_training_checkpoint
    from mamba_jax.generate import load_for_generation
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    main(["--steps", "1", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--num-layers", "4", "--hybrid-override-pattern", "M*-M", "--eval-every", "0",
          "--out", str(out), "--checkpoint-dir", str(ckpt)])
    err = capsys.readouterr().err.splitlines()
    assert err[-2].startswith("note: in mamba_jax's own layout, which from_pretrained, "
                              "generate, serve and convert read and transformers does not: no "
                              "published layout holds the model (format='nemotron_h' cannot "
                              "express mlp.activation='swiglu'")
    assert err[-1].startswith(f"saved {out} (mamba_jax's layout); try: ")
    trained, _ = load_training_checkpoint(ckpt)
    cfg, fmt = load_config(out)
    assert fmt == "mamba_jax" and cfg == trained.config and cfg.mlp.d_intermediate == 256
    model, tokenizer, _ = load_for_generation(out)  # generate's and serve's reading
    assert model.config == cfg and tokenizer.encode("GNU").ids == list(b"GNU")
    exported, saved = flat_params(model), flat_params(trained)
    assert exported.keys() == saved.keys()
    for name, value in saved.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_bidirectional_layers_are_refused_for_a_language_model(capsys):
    """B layers read later tokens: the next-token loss would see its targets (a run
    reported a perplexity half the causal model's) and decoding has no step for them."""
    with pytest.raises(SystemExit) as refused:
        main(["--steps", "1", "--set", "layer_pattern=MB", "--set", "n_layer=2", "--out",
              "none"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(
        "layer_pattern 'MB': its B layers read later tokens, which a language model "
        "predicting the next one cannot have; build a mamba_jax.Mamba2Encoder with them\n")


def test_several_processes_without_a_coordinator_name_the_flags(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    from mamba_jax import parallel

    def initialize(*args):  # jax's refusal where no cluster manager gives the address
        raise ValueError("coordinator_address should be defined.")
    monkeypatch.setattr(parallel.jax.distributed, "initialize", initialize)
    with pytest.raises(ValueError, match=r"several processes \(--num-processes 2\): "
                       r"coordinator_address should be defined\. Give every process "
                       r"--coordinator-address HOST:PORT"):
        parallel.initialize_distributed(None, 2, None)
    with pytest.raises(ValueError, match=r"--process-id 1 alone: several processes need"):
        parallel.initialize_distributed(None, None, 1)  # it trained as process 0 of 1
    # An srun step or an mpirun of several tasks: jax's cluster detection gives the rest (it
    # was never asked)
    calls = []
    monkeypatch.setattr(parallel.jax.distributed, "initialize", lambda *a: calls.append(a))
    for name in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
        monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
        parallel.initialize_distributed()
        monkeypatch.setenv(name, "1")
        parallel.initialize_distributed()
        assert calls == []
        monkeypatch.setenv(name, "4")
        parallel.initialize_distributed()
        assert calls == [()]
        calls.clear()


@pytest.mark.parametrize("module,argv,default", [
    ("mamba_jax.train", [], "(default: 300)"),
    ("mamba_jax.data", ["prepare"], "(default: 0.01)"),
    ("mamba_jax.generate.__main__", [], "(default: 64)"),
    ("mamba_jax.serve", [], "(default: 6000)"),
    ("mamba_jax.convert", [], "(default: the newest)"),
])
def test_the_help_of_every_command_shows_the_defaults(module, argv, default, capsys):
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main([*argv, "--help"])
    assert done.value.code == 0
    assert default in capsys.readouterr().out


def test_trains_a_sentencepiece_blend_of_a_prepared_and_a_megatron_dataset(tmp_path, capsys):
    from pathlib import Path

    from mamba_jax.data import DEFAULT_CORPUS, prepare
    from mamba_jax.generate import load_for_generation
    from mamba_jax.tokenizer import SentencePieceTokenizer

    model_file = Path(__file__).parent / "fixtures" / "megatron" / "tokenizer.model"
    (tmp_path / "text.txt").write_text(DEFAULT_CORPUS.read_text()[:4000])
    prepare([tmp_path / "text.txt"], model_file, tmp_path / "ds", eval_fraction=0.0)
    megatron = str(tmp_path / "ds" / "tokens")  # tokens.bin + tokens.idx: a Megatron prefix
    with pytest.raises(SystemExit, match=r"tokens is a Megatron indexed dataset, which does "
                                         r"not record its tokenizer: pass .* --tokenizer"):
        main(["--data", megatron, "--steps", "1"])
    main(["--data", "0.5", str(tmp_path / "ds"), "0.5", megatron, "--tokenizer", str(model_file),
          "--steps", "1", "--batch-size", "8", "--seq-len", "16", "--set", "n_layer=1",
          "--set", "d_model=32", "--set", "headdim=16", "--set", "d_state=8",
          "--set", "chunk_size=16", "--out", str(tmp_path / "hf")])
    assert "vocab_size 512: the tokenizer's" in capsys.readouterr().err
    saved = tmp_path / "hf" / "tokenizer.model"
    assert saved.read_bytes() == model_file.read_bytes()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (2, 1)
    model, tok, eos = load_for_generation(tmp_path / "hf")
    assert isinstance(tok, SentencePieceTokenizer) and eos == 2
    assert model.config.vocab_size == 512


def test_layers_one_after_the_other_train_as_the_scan_does(tmp_path, capsys, layer_scans):
    # By default no layer scan, and the same losses, step by step, as the layers' scan
    # (--scan-layers; float32; XLA may fuse the two programs apart: 1e-5 relative).
    def losses(*flags):
        metrics = tmp_path / f"m{len(flags)}.jsonl"
        main(["--steps", "4", "--batch-size", "8", "--seq-len", "32", "--warmup", "1",
              "--eval-every", "0", "--metrics-file", str(metrics), "--out", "none", *flags])
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    unrolled = losses()
    assert not layer_scans
    scanned = losses("--scan-layers")
    assert layer_scans
    assert "layers unrolled" in capsys.readouterr().err
    assert np.all(np.isfinite(unrolled)) and unrolled[-1] < unrolled[0]
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-5)


def test_a_warmup_as_long_as_the_run_is_shortened_and_says_so(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    main(["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--warmup", "5", "--lr", "1e-3", "--metrics-file",
          str(metrics), "--out", "none"])
    assert ("--warmup 5 is not below --steps 3: the learning rate warms up over 2 steps "
            "instead") in capsys.readouterr().err
    lrs = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()]
    np.testing.assert_allclose(lrs[:3], [0.0, 5e-4, 1e-3], rtol=1e-6)  # the peak at step 2


def test_eval_every_0_trains_without_evaluating(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    main(["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--eval-every", "0", "--metrics-file", str(metrics),
          "--out", "none"])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert not any("eval_loss" in r for r in records)  # not even after the last step
    assert "does not evaluate" not in capsys.readouterr().err  # asked for: nothing to say
    with pytest.raises(SystemExit):
        main(["--help"])
    assert ("--eval-every N evaluate on the held-out split every N steps and after the last; "
            "0: never (default: 100)") in " ".join(capsys.readouterr().out.split())


def test_save_every_without_a_checkpoint_dir_says_it_saves_nothing(tmp_path, capsys):
    small = ["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
             "--set", "n_layer=1", "--out", "none"]
    main([*small, "--save-every", "1"])
    assert ("--save-every 1 without --checkpoint-dir: this run saves no checkpoints (add "
            "--checkpoint-dir DIR to save them)") in capsys.readouterr().err
    recipe = tmp_path / "r.toml"  # a recipe's value is the user's too
    recipe.write_text("save_every = 7\n")
    main([*small, "--config", str(recipe)])
    assert "--save-every 7 without --checkpoint-dir" in capsys.readouterr().err
    main(small)  # the default alone: nothing to say
    assert "--save-every" not in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"  # with a checkpoint dir the default applies: the last step
    main([*small, "--checkpoint-dir", str(ckpt)])
    assert "--save-every" not in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2"]
    config = json.loads((ckpt / "train_config.json").read_text())
    assert config["train"]["save_every"] == 500


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_one_step_run_trains_at_the_peak_rate(tmp_path, capsys, schedule):
    """A warmup's first step applies a rate of 0: a run of one step skips the warmup rather
    than make no update."""
    metrics = tmp_path / "m.jsonl"
    main(["--steps", "1", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--warmup", "5", "--lr", "1e-3", "--schedule", schedule,
          "--metrics-file", str(metrics), "--out", "none"])
    assert ("--warmup 5 is not below --steps 1: the learning rate starts at its peak "
            "instead") in capsys.readouterr().err
    [record] = [json.loads(line) for line in metrics.read_text().splitlines()]
    np.testing.assert_allclose(record["lr"], 1e-3, rtol=1e-6)


def test_each_step_is_dispatched_before_the_loss_before_it_is_read(tmp_path, monkeypatch):
    # The host reads a step's loss only once the next step is on its way, but for the steps
    # that save, evaluate or end the run, which it reads at once.
    import mamba_jax.train as train

    make_train_step, events = train.make_train_step, []

    class Loss:
        def __init__(self, value, step):
            self.value, self.step = value, step

        def __float__(self):
            events.append(("read", self.step))
            return float(self.value)

    def recording(loss_fn, tx, **options):
        step = make_train_step(loss_fn, tx, **options)

        def run(params, opt_state, batch):
            params, opt_state, loss, grad_norm = step(params, opt_state, batch)
            n = 1 + sum(kind == "dispatch" for kind, _ in events)
            events.append(("dispatch", n))
            return params, opt_state, Loss(loss, n), grad_norm
        return run

    monkeypatch.setattr(train, "make_train_step", recording)
    metrics = tmp_path / "m.jsonl"
    main(["--steps", "7", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--warmup", "2", "--lr", "1e-3", "--save-every", "3",
          "--eval-every", "1000", "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-file",
          str(metrics), "--out", "none"])
    assert events == [("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3),
                      ("read", 2), ("read", 3),  # saved at 3
                      ("dispatch", 4), ("dispatch", 5), ("read", 4), ("dispatch", 6),
                      ("read", 5), ("read", 6),  # saved at 6
                      ("dispatch", 7), ("read", 7)]  # the last
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert all(np.isfinite(r["loss"]) and r["step_time_s"] > 0 for r in records)
    lr_at = make_schedule(1e-3, 7, 2)  # each record the rate its step applied
    np.testing.assert_allclose([r["lr"] for r in records], [lr_at(s) for s in range(7)],
                               rtol=1e-6)


def test_the_steps_compile_with_cublas_gemms_unless_xla_flags_choose(monkeypatch):
    from mamba_jax.optim import train_compiler_options
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert train_compiler_options() == {"xla_gpu_enable_triton_gemm": False,
                                        "xla_gpu_enable_cublaslt": False}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d")
    assert train_compiler_options() == {"xla_gpu_enable_cublaslt": False}
    assert train_compiler_options(deterministic=True) == {"xla_gpu_enable_cublaslt": False,
                                                          "xla_gpu_deterministic_ops": True}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert "xla_gpu_deterministic_ops" not in train_compiler_options(deterministic=True)


def test_deterministic_compiles_the_step_with_xla_deterministic_ops(tmp_path, monkeypatch):
    """--deterministic reaches the step's compile (XLA takes the GPU option on a CPU too, so
    the flag trains anywhere), and a run with it trains."""
    from mamba_jax import optim, train
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    jit_options = []
    jit = optim.jax.jit
    monkeypatch.setattr(optim.jax, "jit", lambda *a, **k: jit_options.append(
        k.get("compiler_options")) or jit(*a, **k))
    metrics = tmp_path / "metrics.jsonl"
    main(["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--set", "d_model=64",
          "--set", "n_layer=1", "--deterministic", "--eval-every", "0", "--out", "none",
          "--metrics-file", str(metrics)])
    assert {"xla_gpu_deterministic_ops": True, "xla_gpu_enable_triton_gemm": False,
            "xla_gpu_enable_cublaslt": False} in jit_options
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and np.all(np.isfinite(losses))


def test_a_model_too_large_for_the_devices_is_one_line(tmp_path):
    """A billion-row padded vocabulary on one CPU device: the parameters' allocation failed
    in the init, a traceback (the steps' out-of-memory message came later). A process of
    its own: the tests' 8 CPU devices allocate it lazily, and fail in the step."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device
    done = subprocess.run([sys.executable, "-m", "mamba_jax.train", "--set",
                           "pad_vocab_size_multiple=1000000000", "--steps", "1", "--out",
                           "none", "--batch-size", "8", "--seq-len", "16"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**env, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.splitlines()[-1]
    assert last.startswith("python -m mamba_jax.train: the model (128000.2M parameters, "
                           "1430.5 GiB with AdamW's two float32 moments) does not fit in the "
                           "devices' memory (")
    assert "Traceback" not in done.stderr
