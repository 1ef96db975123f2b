"""Hybrid models (Mamba2, attention and MLP layers) on a mesh equal one device, on 8 fake CPU
devices: logits, loss and every gradient, with tests/mesh_check.py's tolerances (float32:
logits and loss within 1e-5 absolute, gradients within 1e-5 + 1e-4 relative)."""

import pytest

from mamba_jax import parallel
from mesh_check import assert_matches_single_device, tiny_config

# Mamba, attention, a run of two MLPs (one scan); 8 query heads over 2 KV heads (fewer than
# tp=4: replicated, each rank reads its group's), rotary on half of each head, biases (made
# nonzero by mesh_check).
HYBRID = dict(n_layer=4, layer_pattern="M*--", d_intermediate=64, attn_num_heads=8,
              attn_num_heads_kv=2, attn_head_dim=8, attn_rotary_emb_dim=4,
              attn_qkv_bias=True, attn_out_bias=True)
# 6 query heads over 3 KV heads at tp=2: each rank's 3 query heads read KV heads 0, 0, 1 and
# 1, 2, 2 (jnp.take of the replicated KV heads, not one slice).
GQA_UNEVEN = dict(HYBRID, attn_num_heads=6, attn_num_heads_kv=3)


@pytest.mark.parametrize("spec,sp", [
    ("tp=2,dp=4", True),
    ("tp=2,dp=4", False),            # attention and the MLPs on the whole sequence
    ("tp=4,dp=2", True),             # 2 KV heads over 4 ranks: replicated
    ("fsdp=2,tp=2,dp=2", True),      # their parameters gathered over fsdp
])
def test_hybrid_logits_loss_and_gradients_match_single_device(spec, sp):
    specs = assert_matches_single_device(tiny_config(**HYBRID), spec, sp)
    attn = specs["layers"][1]["mixer"]
    tp = parallel.make_mesh(spec).shape["tp"]
    spec_of = lambda v: v.get_value()  # a Variable holding a PartitionSpec
    assert spec_of(attn["q_proj"])[1] == "tp" and spec_of(attn["o_proj"])[0] == "tp"
    assert (spec_of(attn["k_proj"])[1] == "tp") == (tp == 2)
    mlp = specs["layers"][2]["mixer"]
    assert spec_of(mlp["up_proj"])[1] == "tp" and spec_of(mlp["down_proj"])[0] == "tp"


@pytest.mark.parametrize("spec", ["cp=2,dp=4", "dp=2,cp=2,tp=2"])
def test_hybrid_cp_over_packed_documents_matches_single_device(spec):
    # Keys and values all-gathered over cp; document boundaries inside and on part edges.
    assert_matches_single_device(tiny_config(**HYBRID), spec, True, packed=True)


def test_query_heads_read_their_own_kv_heads_where_tp_does_not_divide_them():
    # Each rank takes its queries' KV heads from the projected keys and values, with
    # sequence parallelism or without alike (Attention.__call__).
    assert_matches_single_device(tiny_config(**GQA_UNEVEN), "tp=2,dp=4", True)


def test_attention_heads_not_divisible_by_tp_names_both_and_the_sizes_that_work():
    cfg = tiny_config(**{**HYBRID, "attn_num_heads": 6, "attn_num_heads_kv": 3})
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 6 heads of "
                                         r"layers\.1\.mixer\..* use tp in "
                                         r"\[1, 2\]"):  # the sizes 8 devices allow
        parallel.check_layout(cfg, parallel.make_mesh("dp=2,tp=4"))
    cfg = tiny_config(**{**HYBRID, "d_intermediate": 30})
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 30 mlp of "
                                         r"layers\.2\.mixer\..*the MLP width"):
        parallel.check_layout(cfg, parallel.make_mesh("dp=2,tp=4"))


@pytest.mark.parametrize("recipe,mesh", [("megatron-hybrid-8b", "dp=2,tp=4"),
                                         ("megatron-hybrid-800m", "tp=8")])
def test_megatron_hybrid_recipes_load_and_fit_their_meshes(recipe, mesh):
    from mamba_jax.train import parse_args
    args, cfg = parse_args(["--config", f"train/{recipe}.toml"])
    layers = cfg.layers
    assert (layers.count("M"), layers.count("*"), layers.count("-")) == (
        {"megatron-hybrid-8b": (24, 4, 28), "megatron-hybrid-800m": (20, 4, 24)}[recipe])
    parallel.check_layout(cfg, parallel.make_mesh(mesh), batch_size=args.batch_size,
                          seq_len=args.seq_len)


def test_trainer_trains_a_hybrid_on_a_mesh_and_exports_nemotron_h(tmp_path):
    from mamba_jax.convert import load_config
    from mamba_jax.train import main
    hybrid = ["--set", "layer_pattern=M*-", "--set", "n_layer=3", "--set", "d_intermediate=64",
              "--set", "attn_num_heads=4", "--set", "attn_num_heads_kv=2",
              "--set", "attn_head_dim=16", "--set", "mlp_activation=relu2"]
    args = ["--steps", "2", "--batch-size", "8", "--seq-len", "32", "--mesh", "dp=4,tp=2",
            "--set", "d_model=64", "--set", "d_state=16", "--set", "headdim=16", *hybrid]
    # NemotronH clamps dt: a model that does not is exported in our own layout
    # (tests/test_train.py), one with NemotronH's floor in NemotronH's
    main([*args, "--set", "dt_limit=0.001,inf", "--out", str(tmp_path)])
    cfg, fmt = load_config(tmp_path)
    assert fmt == "nemotron_h" and cfg.layers == "M*-"
