"""Checkpoints from transformers' PyTorch Mamba2ForCausalLM (tests/fixtures, made by
tests/fixtures/make_hf_fixtures.py) give the same logits and greedy tokens here; our
checkpoints round-trip through both layouts."""

import json
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


@pytest.mark.parametrize("fmt", ["hf", "mamba_ssm"])
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
    if fmt == "mamba_ssm":
        assert loaded_cfg == cfg
    keys = load_file(tmp_path / "model.safetensors").keys()
    # HF drops a tied head; mamba_ssm's strict load_state_dict expects it.
    assert ("lm_head.weight" in keys) == (not tie or fmt == "mamba_ssm")
    loaded = mamba_jax.from_pretrained(tmp_path)
    a, b = flat_params(model), flat_params(loaded)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


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
    with pytest.raises(ValueError, match=r"missing 'backbone.layers.1.mixer.A_log' "
                                         r"\(expected shape \(4,\)\)"):
        mamba_jax.from_pretrained(tmp_path)


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    _save_changed_fixture(tmp_path, lambda t: t.update(
        {"backbone.layers.0.mixer.conv1d.weight": np.zeros((96, 1, 3), np.float32)}))
    with pytest.raises(ValueError, match=r"'backbone.layers.0.mixer.conv1d.weight' has shape "
                                         r"\(96, 1, 3\), expected \(96, 1, 4\)"):
        mamba_jax.from_pretrained(tmp_path)


def test_untied_config_without_lm_head_is_an_error(tmp_path):
    _save_changed_fixture(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing 'lm_head.weight'"):
        mamba_jax.from_pretrained(tmp_path)


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
