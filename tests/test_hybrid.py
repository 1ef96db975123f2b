"""Hybrid models: the layer pattern, the attention layer (rotary, cache), generation, and
checkpoints of the PyTorch implementations (tests/fixtures, made by
tests/fixtures/make_hybrid_fixtures.py: transformers' NemotronHForCausalLM and mamba_ssm's
MambaLMHeadModel with attention and MLP blocks)."""

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.layers.attention import rotary
from mamba_jax.convert import flat_params, load_config

FIXTURES = Path(__file__).parent / "fixtures"


def hybrid_config(**changes):
    base = dict(layer_pattern="M*-M-*", d_model=32, vocab_size=100, d_state=8, headdim=16,
                chunk_size=8, d_intermediate=48, attn_num_heads=4, attn_num_heads_kv=2,
                attn_head_dim=8, attn_rotary_emb_dim=4)
    merged = {**base, **changes}
    return Mamba2Config(n_layer=len(merged["layer_pattern"]), **merged)


# ------------------------------------------------------------------ the layer pattern


def test_layer_pattern_gives_one_layer_per_symbol_named_as_megatron():
    model = Mamba2LM(hybrid_config(layer_pattern="M*-M-"), rngs=nnx.Rngs(0))
    assert [layer.mixer.name for layer in model.layers] == ["mamba2", "attention", "mlp",
                                                            "mamba2", "mlp"]
    names = set(flat_params(model))
    assert {"layers.0.mixer.A_log", "layers.1.mixer.q_proj", "layers.2.mixer.gate_proj",
            "layers.4.norm.weight"} <= names
    assert Mamba2Config(n_layer=3).layers == "MMM"  # the default: all Mamba


def test_each_layer_is_drawn_from_its_own_key_and_each_kind_is_built_once(monkeypatch):
    """init_layers draws each kind's layers together (vmapped): layer i equals the Block
    built alone from fold_in(key, i), layers of one kind differ, and a jitted init of the
    whole model builds (traces, so compiles) one Block per kind, not one per layer."""
    import jax
    from mamba_jax import model as model_module

    cfg = hybrid_config(layer_pattern="M*-M-*M")
    key = jax.random.key(7)
    layers = model_module.init_layers(cfg, key, jnp.float32)
    for i, symbol in enumerate(cfg.layers):
        rngs = nnx.Rngs(params=jax.random.fold_in(key, i))
        alone = model_module.Block(cfg, symbol, rngs=rngs)
        assert layers[i].mixer.name == alone.mixer.name
        jax.tree.map(np.testing.assert_array_equal, nnx.state(layers[i]), nnx.state(alone))
    assert not np.array_equal(layers[0].mixer.x_proj[...], layers[3].mixer.x_proj[...])

    built = []
    block_init = model_module.Block.__init__
    monkeypatch.setattr(model_module.Block, "__init__",
                        lambda self, c, symbol, **k: built.append(symbol)
                        or block_init(self, c, symbol, **k))
    jax.jit(lambda: nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))[1]).lower()
    assert sorted(built) == sorted("M*-")


def test_mamba_ssm_form_spells_out_blocks_of_mixer_then_mlp():
    cfg = Mamba2Config(n_layer=3, attn_layer_idx=[1], d_intermediate=64)
    assert cfg.layers == "M-*-M-"
    assert Mamba2Config(n_layer=3, attn_layer_idx=(0, 2)).layers == "*M*"


def test_mlp_layers_without_a_width_get_the_default_one():
    # mamba_ssm's GatedMLP's for SwiGLU (8/3 d_model up to a multiple of 128), Megatron's 4
    # d_model for the ungated; the width a config states is its own, and mamba_ssm's form
    # without one has no MLP layers
    pattern = dict(n_layer=2, layer_pattern="M-")
    assert Mamba2Config(d_model=160, **pattern).mlp.d_intermediate == 512  # 426 -> 512
    assert Mamba2Config(d_model=160, **pattern, mlp_activation="relu2").mlp.d_intermediate \
        == 640
    assert Mamba2Config(d_model=160, **pattern, d_intermediate=96).mlp.d_intermediate == 96
    assert Mamba2Config(d_model=160, n_layer=2, hybrid_mlp_ratio=0.5).mlp.d_intermediate == 512
    cfg = Mamba2Config(d_model=160, n_layer=2, attn_layer_idx=[1])
    assert cfg.layers == "M*" and cfg.mlp.d_intermediate == 0


@pytest.mark.parametrize("changes,match", [
    (dict(layer_pattern="M-E*"), r"unknown symbol 'E' at position 2\n    M-E\*\n      \^"),
    (dict(layer_pattern="M*", n_layer=3), r"'M\*' has 2 layers but n_layer=3; set n_layer=2 "
                                          r"\(.*\), or a layer_pattern of 3 symbols \(the "
                                          r"trainer's --hybrid-override-pattern\)"),
    (dict(layer_pattern="M-", n_layer=2, d_intermediate=-8),
     r"mlp.d_intermediate=-8 must be > 0 \(the MLP width; 0 for the default, 128 here\)"),
    (dict(layer_pattern="M*", n_layer=2, attn_layer_idx=[1]), "not both"),
    (dict(layer_pattern="*", n_layer=1, attn_num_heads_kv=3),
     r"attention.num_heads_kv=3 does not divide attention.num_heads=4"),
    (dict(layer_pattern="*", n_layer=1, attn_rotary_emb_dim=5), "attention.rotary_emb_dim=5"),
    (dict(layer_pattern="*", n_layer=1, attn_rotary_emb_dim=4, attn_rotary_emb_base=0.0),
     r"attention.rotary_emb_base=0.0 must be a number above 1"),
    (dict(layer_pattern="*", n_layer=1, attn_rotary_emb_dim=4, attn_rotary_emb_base=-1e4),
     r"attention.rotary_emb_base=-10000.0 must be a number above 1"),
    (dict(layer_pattern="-", n_layer=1, mlp_activation="silu"), "mlp.activation='silu'"),
])
def test_bad_layer_settings_name_the_value_and_the_fix(changes, match):
    with pytest.raises(ValueError, match=match):
        Mamba2Config(**{**dict(d_model=32, headdim=16, d_intermediate=48, attn_num_heads=4,
                               attn_num_heads_kv=2, attn_head_dim=8), **changes})


# ------------------------------------------------------------------ attention


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_a_float64_numpy_reference(interleaved):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 3, 8)).astype(np.float32)
    positions = rng.integers(0, 50, (2, 7))
    dim, base = 6, 500.0
    got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(positions), dim, base, interleaved))
    want = x.astype(np.float64).copy()
    for i in range(dim // 2):  # pair i rotates by position * base**(-2i/dim)
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + dim // 2)
        angle = positions[..., None] * base ** (-2.0 * i / dim)
        xa, xb = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
        want[..., a] = xa * np.cos(angle) - xb * np.sin(angle)
        want[..., b] = xb * np.cos(angle) + xa * np.sin(angle)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(got[..., dim:], x[..., dim:])  # the rest is untouched


def test_packed_documents_attend_and_rotate_as_if_alone():
    cfg = hybrid_config(layer_pattern="*-*")
    model = Mamba2LM(cfg, rngs=nnx.Rngs(1))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 100, (1, 12)))
    seq_idx = jnp.asarray([[0] * 5 + [1] * 7])
    packed = model(ids, seq_idx)
    np.testing.assert_allclose(packed[:, :5], model(ids[:, :5]), atol=1e-5)
    np.testing.assert_allclose(packed[:, 5:], model(ids[:, 5:]), atol=1e-5)


# ------------------------------------------------------------------ generation


@pytest.fixture(scope="module")
def model():
    return Mamba2LM(hybrid_config(attn_qkv_bias=True, attn_out_bias=True), rngs=nnx.Rngs(2))


def test_step_by_step_logits_equal_the_full_forward(model):
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 100, (2, 14)))
    full = nnx.jit(lambda model, ids: model(ids))(model, ids)  # one compile, not one an op
    logits, cache = nnx.jit(lambda model, ids: model.prefill(ids, cache_len=14))(model,
                                                                                ids[:, :5])
    steps = [logits[:, -1]]
    step = nnx.jit(lambda model, token, cache: model.step(token, cache))  # one compile
    for t in range(5, 13):
        logits, cache = step(model, ids[:, t], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.stack(steps, 1), full[:, 4:13], rtol=0, atol=1e-5)
    assert int(cache[1].length) == 13  # the attention layer's KV cache holds every token


def test_a_cache_with_no_slot_for_the_next_token_is_named(model):
    # The step's write landed on the last slot, overwriting a key: wrong logits, silently
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 100, (2, 5)))
    _, cache = model.prefill(ids)  # the default: the prompt's 5 slots, none to come
    with pytest.raises(ValueError, match=r"step: the attention cache is full \(5 slots\); "
                                         r"prefill with cache_len = the prompt's tokens"):
        model.step(ids[:, 0], cache)
    with pytest.raises(ValueError, match=r"prefill: cache_len=4 slots cannot hold the "
                                         r"prompt's 5 tokens"):
        model.prefill(ids, cache_len=4)
    # Tokens of another shape, a cache of other rows or of another model's layers: a
    # concatenation's, an index's or an attribute's error inside
    _, cache = model.prefill(ids, cache_len=8)
    mamba_only = Mamba2LM(Mamba2Config.preset("tiny", n_layer=model.config.n_layer),
                          rngs=nnx.Rngs(0))
    other = Mamba2LM(hybrid_config(d_state=16), rngs=nnx.Rngs(0))
    for call, match in [(lambda: model.step(ids[:, :1], cache), r"token_ids of shape \(2, 1\)"),
                        (lambda: model.step(ids[:1, 0], cache), "the cache must be this "
                                                                "model's, for 1 rows"),
                        (lambda: model.step(ids[:, 0], mamba_only.prefill(ids)[1]),
                         "the cache must be this model's, for 2 rows"),
                        # of the same layer kinds, another model's shapes (it failed in a
                        # concatenation)
                        (lambda: model.step(ids[:, 0], other.init_cache(2, 8)),
                         r"the cache of layer 0 holds arrays of shapes \[\(96, 4\), \(4, 16, "
                         r"16\)\] a row, where this model's takes \[\(80, 4\), \(4, 16, 8\)\]")]:
        with pytest.raises(ValueError, match=f"step: {match}"):
            call()


def test_hybrid_greedy_generation_equals_repeated_argmax_and_left_padding(model):
    prompt = jnp.asarray(np.random.default_rng(4).integers(0, 100, (2, 6)))
    out = mamba_jax.generate(model, prompt, max_new_tokens=7)
    np.testing.assert_array_equal(jnp.argmax(model(out[:, :-1])[:, 5:, :100], axis=-1),
                                  out[:, 6:])
    # A left-padded row generates exactly what it generates alone.
    padded = jnp.concatenate([jnp.full((1, 3), 7, jnp.int32), prompt[1:, 2:]], axis=1)
    row = mamba_jax.generate(model, padded, max_new_tokens=7, prompt_lengths=[4])
    alone = mamba_jax.generate(model, prompt[1:, 2:], max_new_tokens=7)
    np.testing.assert_array_equal(row[:, 7:], alone[:, 4:])


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("case,layers", [("nemotron_h_hybrid", "M-*-M*"),
                                         ("mamba_ssm_hybrid", "M-*-M-")])
def test_hybrid_logits_match_pytorch_within_1e4_relative(case, layers):
    model = mamba_jax.from_pretrained(FIXTURES / case)
    assert model.config.layers == layers
    ids = np.load(FIXTURES / case / "input_ids.npy")  # [2, 37]
    expected = np.load(FIXTURES / case / "logits.npy")
    logits = np.asarray(model(jnp.asarray(ids)))[..., :expected.shape[-1]]
    assert np.linalg.norm(logits - expected) / np.linalg.norm(expected) < 1e-4
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4


def test_nemotron_h_greedy_generation_gives_the_transformers_tokens():
    model = mamba_jax.from_pretrained(FIXTURES / "nemotron_h_hybrid")
    expected = np.load(FIXTURES / "nemotron_h_hybrid" / "greedy.npy")  # 10 prompt + 12 new
    out = mamba_jax.generate(model, jnp.asarray(expected[:, :10]), max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("case,fmt", [("nemotron_h_hybrid", "nemotron_h"),
                                      ("nemotron_h_hybrid", "hf"),
                                      ("mamba_ssm_hybrid", "mamba_ssm")])
def test_hybrid_checkpoints_round_trip_their_tensors_and_config(tmp_path, case, fmt):
    model = mamba_jax.from_pretrained(FIXTURES / case)
    mamba_jax.save_pretrained(model, tmp_path, format=fmt)
    cfg, detected = load_config(tmp_path)
    assert detected == ("nemotron_h" if fmt == "hf" else fmt)
    assert cfg == model.config
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(
        FIXTURES / case / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_megatron_pattern_round_trips_through_mamba_ssm_blocks(tmp_path):
    cfg = hybrid_config(layer_pattern="M-*-", d_intermediate=128,
                        attn_qkv_bias=True)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(5))
    mamba_jax.save_pretrained(model, tmp_path, format="mamba_ssm")
    loaded = mamba_jax.from_pretrained(tmp_path)
    assert loaded.config.layers == "M-*-" and loaded.config.attn_layer_idx == (1,)
    a, b = flat_params(model), flat_params(loaded)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("fmt,changes,match", [
    ("mamba_ssm", dict(layer_pattern="M--*"), "not mamba_ssm Blocks"),
    ("mamba_ssm", dict(layer_pattern="M-"), r"multiple of 128;.* mlp.d_intermediate=48"),
    ("nemotron_h", dict(layer_pattern="M*"), r"attention.rotary_emb_dim=4"),
    ("nemotron_h", dict(layer_pattern="M-"), r"mlp.activation='swiglu' .* dt_limit="),
    ("mamba_ssm", dict(layer_pattern="M-", d_intermediate=128, mlp_activation="gelu"),
     r"GatedMLP is SwiGLU .* mlp.activation='gelu'"),
])
def test_a_layout_that_cannot_express_the_model_says_what_does_not_fit(tmp_path, fmt, changes,
                                                                        match):
    model = nnx.eval_shape(lambda: Mamba2LM(hybrid_config(**changes), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=match):
        mamba_jax.save_pretrained(model, tmp_path, format=fmt)
    assert not (tmp_path / "config.json").exists()


def test_a_hybrid_only_mamba_ssm_can_hold_is_written_in_its_layout(tmp_path):
    """The "hf" default (the trainer's --out, convert's --to hf) of a hybrid NemotronH
    cannot express (SwiGLU MLPs, rotary attention, dt unclamped: mamba_ssm's own hybrids)
    writes mamba_ssm's MambaLMHeadModel, which holds it, and loads back the same."""
    from mamba_jax.convert import check_exportable, load_config
    cfg = hybrid_config(layer_pattern="M-*-", d_intermediate=128)
    assert check_exportable(cfg) == "mamba_ssm"
    assert check_exportable(hybrid_config(layer_pattern="M-*-", d_intermediate=128,
                                          mlp_activation="relu2", attn_rotary_emb_dim=0,
                                          dt_limit=(0.001, math.inf))) == "nemotron_h"
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    mamba_jax.save_pretrained(model, tmp_path)
    loaded, fmt = load_config(tmp_path)
    assert fmt == "mamba_ssm" and loaded.layers == "M-*-"
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (1, 9)))
    np.testing.assert_array_equal(mamba_jax.from_pretrained(tmp_path)(ids), model(ids))


def test_a_hybrid_no_published_layout_holds_is_written_in_our_own_and_reads_back(tmp_path):
    """Neither NemotronH (SwiGLU) nor mamba_ssm's blocks (an MLP after an MLP) hold it: "hf"
    writes our own layout (the whole config, our parameters by name), which from_pretrained
    reads back exactly, and says why in one line; asked for by name, a published layout
    refuses it, naming ours (its refusal listed every layout's reasons, some 700
    characters)."""
    from mamba_jax.convert import check_exportable, export_notes, load_config
    cfg = hybrid_config(layer_pattern="M--", d_intermediate=128)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    for fmt in ("mamba_ssm", "nemotron_h"):
        with pytest.raises(ValueError) as refused:
            mamba_jax.save_pretrained(model, tmp_path, format=fmt)
        assert str(refused.value).endswith("; no published layout holds it: "
                                           "format='mamba_jax' (ours, which transformers does "
                                           "not read) does")
    assert not (tmp_path / "config.json").exists()
    assert check_exportable(cfg) == "mamba_jax"
    [note] = export_notes(cfg, "mamba_jax")
    assert note.startswith("in mamba_jax's own layout, which from_pretrained, generate, serve "
                           "and convert read and transformers does not: no published layout "
                           "holds the model (format='nemotron_h' cannot express "
                           "mlp.activation='swiglu'")
    mamba_jax.save_pretrained(model, tmp_path)
    assert load_config(tmp_path) == (cfg, "mamba_jax")
    written = json.loads((tmp_path / "config.json").read_text())  # strict JSON: no Infinity
    assert written["mamba_jax"]["mamba2"]["dt_limit"] == [0.0, {"__float__": "Infinity"}]
    saved, read = flat_params(model), flat_params(mamba_jax.from_pretrained(tmp_path))
    assert saved.keys() == read.keys()
    for name in saved:
        np.testing.assert_array_equal(read[name], saved[name], err_msg=name)


def test_layouts_refuse_the_layer_kinds_they_have_no_place_for(tmp_path):
    """Mamba-3 layers: NemotronH (Mamba2, attention, MLP) and transformers' Mamba classes
    have no place for them (NemotronH's writer failed on the layer symbol, a KeyError,
    where the rest of the config fit); mamba_ssm's layout holds them."""
    # (replace takes a section no layer reads: NemotronH's writer reads mamba2's dt_limit)
    cfg = Mamba2Config.preset("mamba3-tiny").replace(**{"mamba2.dt_limit": (0.001, math.inf)})
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"format='nemotron_h' holds Mamba2 \(M\), attention "
                                         r"\(\*\) and MLP \(-\) layers, not layers '33'; "
                                         r"use format='mamba_ssm'"):
        mamba_jax.save_pretrained(model, tmp_path, format="nemotron_h")
    from mamba_jax.convert import check_exportable
    from mamba_jax.formats import config_dict
    with pytest.raises(ValueError, match=r"format='hf': .* not layers '33'"):
        config_dict(cfg, "hf")
    assert check_exportable(cfg) == "mamba_ssm"
    assert not (tmp_path / "config.json").exists()


# ------------------------------------------------------------------ MLP activations


def megatron_gelu(x, tanh: bool):
    """Megatron-LM's GeLUs in float64: erf_gelu (torch's F.gelu, its default) and
    openai_gelu (--openai-gelu), written from megatron/core/transformer/utils.py."""
    if tanh:
        return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_mlp_matches_megatrons_gelu_in_float64(activation):
    cfg = hybrid_config(layer_pattern="-", mlp_activation=activation)
    mlp = Mamba2LM(cfg, rngs=nnx.Rngs(1)).layers[0].mixer
    u = np.random.default_rng(0).normal(size=(2, 5, 32)).astype(np.float32) * 3
    out, _ = mlp(jnp.asarray(u))
    up, down = (np.asarray(p[...], np.float64) for p in (mlp.up_proj, mlp.down_proj))
    want = megatron_gelu(u.astype(np.float64) @ up, activation == "gelu_tanh") @ down
    # float32 matmuls over d=32 and f=48 against float64: a few ulps of |want| ~ 1.
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    # The two differ by up to ~1e-3 near |x| ~ 2: the test tells them apart.
    assert np.abs(megatron_gelu(u.astype(np.float64) @ up, activation != "gelu_tanh")
                  @ down - want).max() > 1e-5
    step, _ = mlp.step(jnp.asarray(u[:, 0]), None, mlp.step_weights())
    np.testing.assert_allclose(np.asarray(step), want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation,hf_name", [("gelu", "gelu"),
                                                ("gelu_tanh", "gelu_pytorch_tanh")])
def test_gelu_hybrid_exports_as_nemotron_h_and_decodes_with_the_fused_kernels(
        tmp_path, activation, hf_name):
    from mamba_jax.generate.plan import decode_plan

    cfg = hybrid_config(layer_pattern="M-", attn_rotary_emb_dim=0, dt_limit=(0.001, math.inf),
                        mlp_activation=activation)
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    mamba_jax.save_pretrained(Mamba2LM(cfg, rngs=nnx.Rngs(0)), tmp_path, format="nemotron_h")
    assert json.loads((tmp_path / "config.json").read_text())["mlp_hidden_act"] == hf_name
    loaded, fmt = load_config(tmp_path)
    assert fmt == "nemotron_h" and loaded.mlp == cfg.mlp and loaded.layers == "M-"
    assert decode_plan(model, 1, "triton").steps == ("fused", "fused")
