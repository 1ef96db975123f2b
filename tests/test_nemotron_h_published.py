"""The published Nemotron-H (4B, 8B, 47B, 56B) and Nemotron Nano 2 (9B, 12B) models: their
config.json builds our model at its real shape with the published parameter count, and a
reduced copy of each (every ratio the real model does not derive from hidden_size kept)
gives transformers' NemotronHForCausalLM logits and greedy tokens, and saves a config that
reads back to the same model (tests/fixtures/make_nemotron_h_published.py)."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mamba_jax
from mamba_jax import Mamba2Config
from mamba_jax.convert import load_config
from mamba_jax.formats import config_from_nemotron_h
from mamba_jax.model import Mamba2LM

FIXTURES = Path(__file__).parent / "fixtures" / "nemotron_h_published"
MODELS = json.loads((FIXTURES / "models.json").read_text())["models"]


PRESETS = {"Nemotron-H-4B-Base-8K": "nemotron-h-4b", "Nemotron-H-8B-Base-8K": "nemotron-h-8b",
           "Nemotron-H-47B-Base-8K": "nemotron-h-47b", "Nemotron-H-56B-Base-8K": "nemotron-h-56b",
           "NVIDIA-Nemotron-Nano-9B-v2": "nemotron-nano-9b-v2",
           "NVIDIA-Nemotron-Nano-12B-v2": "nemotron-nano-12b-v2"}


def transformers_parameters(c: dict) -> int:
    """The parameter count of transformers' NemotronHForCausalLM for config.json c, from its
    modules' shapes: per Mamba layer in_proj [2 h p + 2 g n + h, d], conv1d [h p + 2 g n, 1,
    k] and its bias, dt_bias, A_log, D [h], the gated norm [h p], out_proj [d, h p]; per
    attention layer q, o [a e, d], k, v [kv e, d]; per MLP up, down [f, d]; a norm [d] per
    layer; the embedding, final norm and (never tied) lm_head."""
    d, v = c["hidden_size"], c["vocab_size"]
    inner, h = c["mamba_num_heads"] * c["mamba_head_dim"], c["mamba_num_heads"]
    conv = inner + 2 * c["n_groups"] * c["ssm_state_size"]
    mamba = (d * (inner + conv + h) + conv * (c["conv_kernel"] + 1) + 3 * h + inner
             + inner * d)
    attention = 2 * d * c["head_dim"] * (c["num_attention_heads"] + c["num_key_value_heads"])
    mlp = 2 * d * c["intermediate_size"]
    per_kind = {"M": mamba, "*": attention, "-": mlp}
    pattern = c["hybrid_override_pattern"]
    return sum(per_kind[s] + d for s in pattern) + 2 * v * d + d


def published(text: str) -> tuple[float, float]:
    """A model card's size ("8.1B") -> (value, half a unit of its last digit)."""
    digits = text.rstrip("B")
    decimals = len(digits.partition(".")[2])
    return float(digits) * 1e9, 0.5 * 10 ** -decimals * 1e9


@pytest.mark.parametrize("name", MODELS)
def test_published_config_builds_at_its_real_shape_with_the_published_count(name):
    c = MODELS[name]["config"]
    cfg = config_from_nemotron_h(c)
    assert Mamba2Config.preset(PRESETS[name]) == cfg  # the preset of the same name
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == transformers_parameters(c)
    value, precision = published(MODELS[name]["published_params"])
    assert abs(count - value) <= precision, (count, MODELS[name]["published_params"])
    # The widths transformers reads, whatever expand * hidden_size would give.
    assert cfg.layers == c["hybrid_override_pattern"]
    mamba = model.layers[cfg.layers.index("M")].mixer
    assert mamba.x_proj.shape == (c["hidden_size"], c["mamba_num_heads"], c["mamba_head_dim"])
    a = cfg.attention
    assert (a.num_heads, a.num_heads_kv, a.head_dim) == (
        c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    assert cfg.mlp.d_intermediate == c["intermediate_size"]


@pytest.mark.parametrize("name", MODELS)
def test_reduced_copy_gives_the_transformers_logits(name):
    model = mamba_jax.from_pretrained(FIXTURES / name)
    assert model.config.layers == MODELS[name]["reduced"]["hybrid_override_pattern"]
    ids = np.load(FIXTURES / "input_ids.npy")  # [2, 37]
    expected = np.load(FIXTURES / name / "logits.npy")
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))  # one compile
    assert np.abs(logits - expected).max() <= 1e-4 * np.abs(expected).max()


# Greedy decoding of Nano 9B, whose Mamba, attention and MLP widths are none of them
# hidden_size's (each model's decode loop is a compile of its own: CI time); the fixtures
# hold every model's greedy tokens.
@pytest.mark.parametrize("name", ["NVIDIA-Nemotron-Nano-9B-v2"])
def test_reduced_copy_decodes_the_transformers_greedy_tokens(name):
    model = mamba_jax.from_pretrained(FIXTURES / name)
    greedy = np.load(FIXTURES / name / "greedy.npy")  # 10 prompt + 12 new tokens
    out = mamba_jax.generate(model, jnp.asarray(greedy[:, :10]), max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(out), greedy)


SHAPE_FIELDS = ("hidden_size", "vocab_size", "layers_block_type", "mamba_num_heads",
                "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "mlp_hidden_act", "mamba_hidden_act", "use_bias", "use_conv_bias",
                "mlp_bias", "layer_norm_epsilon", "time_step_min", "tie_word_embeddings")


@pytest.mark.parametrize("name", ["NVIDIA-Nemotron-Nano-9B-v2"])
def test_save_pretrained_writes_the_fixture_config_back(tmp_path, name):
    """What we write reads back through our loader to the same config, with the shape
    fields of the config transformers wrote (transformers reading our files is checked by
    make_nemotron_h_published.py --check-ours)."""
    model = mamba_jax.from_pretrained(FIXTURES / name)
    mamba_jax.save_pretrained(model, tmp_path, format="hf")
    cfg, fmt = load_config(tmp_path)
    assert fmt == "nemotron_h" and cfg == load_config(FIXTURES / name)[0] == model.config
    ours = json.loads((tmp_path / "config.json").read_text())
    theirs = json.loads((FIXTURES / name / "config.json").read_text())
    assert {f: ours[f] for f in SHAPE_FIELDS} == {f: theirs[f] for f in SHAPE_FIELDS}
