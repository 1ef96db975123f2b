"""Checkpoints from transformers' PyTorch Mamba2ForCausalLM (tests/fixtures, made by
tests/fixtures/make_hf_fixtures.py) give the same logits and greedy tokens here; our
checkpoints round-trip through both layouts."""

import json
import os
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.convert import flat_params, load_config

FIXTURES = Path(__file__).parent / "fixtures"
HF_CASES = ["hf_ngroups1_tied", "hf_ngroups1_untied", "hf_ngroups2_tied",
            "hf_ngroups2_untied"]


@pytest.mark.parametrize("case", HF_CASES + ["mamba_ssm_ngroups2_untied"])
def test_logits_match_pytorch_within_1e4_relative(case):
    model = mamba_jax.from_pretrained(FIXTURES / case)
    ids = np.load(FIXTURES / case / "input_ids.npy")  # [2, 37]: not a multiple of chunk 16
    expected = np.load(FIXTURES / case / "logits.npy")
    logits = np.asarray(model(jnp.asarray(ids)))
    assert logits.shape == expected.shape
    assert np.linalg.norm(logits - expected) / np.linalg.norm(expected) < 1e-4
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4


@pytest.mark.parametrize("case", HF_CASES)
def test_greedy_generation_gives_the_pytorch_tokens(case):
    model = mamba_jax.from_pretrained(FIXTURES / case)
    expected = np.load(FIXTURES / case / "greedy.npy")  # 10 prompt + 12 new tokens
    out = mamba_jax.generate(model, jnp.asarray(expected[:, :10]), max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("fmt", ["hf", "mamba_ssm", "mamba_jax"])
@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_save_then_load_round_trips_every_parameter(tmp_path, fmt, tie, bias):
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=8, ngroups=2,
                              vocab_size=250, tie_embeddings=tie, bias=bias,
                              dt_limit=(0.0, float("inf")))
    model = Mamba2LM(cfg, rngs=nnx.Rngs(3))
    mamba_jax.save_pretrained(model, tmp_path, format=fmt)
    loaded_cfg, detected = load_config(tmp_path)
    assert detected == fmt
    assert loaded_cfg.padded_vocab_size == cfg.padded_vocab_size == 256
    if fmt != "hf":
        assert loaded_cfg == cfg
    keys = load_file(tmp_path / "model.safetensors").keys()
    # HF drops a tied head; mamba_ssm's strict load_state_dict expects it; ours by our names
    if fmt == "mamba_jax":
        assert keys == flat_params(model).keys() and ("lm_head" in keys) == (not tie)
    else:
        assert ("lm_head.weight" in keys) == (not tie or fmt == "mamba_ssm")
    loaded = mamba_jax.from_pretrained(tmp_path)
    a, b = flat_params(model), flat_params(loaded)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # the weights readable as the config is (safetensors wrote them 0600)
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777
    assert mode("model.safetensors") == mode("config.json")


@pytest.mark.parametrize("limit,written", [((0.0, float("inf")), None),
                                           ((0.001, float("inf")), "[0.001,Infinity]"),
                                           ((0.0, 0.1), "[0.0,0.1]")])
def test_a_mamba_ssm_config_gives_mamba2_a_dt_limit_it_takes(tmp_path, limit, written):
    """mamba_ssm passes ssm_cfg to its Mamba2 as json.load reads it: dt_limit as numbers
    (Mamba2 compares it with (0.0, inf) and clamps dt by it), left out at that default;
    HF's {"__float__": ...} spelling would reach its clamp as a dict."""
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=8, dt_limit=limit)
    mamba_jax.save_pretrained(Mamba2LM(cfg, rngs=nnx.Rngs(0)), tmp_path, format="mamba_ssm")
    text = (tmp_path / "config.json").read_text()
    ssm_cfg = json.loads(text)["ssm_cfg"]
    if written is None:
        assert "dt_limit" not in ssm_cfg
    else:
        assert f'"dt_limit":{written}' in "".join(text.split())
        assert tuple(ssm_cfg["dt_limit"]) == limit
    assert load_config(tmp_path)[0].mamba2.dt_limit == limit


def test_hf_config_reads_both_infinity_spellings(tmp_path):
    src = FIXTURES / "hf_ngroups1_tied"
    config = json.loads((src / "config.json").read_text())
    assert config["time_step_limit"][1] == {"__float__": "Infinity"}
    shutil.copy(src / "model.safetensors", tmp_path)
    text = json.dumps({**config, "time_step_limit": [0.0, 1e9]}).replace("1000000000.0",
                                                                          "Infinity")
    assert "Infinity" in text
    (tmp_path / "config.json").write_text(text)
    cfg, _ = load_config(tmp_path)
    assert cfg.mamba2.dt_limit == (0.0, float("inf"))


def _copy_fixture(tmp_path, case="hf_ngroups1_untied"):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / case / f, tmp_path)
    return load_file(tmp_path / "model.safetensors")


def _save_changed_fixture(tmp_path, change):
    """The untied ngroups-1 fixture in tmp_path, its tensors passed through change(dict)."""
    tensors = _copy_fixture(tmp_path)
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    _save_changed_fixture(tmp_path, lambda t: t.pop("backbone.layers.1.mixer.A_log"))
    with pytest.raises(ValueError, match=rf"^{tmp_path}: .*missing 'backbone.layers.1.mixer."
                                         r"A_log' \(expected shape \(4,\)\)"):
        mamba_jax.from_pretrained(tmp_path)


def test_a_tensor_of_an_integer_dtype_is_refused_not_cast(tmp_path):
    _save_changed_fixture(tmp_path, lambda t: t.update(
        {"backbone.layers.0.mixer.D": np.ones(4, np.int64)}))  # cast to float32 silently
    with pytest.raises(ValueError, match=rf"^{tmp_path}: checkpoint tensor 'backbone.layers.0"
                                         r".mixer.D' is of dtype int64; the model's weights "
                                         r"are floating-point tensors"):
        mamba_jax.from_pretrained(tmp_path)


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    _save_changed_fixture(tmp_path, lambda t: t.update(
        {"backbone.layers.0.mixer.conv1d.weight": np.zeros((96, 1, 3), np.float32)}))
    with pytest.raises(ValueError, match=r"'backbone.layers.0.mixer.conv1d.weight' has shape "
                                         r"\(96, 1, 3\), expected \(96, 1, 4\)"):
        mamba_jax.from_pretrained(tmp_path)


def test_a_model_whose_parameters_are_another_configs_is_not_saved(tmp_path):
    # nnx.update with another model's parameters ran, and was written beside this config:
    # a checkpoint that from_pretrained then refused
    model = Mamba2LM(Mamba2Config.preset("tiny"), rngs=nnx.Rngs(0))
    other = Mamba2LM(Mamba2Config.preset("tiny", **{"mamba2.d_state": 16}), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(other, nnx.Param))
    with pytest.raises(ValueError, match=r"save_pretrained: the model's parameters do not "
                                         r"fit its config: layers.0.mixer.B_conv "
                                         r"\(4, 1, 16\), not \(4, 1, 32\)"):
        mamba_jax.save_pretrained(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_untied_config_without_lm_head_is_an_error(tmp_path):
    _save_changed_fixture(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing 'lm_head.weight', and its embeddings are "
                                         "untied by its config"):
        mamba_jax.from_pretrained(tmp_path)
    # NemotronH never ties: a config saying it does is not read (it was "the config says
    # the embeddings are not tied", against the file)
    nemotron = tmp_path / "nemotron"
    shutil.copytree(FIXTURES / "nemotron_h_hybrid", nemotron)
    config = json.loads((nemotron / "config.json").read_text())
    (nemotron / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(nemotron / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, nemotron / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 'lm_head.weight', and its embeddings are "
                                         r"never tied in NemotronH \(its tie_word_embeddings "
                                         r"is not read\)"):
        mamba_jax.from_pretrained(nemotron)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        mamba_jax.from_pretrained(tmp_path)
    shutil.copy(FIXTURES / "hf_ngroups1_tied" / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        mamba_jax.from_pretrained(tmp_path)


def test_pytorch_bin_without_torch_says_how_to_convert(tmp_path, monkeypatch):
    shutil.copy(FIXTURES / "hf_ngroups1_tied" / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ImportError, match="needs torch.*safetensors.torch.save_file"):
        mamba_jax.from_pretrained(tmp_path)


def test_bfloat16_checkpoints_load_as_float32_parameters(tmp_path):
    tensors = _copy_fixture(tmp_path)
    from safetensors.flax import save_file as save_jax
    save_jax({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()},
             str(tmp_path / "model.safetensors"))
    model = mamba_jax.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16
    emb = np.asarray(model.embedding[...])
    assert emb.dtype == np.float32
    np.testing.assert_allclose(emb, tensors["backbone.embeddings.weight"], rtol=1e-2, atol=1e-3)


def test_convert_cli_writes_the_other_layout(tmp_path):
    from mamba_jax.convert import main
    main([str(FIXTURES / "hf_ngroups2_untied"), str(tmp_path), "--to", "mamba_ssm"])
    assert load_config(tmp_path)[1] == "mamba_ssm"
    ours = load_file(tmp_path / "model.safetensors")
    theirs = load_file(FIXTURES / "mamba_ssm_ngroups2_untied" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_convert_names_the_layout_it_wrote_where_hf_cannot_hold_the_model(tmp_path, capsys):
    # transformers has no Mamba-3: --to hf writes mamba_ssm's layout, and says so
    from mamba_jax.convert import main
    model = Mamba2LM(Mamba2Config.preset("mamba3-tiny"), rngs=nnx.Rngs(0))
    mamba_jax.save_pretrained(model, tmp_path / "src", format="mamba_ssm")
    main([str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "hf"])
    assert load_config(tmp_path / "dst")[1] == "mamba_ssm"
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'dst'} (mamba_ssm, the layout --to "
                                       f"hf writes for this model) from {tmp_path / 'src'}\n")


def test_convert_keeps_a_model_in_dst_unless_overwrite(tmp_path, capsys):
    from mamba_jax.cli import UserExit
    from mamba_jax.convert import main
    source = str(FIXTURES / "hf_ngroups2_untied")
    main([source, str(tmp_path), "--to", "mamba_ssm"])
    written = (tmp_path / "model.safetensors").read_bytes()
    capsys.readouterr()
    with pytest.raises(UserExit):
        main([source, str(tmp_path), "--to", "hf"])
    assert capsys.readouterr().err == (
        f"python -m mamba_jax.convert: {tmp_path} already holds a model (its config.json): "
        "give another output dir, or --overwrite to replace it\n")
    assert load_config(tmp_path)[1] == "mamba_ssm"
    assert (tmp_path / "model.safetensors").read_bytes() == written
    main([source, str(tmp_path), "--to", "hf", "--overwrite"])
    assert load_config(tmp_path)[1] == "hf"


def test_convert_without_a_tokenizer_over_a_model_with_one_says_it_kept_it(tmp_path, capsys):
    # The replaced model's tokenizer stays (removing a user's file is the larger risk), and
    # convert says so; converted in place, the tokenizer is the model's own: no word.
    from mamba_jax.convert import main
    from mamba_jax.tokenizer import byte_tokenizer, save_tokenizer
    source = str(FIXTURES / "hf_ngroups2_untied")
    main([source, str(tmp_path), "--to", "mamba_ssm"])
    save_tokenizer(byte_tokenizer(), tmp_path)
    capsys.readouterr()
    main([source, str(tmp_path), "--to", "hf", "--overwrite"])
    said = capsys.readouterr().out.splitlines()
    assert said[1] == (f"{tmp_path / 'tokenizer.json'} is the replaced model's, kept: {source} "
                       "has no tokenizer; remove it if it is not this model's (generate reads "
                       "it)")
    assert (tmp_path / "tokenizer.json").is_file()
    main([str(tmp_path), str(tmp_path), "--to", "mamba_ssm", "--overwrite"])
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_save_pretrained_over_another_model_with_a_tokenizer_warns_that_it_kept_it(tmp_path):
    """The API's export over a model with a tokenizer left that tokenizer, which generate
    then read with the new model, without a word (convert says so itself); the same model
    saved again in place keeps its own tokenizer, nothing to say."""
    import warnings

    from mamba_jax.convert import KeptTokenizer
    from mamba_jax.tokenizer import byte_tokenizer, save_tokenizer
    first = Mamba2LM(Mamba2Config.preset("tiny", d_model=64, n_layer=1), rngs=nnx.Rngs(0))
    mamba_jax.save_pretrained(first, tmp_path)
    save_tokenizer(byte_tokenizer(), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeptTokenizer)
        mamba_jax.save_pretrained(mamba_jax.from_pretrained(tmp_path), tmp_path)
    other = Mamba2LM(Mamba2Config.preset("tiny", d_model=32, n_layer=1), rngs=nnx.Rngs(0))
    with pytest.warns(KeptTokenizer, match=rf"^{tmp_path / 'tokenizer.json'} is the replaced "
                                           r"model's \(of other shapes\), kept beside this "
                                           r"one: generate and serve would read it"):
        mamba_jax.save_pretrained(other, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()


@pytest.mark.parametrize("dst,refusal", [("file", "a file, not a folder"),
                                          ("file/out", "file is a file, not a folder")])
def test_convert_names_a_dst_it_could_not_write(tmp_path, capsys, dst, refusal):
    from mamba_jax.cli import UserExit
    from mamba_jax.convert import main
    (tmp_path / "file").write_text("a user's file\n")
    with pytest.raises(UserExit, match=f"dst {tmp_path / dst}: .*{refusal}; give another path"):
        main([str(FIXTURES / "hf_ngroups2_untied"), str(tmp_path / dst), "--to", "mamba_ssm"])
    assert capsys.readouterr().err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "a user's file\n"


def test_an_export_replaces_a_tokenizer_of_the_other_kind(tmp_path):
    """A model exported over one whose tokenizer was of the other kind: what loads the
    directory finds the new model's tokenizer, not the replaced one's."""
    from mamba_jax.convert import export
    from mamba_jax.tokenizer import byte_tokenizer, find_tokenizer, load_tokenizer

    model = mamba_jax.from_pretrained(FIXTURES / "hf_ngroups1_tied")
    export(model, tmp_path, byte_tokenizer())
    assert find_tokenizer(tmp_path).name == "tokenizer.json"
    sentencepiece = FIXTURES / "megatron" / "tokenizer.model"
    export(model, tmp_path, load_tokenizer(str(sentencepiece)))
    assert find_tokenizer(tmp_path).name == "tokenizer.model"
    assert not (tmp_path / "tokenizer.json").exists()
    assert (tmp_path / "tokenizer.model").read_bytes() == sentencepiece.read_bytes()
    export(model, tmp_path, byte_tokenizer())
    assert sorted(p.name for p in tmp_path.glob("tokenizer.*")) == ["tokenizer.json"]


def _shard(tmp_path, first_keys, overlap):
    """The untied fixture as two shards and an index; `overlap` (None: no tensor) is in
    both shards."""
    tensors = load_file(FIXTURES / "hf_ngroups1_untied" / "model.safetensors")
    shutil.copy(FIXTURES / "hf_ngroups1_untied" / "config.json", tmp_path)
    first = {k: v for k, v in tensors.items() if k in first_keys or k == overlap}
    second = {k: v for k, v in tensors.items() if k not in first_keys}
    save_file(first, tmp_path / "model-1.safetensors")
    save_file(second, tmp_path / "model-2.safetensors")
    weight_map = {**{k: "model-1.safetensors" for k in first},
                  **{k: "model-2.safetensors" for k in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": weight_map}))


def test_an_export_over_a_model_removes_the_files_it_does_not_replace(tmp_path, capsys):
    """The replaced model's shards and index (read by tools that look for them), and the
    trainer's train_config.json (by which a resumed run took the folder for its own export
    and replaced the converted model without a word)."""
    from mamba_jax.convert import main
    dst = tmp_path / "dst"
    dst.mkdir()
    _shard(dst, {"backbone.embeddings.weight"}, None)
    (dst / "train_config.json").write_text('{"train": {"checkpoint_dir": "ck"}}\n')
    (dst / "notes.txt").write_text("a user's file\n")
    # the replaced model's ids, which transformers' generate reads before config.json's
    (dst / "generation_config.json").write_text('{"eos_token_id": 7}\n')
    for name in ("tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
                 "additional_chat_templates/tool_use.jinja"):
        (dst / name).parent.mkdir(exist_ok=True)
        (dst / name).write_text("the replaced model's\n")
    main([str(FIXTURES / "trained_tiny"), str(dst), "--to", "hf", "--overwrite"])
    assert capsys.readouterr().out.splitlines()[1] == (
        "removed the replaced model's model-1.safetensors, model-2.safetensors, "
        "model.safetensors.index.json, train_config.json, generation_config.json, "
        "tokenizer.model, tokenizer_config.json, chat_template.jinja, "
        "additional_chat_templates")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors",
                                                     "notes.txt", "tokenizer.json"]
    # Converted in place, its shards become the one file; its other files are its own.
    src = tmp_path / "src"
    src.mkdir()
    _shard(src, {"backbone.embeddings.weight"}, None)
    (src / "generation_config.json").write_text('{"eos_token_id": 7}\n')
    expected = mamba_jax.from_pretrained(src)(jnp.ones((1, 5), jnp.int32))
    main([str(src), str(src), "--to", "mamba_ssm", "--overwrite"])
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors"]
    np.testing.assert_array_equal(mamba_jax.from_pretrained(src)(jnp.ones((1, 5), jnp.int32)),
                                  expected)


def test_a_folder_of_weights_without_config_is_a_model_convert_keeps(tmp_path, capsys):
    from mamba_jax.cli import UserExit
    from mamba_jax.convert import main
    shutil.copy(FIXTURES / "hf_ngroups1_untied" / "model.safetensors", tmp_path)
    kept = (tmp_path / "model.safetensors").read_bytes()
    with pytest.raises(UserExit):
        main([str(FIXTURES / "hf_ngroups2_untied"), str(tmp_path), "--to", "hf"])
    assert capsys.readouterr().err == (
        f"python -m mamba_jax.convert: {tmp_path} already holds a model (its "
        "model.safetensors): give another output dir, or --overwrite to replace it\n")
    assert (tmp_path / "model.safetensors").read_bytes() == kept


def test_converted_in_place_a_model_keeps_both_its_tokenizer_files(tmp_path):
    from mamba_jax.convert import main
    from mamba_jax.tokenizer import byte_tokenizer, save_tokenizer
    _copy_fixture(tmp_path)
    save_tokenizer(byte_tokenizer(), tmp_path)
    sentencepiece = FIXTURES / "megatron" / "tokenizer.model"
    shutil.copy(sentencepiece, tmp_path)  # Hugging Face folders often hold both
    main([str(tmp_path), str(tmp_path), "--to", "mamba_ssm", "--overwrite"])
    assert (tmp_path / "tokenizer.model").read_bytes() == sentencepiece.read_bytes()
    assert (tmp_path / "tokenizer.json").is_file()


def test_an_hf_mamba2_config_without_tie_word_embeddings_is_untied_as_transformers_reads_it(
        tmp_path):
    # transformers' Mamba2Config defaults to False: the lm_head was dropped for the
    # embedding's rows, other logits without a word
    _copy_fixture(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("tie_word_embeddings") is False
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = jnp.asarray(np.load(FIXTURES / "hf_ngroups1_untied" / "input_ids.npy"))
    np.testing.assert_array_equal(
        mamba_jax.from_pretrained(tmp_path)(ids),
        mamba_jax.from_pretrained(FIXTURES / "hf_ngroups1_untied")(ids))


def test_an_encoder_is_not_saved_as_a_language_model(tmp_path):
    from mamba_jax.encoder import Mamba2Encoder
    encoder = Mamba2Encoder(Mamba2Config.preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"save_pretrained writes a Mamba2LM's checkpoint, "
                                         r"not a Mamba2Encoder's"):
        mamba_jax.save_pretrained(encoder, tmp_path / "enc")
    assert not (tmp_path / "enc").exists()


def test_two_shards_holding_one_tensor_are_refused(tmp_path):
    _shard(tmp_path, {"lm_head.weight"}, overlap=None)
    mamba_jax.from_pretrained(tmp_path)  # disjoint shards load
    _shard(tmp_path, {"lm_head.weight"}, overlap="backbone.norm_f.weight")
    with pytest.raises(ValueError, match=r"'backbone.norm_f.weight' is in two shards, "
                                         r"model-1.safetensors and model-2.safetensors"):
        mamba_jax.from_pretrained(tmp_path)


def test_an_index_naming_a_tensor_no_shard_holds_is_refused(tmp_path):
    _shard(tmp_path, {"lm_head.weight"}, overlap=None)
    index = tmp_path / "model.safetensors.index.json"
    entries = json.loads(index.read_text())
    entries["weight_map"]["backbone.extra.weight"] = "model-2.safetensors"  # was ignored
    index.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=r"names \['backbone.extra.weight'\], which no shard "
                                         r"holds \(model-2.safetensors should\)"):
        mamba_jax.from_pretrained(tmp_path)


@pytest.mark.parametrize("where", ["../elsewhere/model-1.safetensors", "absolute"])
def test_a_shard_index_naming_files_outside_the_checkpoint_is_refused(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _shard(ckpt, {"lm_head.weight"}, overlap=None)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(ckpt / "model-1.safetensors", tmp_path / "elsewhere")
    outside = where if where != "absolute" else str(tmp_path / "elsewhere" /
                                                    "model-1.safetensors")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = outside
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"shard '{outside}' is not a file inside {ckpt}"):
        mamba_jax.from_pretrained(ckpt)


@pytest.mark.parametrize("field,value,must", [
    ("num_hidden_layers", 10**6, r"num_hidden_layers=1000000 must be an integer in \[1, 1024\]"),
    ("hidden_size", "32", r'hidden_size="32" must be an integer'),
    ("vocab_size", True, "vocab_size=true must be an integer"),
    ("state_size", 1.5, "state_size=1.5 must be an integer"),
    ("time_step_min", "0.001", 'time_step_min="0.001" must be a finite number'),
    ("use_conv_bias", "yes", 'use_conv_bias="yes" must be true or false'),
    ("time_step_limit", "none", r'time_step_limit="none" must be a pair \[low, high\]'),
    # transformers applies it after the conv: read as SiLU, the model was silently another
    ("hidden_act", "gelu", "hidden_act must be silu"),
])
def test_config_fields_of_the_wrong_type_or_size_are_named(tmp_path, field, value, must):
    config = json.loads((FIXTURES / "hf_ngroups1_tied" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=f"config.json: {must}"):
        load_config(tmp_path)


def test_config_files_that_are_not_a_config_are_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: Expecting property name"):
        load_config(tmp_path)
    # another architecture's config, whose hidden_size a Mamba2 config also has
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "num_hidden_layers": 2,
                                                      "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"config.json: model_type 'llama' is no Mamba model; "
                                         r"the config must be transformers' \(model_type "
                                         r"'mamba2', 'mamba', 'falcon_mamba', 'nemotron_h'\)"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"layers": 2}))
    with pytest.raises(ValueError, match=r"config.json: no model_type, d_model or hidden_size; the "
                                         r"config must be"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 64, "n_layer": 2,
                                                      "vocab_size": 100,
                                                      "ssm_cfg": {"layer": "Mamba2",
                                                                  "d_sate": 16}}))
    with pytest.raises(ValueError, match=r"ssm_cfg has fields we do not support: \['d_sate'\]"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h",
                                                      "hidden_size": 64, "vocab_size": 100,
                                                      "hybrid_override_pattern": "M" * 2000}))
    with pytest.raises(ValueError, match="hybrid_override_pattern=.* must be a string of at "
                                         "most 1024 characters"):
        load_config(tmp_path)
    for section, must in (({"n_layer": 10**9}, r"mamba_jax.n_layer=1000000000 must be an "
                                                r"integer in \[1, 1024\]"),
                          ({"mamba2": {"d_sate": 16}}, r"mamba_jax: Mamba2Config.mamba2 has "
                                                       r"no fields \['d_sate'\]"),
                          ([], "mamba_jax=\\[\\] must be a JSON object")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba_jax",
                                                          "mamba_jax": section}))
        with pytest.raises(ValueError, match=must):
            load_config(tmp_path)


def test_a_truncated_safetensors_file_is_named(tmp_path, capsys):
    from mamba_jax.convert import main

    _copy_fixture(tmp_path)
    weights = tmp_path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{weights}: cannot be read .*truncated or corrupt"):
        mamba_jax.from_pretrained(tmp_path)
    with pytest.raises(SystemExit) as refused:
        main([str(tmp_path), str(tmp_path / "out"), "--to", "mamba_ssm"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback


def test_the_hint_for_pytorch_bin_without_torch_loads_weights_only(tmp_path, monkeypatch,
                                                                   capsys):
    shutil.copy(FIXTURES / "hf_ngroups1_tied" / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"torch.load\('pytorch_model.bin', "
                                          r"map_location='cpu', weights_only=True\)"):
        mamba_jax.from_pretrained(tmp_path)
    # the commands say it in one line, status 2 (it was a traceback, status 1)
    from mamba_jax.convert import main as convert
    with pytest.raises(SystemExit) as refused:
        convert([str(tmp_path), str(tmp_path / "out"), "--to", "hf"])
    assert refused.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_a_norm_eps_the_mamba_ssm_layout_cannot_hold_is_refused(tmp_path):
    """mamba_ssm's config has no norm epsilon: a Mamba-3 model (which only that layout of
    the published ones holds) with another one was written, and reloaded with 1e-5
    (logits 0.96 apart). Asked for, it is refused; by default it goes to our own layout,
    which keeps the epsilon."""
    model = Mamba2LM(Mamba2Config.preset("mamba3-tiny", norm_eps=0.5), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"format='mamba_ssm' has no norm epsilon \(its norms "
                                         r"take 1e-05\); this model has norm_eps=0.5"):
        mamba_jax.save_pretrained(model, tmp_path / "m3", format="mamba_ssm")
    assert not (tmp_path / "m3").exists()
    mamba_jax.save_pretrained(model, tmp_path / "m3")
    assert load_config(tmp_path / "m3") == (model.config, "mamba_jax")
