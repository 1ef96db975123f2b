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
from mamba_jax.checkpoint import Checkpointer
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


def test_fields_are_read_as_transformers_reads_them():
    """Against NemotronHConfig and NemotronHForCausalLM (configuration_nemotron_h.py,
    modeling_nemotron_h.py): absent head_dim is 128 and absent num_key_value_heads 8 (not
    hidden_size / heads, nor one per head), null num_key_value_heads is one per head; the
    legacy mamba_* spelling wins over the new one; expand, time_step_limit,
    residual_in_fp32, tie_word_embeddings and num_nextn_predict_layers change nothing."""
    base = {**MODELS["NVIDIA-Nemotron-Nano-9B-v2"]["config"]}
    del base["head_dim"], base["num_key_value_heads"]
    cfg = config_from_nemotron_h(base)
    assert (cfg.attention.head_dim, cfg.attention.num_heads_kv) == (128, 8)
    assert config_from_nemotron_h({**base, "num_key_value_heads": None}).attention == (
        cfg.attention.__class__(num_heads=40, num_heads_kv=40, head_dim=128))
    legacy = config_from_nemotron_h({**base, "mamba_n_groups": 4, "mamba_chunk_size": 64})
    assert (legacy.mamba2.ngroups, legacy.mamba2.chunk_size) == (4, 64)
    ignored = config_from_nemotron_h({
        **base, "expand": 3, "time_step_limit": [0.0, 0.5], "residual_in_fp32": True,
        "tie_word_embeddings": True, "num_nextn_predict_layers": 1, "attention_bias": True})
    assert ignored.replace(expand=2) == cfg
    assert mamba_jax.layers.mamba2.dims(ignored).d_inner == 128 * 80
    assert cfg.mamba2.dt_limit == (0.001, math.inf) and not cfg.residual_in_fp32
    assert not cfg.tie_embeddings


def test_an_export_with_the_residual_in_float32_says_nemotron_h_does_not_keep_it(
        tmp_path, capsys):
    from mamba_jax.convert import main
    from mamba_jax.formats import layout_notes
    name = "Nemotron-H-4B-Base-8K"
    cfg = load_config(FIXTURES / name)[0]
    assert layout_notes(cfg, "nemotron_h") == []  # as read: the residual in compute dtype
    kept = cfg.replace(residual_in_fp32=True)
    assert layout_notes(kept, "mamba_ssm") == []
    ckpt = Checkpointer(tmp_path / "src", async_save=False)  # a trainer's: it keeps the field
    ckpt.save(1, {"params": nnx.state(Mamba2LM(kept, rngs=nnx.Rngs(0)))},
              {"step": 1, "config": {"model": kept.to_dict(), "train": {}}})
    ckpt.close()
    capsys.readouterr()
    main([str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "nemotron_h"])
    assert capsys.readouterr().out.splitlines()[1] == (
        "note: NemotronH keeps the residual in the compute dtype (transformers, and a reload "
        "here, do not read residual_in_fp32): its bf16 logits differ slightly from this "
        "model's, float32 ones do not")
    assert not mamba_jax.from_pretrained(tmp_path / "dst").config.residual_in_fp32


def test_mtp_tensors_are_skipped_and_a_tied_model_writes_its_head(tmp_path):
    from mamba_jax.convert import model_from_params, torch_to_params
    from mamba_jax.tensors import open_tensors
    name = "Nemotron-H-4B-Base-8K"
    cfg = load_config(FIXTURES / name)[0]
    tensors = dict(open_tensors(FIXTURES / name))
    extra = {**tensors, "mtp.layers.0.mixer.q_proj.weight": np.zeros((4, 4), np.float32)}
    params = torch_to_params(tensors, cfg, "nemotron_h")
    assert torch_to_params(extra, cfg, "nemotron_h").keys() == params.keys()
    # NemotronHForCausalLM never ties: a tied model's head is written as lm_head.weight.
    del params["lm_head"]
    tied = model_from_params(cfg.replace(tie_embeddings=True), params)
    mamba_jax.save_pretrained(tied, tmp_path, format="nemotron_h")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["tie_word_embeddings"] is False
    loaded = mamba_jax.from_pretrained(tmp_path)
    assert not loaded.config.tie_embeddings
    np.testing.assert_array_equal(loaded.lm_head[...], tied.embedding[...])


@pytest.mark.parametrize("dt_limit,hint,written", [
    ((0.001, float("inf")), "use format='nemotron_h'", "nemotron_h"),
    # NemotronH clamps dt too: no published layout holds this one, our own does
    ((0.0, float("inf")), "no published layout holds it: format='mamba_jax'", "mamba_jax")])
def test_layouts_that_derive_the_mamba_width_refuse_an_independent_one(tmp_path, dt_limit,
                                                                        hint, written):
    from mamba_jax.convert import check_exportable
    cfg = Mamba2Config(d_model=32, n_layer=1, vocab_size=64, mamba2=dict(
        d_state=16, headdim=16, nheads=6, dt_limit=dt_limit))  # 96 wide, not 2 * 32
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"nheads \* headdim = 6 \* 16 = 96; " + hint):
        mamba_jax.save_pretrained(model, tmp_path, format="mamba_ssm")
    assert check_exportable(cfg) == written  # "hf": the first layout that holds it
