"""Mamba-1: checkpoints from transformers' PyTorch MambaForCausalLM and
FalconMambaForCausalLM and mamba_ssm's MambaLMHeadModel layout (tests/fixtures, made by
tests/fixtures/make_mamba1_fixtures.py) give the same logits and greedy tokens here, and
round-trip through save_pretrained; the presets' shapes and the CPU training path.
(The layer's mesh, checkpoint-key and decoding cases are tests/test_layer_kinds.py's, the
scan's tests/test_selective_scan.py's.)"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import mamba_jax
from mamba_jax import Mamba2Config
from mamba_jax.convert import flat_params, load_config, param_shapes
from mamba_jax.layers.mamba1 import Mamba1Mixer

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {"mamba1_tied": "hf", "mamba1_falcon_untied": "hf", "mamba1_mamba_ssm": "mamba_ssm"}


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request):
    return request.param, mamba_jax.from_pretrained(FIXTURES / request.param)


def test_logits_and_greedy_tokens_match_pytorch(loaded):
    # float32 logits within 1e-4 relative (HF's associative scan and our XLA one sum in
    # other orders); greedy tokens identical (mamba_ssm's fixture has no greedy.npy: the
    # model is mamba1_tied's).
    case, model = loaded
    ids = np.load(FIXTURES / case / "input_ids.npy")  # [2, 37]
    expected = np.load(FIXTURES / case / "logits.npy")
    logits = np.asarray(model(jnp.asarray(ids)))
    assert logits.shape == expected.shape
    assert np.linalg.norm(logits - expected) / np.linalg.norm(expected) < 1e-4
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4
    if (FIXTURES / case / "greedy.npy").exists():
        greedy = np.load(FIXTURES / case / "greedy.npy")  # 10 prompt + 12 new tokens
        out = mamba_jax.generate(model, jnp.asarray(greedy[:, :10]), max_new_tokens=12)
        np.testing.assert_array_equal(np.asarray(out), greedy)


def test_the_config_reads_as_its_model(loaded):
    case, model = loaded
    cfg, fmt = load_config(FIXTURES / case)
    assert fmt == CASES[case]
    assert cfg.layers == "11"
    assert cfg.mamba1.bc_dt_rms == (case == "mamba1_falcon_untied")
    assert cfg.mamba1.d_state == 8 and cfg.padded_vocab_size == 100


@pytest.mark.parametrize("fmt", ["hf", "mamba_ssm"])
def test_save_then_load_round_trips(tmp_path, loaded, fmt):
    case, model = loaded
    if fmt == "mamba_ssm" and model.config.mamba1.bc_dt_rms:
        with pytest.raises(ValueError, match="bc_dt_rms"):
            mamba_jax.save_pretrained(model, tmp_path, format=fmt)
        return
    mamba_jax.save_pretrained(model, tmp_path, format=fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    if fmt == "hf":
        assert config["model_type"] == ("falcon_mamba" if model.config.mamba1.bc_dt_rms
                                        else "mamba")
    else:
        assert config["ssm_cfg"]["layer"] == "Mamba1"
    # The file holds the tensors (and names) of the source checkpoint's layout.
    if CASES[case] == fmt:
        assert set(load_file(tmp_path / "model.safetensors")) == set(
            load_file(FIXTURES / case / "model.safetensors"))
    again = mamba_jax.from_pretrained(tmp_path)
    assert again.config == model.config
    a, b = flat_params(model), flat_params(again)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_mamba_ssm_hybrid_config_reads_its_blocks(tmp_path):
    d = {"d_model": 64, "n_layer": 3, "vocab_size": 100, "d_intermediate": 100,
         "ssm_cfg": {"dt_rank": 8}, "attn_layer_idx": [1],
         "attn_cfg": {"num_heads": 4, "causal": True}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg, fmt = load_config(tmp_path)  # ssm_cfg.layer defaults to Mamba1, as in mamba_ssm
    assert (fmt, cfg.layers, cfg.mamba1.dt_rank) == ("mamba_ssm", "1-*-1-", 8)
    assert cfg.mlp.d_intermediate == 128  # GatedMLP's rounding up to 128


def test_presets_have_the_published_shapes():
    # state-spaces/mamba-*: (d_model, n_layer), and for the smallest and largest the
    # parameter count of mamba_ssm's modules from their constructor's shapes (tied
    # embedding of 50277 padded to 50280).
    published = {"mamba-130m": (768, 24), "mamba-370m": (1024, 48), "mamba-790m": (1536, 48),
                 "mamba-1.4b": (2048, 48), "mamba-2.8b": (2560, 64)}
    for name, (d, n_layer) in published.items():
        cfg = Mamba2Config.preset(name)
        assert (cfg.d_model, cfg.n_layer, set(cfg.layers)) == (d, n_layer, {"1"})
        if name not in ("mamba-130m", "mamba-2.8b"):
            continue
        i, r, n, k = 2 * d, -(-d // 16), 16, 4
        layer = (d * 2 * i + i * k + i + i * (r + 2 * n) + r * i + i + i * n + i + i * d
                 + d)  # in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj, norm
        expected = 50280 * d + n_layer * layer + d
        assert sum(np.prod(s) for s in param_shapes(cfg).values()) == expected, name


def test_init_is_mamba_ssms():
    # mamba_ssm's Mamba: S4D-real A, softplus(dt_proj.bias) log-uniform in [dt_min, dt_max],
    # dt_proj U(+-dt_scale / sqrt(dt_rank)), D ones, out_proj's bound over sqrt(n_layer).
    cfg = Mamba2Config.preset("tiny-mamba1")  # d_model 128: d_inner 256, dt_rank 8
    mixer = Mamba1Mixer(cfg, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.exp(mixer.A_log[...]), np.tile(np.arange(1, 17), (256, 1)),
                               rtol=1e-6)
    dt = np.log1p(np.exp(np.asarray(mixer.dt_proj_bias[...])))
    assert 0.001 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5)
    assert np.log(dt).std() > 0.5  # spread over the log range, not at one value
    w = np.asarray(mixer.dt_proj[...])
    assert w.shape == (8, 256) and np.abs(w).max() <= 8 ** -0.5 and w.std() > 0.1
    np.testing.assert_array_equal(mixer.D[...], np.ones(256))
    assert np.abs(mixer.out_proj[...]).max() <= 1 / np.sqrt(256) / np.sqrt(2)
    assert np.abs(mixer.in_proj_x[...]).max() <= 1 / np.sqrt(128)


def test_the_published_mamba_ssm_config_reads_as_the_preset(tmp_path):
    # state-spaces/mamba-130m's config.json as published (no ssm_cfg.layer: Mamba1).
    (tmp_path / "config.json").write_text(json.dumps(
        {"d_model": 768, "n_layer": 24, "vocab_size": 50277, "ssm_cfg": {}, "rms_norm": True,
         "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8}))
    cfg, fmt = load_config(tmp_path)
    assert fmt == "mamba_ssm" and cfg == Mamba2Config.preset("mamba-130m")
