import dataclasses
import json
import math
import tomllib
from pathlib import Path

import jax
import pytest
from flax import nnx

from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.config import PRESETS, hybrid_pattern


def test_config_is_frozen_and_hashable():
    cfg = Mamba2Config.preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3
    assert hash(cfg) == hash(Mamba2Config.preset("tiny"))


@pytest.mark.parametrize("field,value", [("d_model", 0), ("n_layer", -1), ("mamba2.d_state", 0),
                                         ("mamba2.headdim", 0), ("mamba2.chunk_size", 0),
                                         ("mamba2.ngroups", 0)])
def test_non_positive_size_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Mamba2Config.{field}={value}"):
        Mamba2Config.preset("tiny", **{field: value})


@pytest.mark.parametrize("field,value,match", [
    ("tie_embeddings", "no", r"tie_embeddings='no' must be true or false"),
    ("mamba2.conv_bias", "false", r"mamba2.conv_bias='false' must be true or false"),
    ("mamba2.d_state", 16.0, r"mamba2.d_state=16.0 must be an integer"),
    ("mamba2.nheads", "4", r"mamba2.nheads='4' must be an integer or null"),
    ("norm_eps", "1e-5", r"norm_eps='1e-5' must be a number"),
    ("mamba3.is_mimo", 1, r"mamba3.is_mimo=1 must be true or false"),
    ("mlp.activation", None, r"mlp.activation=None must be a string"),
    ("attn_layer_idx", "1,2", r"attn_layer_idx='1,2' must be a list of block indices"),
    ("attn_layer_idx", [1.5], r"attn_layer_idx=\[1.5\] must be a list of block indices"),
    ("attn_layer_idx", [True], r"attn_layer_idx=\[True\] must be a list"),
    # infinite dt bounds, eps or scale passed the range checks and gave NaN logits
    ("mamba2.dt_max", math.inf, r"mamba2.dt_max=inf must be a finite number"),
    ("mamba2.dt_init_floor", math.inf, r"mamba2.dt_init_floor=inf must be a finite number"),
    ("norm_eps", math.inf, r"norm_eps=inf must be a finite number"),
    ("mamba1.dt_scale", math.inf, r"mamba1.dt_scale=inf must be a finite number"),
    ("mamba3.dt_max", math.nan, r"mamba3.dt_max=nan must be a finite number"),
    ("mamba2.A_init_range", (1.0, math.inf), r"mamba2.A_init_range=\(1.0, inf\) must be "
                                             r"\(lo, hi\) with 0 < lo <= hi < inf"),
    # past float32's range, in which the parameters are made: inf, NaN logits or zeros
    ("norm_eps", 1e39, r"norm_eps=1e\+39 must be a finite number within float32's range"),
    ("mamba3.A_floor", 1e39, r"mamba3.A_floor=1e\+39 must be a finite number within"),
    ("mamba2.A_init_range", (1, 1e300), r"mamba2.A_init_range=\(1, 1e\+300\) lies beyond "
                                        r"float32's range"),
    ("mamba2.dt_limit", (1e39, math.inf), r"mamba2.dt_limit=\(1e\+39, inf\) lies beyond"),
    # a string of two characters was read as two numbers ("18": (1.0, 8.0)), others failed
    # in float() or iter() without the field's name
    ("mamba2.A_init_range", "18", r"mamba2.A_init_range='18' must be two numbers, "
                                  r"\[low, high\]"),
    ("mamba2.dt_limit", 5, r"mamba2.dt_limit=5 must be two numbers")])
def test_a_value_of_another_type_than_its_field_is_named(field, value, match):
    # A hand-edited config.json's "false" was a true boolean, and "4" heads a string.
    with pytest.raises(ValueError, match=rf"Mamba2Config.{match}"):
        Mamba2Config.preset("tiny", **{field: value})
    assert Mamba2Config.preset("mamba3-tiny", **{"mamba3.rope_fraction": 1}).mamba3 \
        .rope_fraction == 1  # an integer where a number is asked


def test_one_models_configs_are_equal_spelt_out_however_its_layers_are_given():
    # A resume compares them so: the pattern an export reports resumes a ratio-made run.
    mlp = {"mlp.d_intermediate": 128}
    ratios = Mamba2Config.preset("tiny", n_layer=4, hybrid_attention_ratio=0.25,
                                 hybrid_mlp_ratio=0.25, **mlp)
    pattern = Mamba2Config.preset("tiny", n_layer=4, layer_pattern=ratios.layers, **mlp)
    blocks = Mamba2Config.preset("tiny", n_layer=2, attn_layer_idx=[1], **mlp)  # mamba_ssm's
    assert ratios != pattern and ratios.spelt_out() == pattern.spelt_out()
    assert blocks.spelt_out() == Mamba2Config.preset("tiny", n_layer=4, layer_pattern="M-*-",
                                                     **mlp).spelt_out()
    assert ratios.spelt_out() != Mamba2Config.preset("tiny", n_layer=4, layer_pattern="M*M-",
                                                     **mlp).spelt_out()


def test_headdim_not_dividing_d_inner_names_values_and_fix():
    with pytest.raises(ValueError, match=r"128\*2 = 256 is not divisible by mamba2.headdim=48.*"
                                         r"choose headdim among \[32, 64\]"):
        Mamba2Config.preset("tiny", **{"mamba2.headdim": 48})


def test_ngroups_not_dividing_nheads_names_values_and_fix():
    # tiny: nheads = 256 / 32 = 8
    with pytest.raises(ValueError, match=r"nheads = d_inner/headdim = 8 is not divisible by "
                                         r"mamba2.ngroups=3; choose ngroups among "
                                         r"\[1, 2, 4, 8\]"):
        Mamba2Config.preset("tiny", **{"mamba2.ngroups": 3})


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="mamba2-130m"):
        Mamba2Config.preset("mamba2-7b")


def test_json_lists_become_tuples():
    d = Mamba2Config.preset("tiny").to_dict()
    d["mamba2"].update(dt_limit=[0.0, math.inf], A_init_range=[1, 16])
    assert Mamba2Config.from_dict(d) == Mamba2Config.preset("tiny")


def test_sections_round_trip_through_dicts_and_take_their_old_flat_names():
    cfg = Mamba2Config(d_model=64, n_layer=3, layer_pattern="M*-", mamba2={"d_state": 16},
                       attention={"num_heads": 4, "num_heads_kv": 2},
                       mlp={"d_intermediate": 96, "activation": "relu2"})
    assert (cfg.mamba2.d_state, cfg.attention.num_heads, cfg.mlp.d_intermediate) == (16, 4, 96)
    assert Mamba2Config.from_dict(cfg.to_dict()) == cfg
    # The flat spelling of configs saved before sections, and SECTION.FIELD, say the same.
    old = dict(d_model=64, n_layer=3, layer_pattern="M*-", d_state=16, attn_num_heads=4,
               attn_num_heads_kv=2, d_intermediate=96, mlp_activation="relu2")
    assert Mamba2Config.from_dict(old) == Mamba2Config(**old) == cfg
    assert cfg.replace(**{"attention.num_heads": 8}).attention.num_heads == 8
    assert cfg.replace(attention={"head_dim": 32}).attention == dataclasses.replace(
        cfg.attention, head_dim=32)


@pytest.mark.parametrize("changes,match", [
    (dict(d_stat=3), r"no field 'd_stat'; fields are .* sections \['attention', "
                     r"'bidirectional', 'mamba1', 'mamba2', 'mamba3', 'mlp'\]"),
    ({"mamba2.d_stat": 3}, r"Mamba2Config.mamba2 has no field 'd_stat'; its fields are"),
    (dict(mlp={"width": 3}), r"Mamba2Config.mlp has no fields \['width'\]"),
])
def test_unknown_fields_are_named_with_the_ones_there_are(changes, match):
    with pytest.raises(ValueError, match=match):
        Mamba2Config.preset("tiny", **changes)


def _n_params(cfg):
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("name,published", [("mamba2-130m", 130e6), ("mamba2-370m", 370e6),
                                            ("mamba2-780m", 780e6), ("mamba2-1.3b", 1.3e9),
                                            ("mamba2-2.7b", 2.7e9)])
def test_presets_have_the_published_sizes(name, published):
    cfg = PRESETS[name]
    assert cfg.padded_vocab_size == 50288
    assert cfg.mamba2.d_state == 128 and cfg.mamba2.headdim == 64
    # The names round the parameter counts; within 10% of the name.
    assert abs(_n_params(cfg) - published) / published < 0.1


# ------------------------------------------------------------------ Megatron's hybrid ratios

MEGATRON_PATTERNS = json.loads(
    (Path(__file__).parent / "fixtures" / "megatron" / "hybrid_patterns.json").read_text())
# examples/mamba/train.sh's HYBRID_LAYER_PATTERN for MODEL_SCALE 800M and 8B.
TRAIN_SH_800M = "M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-"
TRAIN_SH_8B = "M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-"


def test_ratios_allocate_the_layers_megatrons_function_does():
    """The table: Megatron-LM's own pattern_from_ratios run on each case
    (tests/fixtures/make_megatron_fixtures.py), its unit tests' and the recipes' included."""
    assert [48, 0.08, 0.5, TRAIN_SH_800M] in MEGATRON_PATTERNS
    assert [56, 0.08, 0.5, TRAIN_SH_8B] in MEGATRON_PATTERNS
    for n, attention, mlp, pattern in MEGATRON_PATTERNS:
        assert hybrid_pattern(n, attention, mlp) == pattern, (n, attention, mlp)
        cfg = Mamba2Config(d_model=64, n_layer=n, hybrid_attention_ratio=attention,
                           hybrid_mlp_ratio=mlp, d_intermediate=64 if mlp else 0,
                           attn_num_heads=8)
        assert cfg.layers == pattern and cfg.layer_pattern == ""


def test_the_megatron_recipes_layouts_come_from_ratios_and_megatrons_defaults():
    small, large = PRESETS["megatron-hybrid-800m"], PRESETS["megatron-hybrid-8b"]
    assert small.layer_pattern == "" and (small.hybrid_attention_ratio,
                                          small.hybrid_mlp_ratio) == (0.08, 0.5)
    assert small.layers == TRAIN_SH_800M and large.layers == TRAIN_SH_8B
    assert small.mlp.activation == large.mlp.activation == "gelu"  # Megatron's default
    recipe = tomllib.loads((Path(__file__).parents[1] / "train" /
                            "megatron-hybrid-800m.toml").read_text())
    assert recipe["model"] == {"num_layers": 48, "hybrid_attention_ratio": 0.08,
                               "hybrid_mlp_ratio": 0.5}


def test_megatron_layer_flags_set_the_layers_on_the_command_line_and_in_recipes(tmp_path):
    from mamba_jax.train import parse_args

    base = ["--preset", "tiny", "--set", "d_intermediate=64", "--set", "attn_num_heads=8"]
    _, cfg = parse_args(base + ["--num-layers", "10", "--hybrid-attention-ratio", "0.3",
                                "--hybrid-mlp-ratio", "0.3"])
    assert cfg.n_layer == 10 and cfg.layers == "M-*MM*-*M-"
    for flag in ("--hybrid-override-pattern", "--hybrid-layer-pattern"):
        _, cfg = parse_args(base + ["--num-layers", "3", flag, "M*-"])
        assert cfg.layer_pattern == "M*-"
    recipe = tmp_path / "r.toml"
    recipe.write_text('preset = "tiny"\n[model]\nnum_layers = 5\nhybrid_attention_ratio = 0.2\n'
                      'hybrid_mlp_ratio = 0.2\nd_intermediate = 64\nattn_num_heads = 8\n')
    _, cfg = parse_args(["--config", str(recipe)])
    assert cfg.layers == "MM*M-"
    assert Mamba2Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("changes,match", [
    (dict(hybrid_attention_ratio=0.6, hybrid_mlp_ratio=0.5), r"= 1.1 must be at most 1"),
    (dict(hybrid_attention_ratio=-0.1), r"hybrid_attention_ratio=-0.1 must be a number in"),
    (dict(hybrid_attention_ratio=0.2, attn_layer_idx=[1]), "not both"),
    (dict(hybrid_attention_ratio=0.1, layer_pattern="MM*MM*MMMM"),
     r"'MM\*MM\*MMMM' \(8 M, 2 \*, 0 -\) does not hold .* \('MMMMM\*MMMM': 9 M, 1 \*, 0 -\)"
     r"; give a pattern with those counts, or set both ratios to 0"),
])
def test_bad_ratios_name_the_value_and_the_fix(changes, match):
    with pytest.raises(ValueError, match=match):
        Mamba2Config(n_layer=10, attn_num_heads=8, **changes)


def test_an_override_of_a_section_no_layer_reads_is_refused():
    """d_state (a Mamba2 field) on a Mamba-3 or Mamba-1 preset changed nothing, silently;
    a kind's own section, and the Mamba2 sizes that the bidirectional kind reads, are
    taken."""
    for preset, key in (("mamba3-tiny", "d_state"), ("tiny-mamba1", "mamba2.d_state"),
                        ("mamba3-tiny", "mamba2.learnable_init_state"), ("tiny", "mamba3")):
        value = {} if key == "mamba3" else True if "learnable" in key else 64
        with pytest.raises(ValueError, match=rf"{key} sets cfg\.\w+, which no layer of "
                                             rf"'{preset}' \(layers '\w+'\) reads: set "):
            Mamba2Config.preset(preset, **{key: value})
    assert Mamba2Config.preset("mamba3-tiny", **{"mamba3.d_state": 64}).mamba3.d_state == 64
    assert Mamba2Config.preset("tiny", layer_pattern="BB", d_state=32).mamba2.d_state == 32


@pytest.mark.parametrize("section,match", [
    (dict(attention=dict(num_heads=0)), r"attention.num_heads=0 must be a positive integer"),
    (dict(mlp=dict(activation="swish")), r"mlp.activation='swish'; use one of"),
    (dict(mamba1=dict(dt_min=0.5, dt_max=0.1)), r"mamba1.dt_min=0.5 > dt_max=0.1: swap them"),
    (dict(mamba3=dict(rope_fraction=0.3)), r"mamba3.rope_fraction=0.3: mamba_ssm's Mamba3 "),
])
def test_a_section_no_layer_reads_is_still_validated_when_a_config_is_built(section, match):
    """Built directly (a constructor, from_dict: what preset refuses as changing nothing),
    a wrong value in a section no layer reads was taken without a word; its own checks
    run (how it would fit d_model is not asked: Mamba-1 at d_model 100 takes mamba2's
    headdim 64, which does not divide 200)."""
    with pytest.raises(ValueError, match=match):
        Mamba2Config(d_model=64, n_layer=2, **section)
    with pytest.raises(ValueError, match=match):
        Mamba2Config.from_dict({**Mamba2Config(d_model=64, n_layer=2).to_dict(), **section})
    assert Mamba2Config(d_model=100, n_layer=2, layer_pattern="11").layers == "11"


def test_expand_where_nheads_sets_the_width_is_refused():
    # Nemotron Nano 2's width is its 128 heads of 80: expand was taken and changed nothing
    for name, overrides in [("nemotron-nano-9b-v2", {"mamba2.expand": 7}),
                            ("tiny", {"mamba2": {"nheads": 4, "expand": 5}})]:
        with pytest.raises(ValueError, match=r"mamba2.expand is not read where mamba2.nheads "
                                             r"is set: .* set mamba2.nheads instead"):
            Mamba2Config.preset(name, **overrides)
    assert Mamba2Config.preset("tiny", **{"mamba2.expand": 4}).mamba2.expand == 4
