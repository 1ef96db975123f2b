"""FP8 training matmuls: pallas_kernels.fp8 and the layers under model.Fp8, on XLA:CPU, whose
FP8 dots are an emulation (the dequantized operands multiplied in the compute dtype):
numerics only; whether XLA's GPU compiler makes them FP8 GEMMs is for bench.train_step.

Tolerances:
- the scale is amax / fp8_max in the compute dtype exactly, 1 for a zero (or non-finite)
  tensor; values past fp8_max saturate to it, never inf or NaN.
- fp8.matmul against the same quantization done independently (numpy with ml_dtypes' FP8
  casts, float64 products), float32 compute: value and both gradients within 1e-5 of the
  largest value (float32 accumulation, nothing else differs).
- the tiny hybrid model (Mamba2, attention, MLP) with every layer in FP8 and float32
  elsewhere against float32 without FP8: loss within 1e-3 relative; all gradients together
  within 0.15 relative (L2), each parameter's within 0.3. The gradient entering each
  backward product is rounded to E5M2 (2 mantissa bits: up to 1/8 of a value, about 5%
  root-mean-square), which dominates: measured 0.092 together and at worst 0.174 (dt_bias)
  here, where bf16 compute alone is within 0.007.
- the same under fsdp=2, cp=2, tp=2 with sequence parallel against one device in FP8: loss
  within 1e-5, every gradient within 1e-3 of its largest value (each amax is reduced over
  the mesh, so the scales are one device's; float32 sums in another order may move a value
  across an FP8 rounding boundary: 3e-4 seen).
"""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from mamba_jax import parallel
from mamba_jax.layers import common
from mamba_jax.model import Fp8, Mamba2LM
from mamba_jax.train import main
from mesh_check import FAST_COMPILE, model_and_batch, tiny_config
from pallas_kernels import fp8


def test_scale_is_amax_over_the_format_maximum_and_one_for_a_zero_tensor():
    x = jnp.array([[0.5, -3.5], [1.0, 2.0]], jnp.float32)
    assert float(fp8.amax(x)) == 3.5
    assert fp8.scale(fp8.amax(x), fp8.E4M3, jnp.float32) == np.float32(3.5) / np.float32(448)
    assert fp8.scale(fp8.amax(x), fp8.E5M2, jnp.float32) == np.float32(3.5) / np.float32(57344)
    # a bf16 scale is that rounded to bf16
    assert fp8.scale(jnp.float32(1.0), fp8.E4M3, jnp.bfloat16) == jnp.bfloat16(1 / 448)
    zeros = jnp.zeros((4, 8), jnp.bfloat16)
    q, s = fp8.quantized(zeros, fp8.E4M3, jnp.bfloat16)
    assert float(s) == 1.0 and not np.asarray(q.astype(jnp.float32)).any()
    y, pullback = jax.vjp(lambda a, b: fp8.matmul("md,df->mf", a, b, jnp.bfloat16), zeros,
                          jnp.zeros((8, 3)))
    da, db = pullback(jnp.ones_like(y))
    for t in (y, da, db):
        assert np.all(np.asarray(t, np.float32) == 0)
    # a tensor holding inf or NaN gets scale 1: its values stay inf and NaN, not a scale
    assert float(fp8.scale(fp8.amax(jnp.array([1.0, jnp.nan])), fp8.E4M3, jnp.float32)) == 1.0
    assert np.isnan(float(fp8.quantize(jnp.array([jnp.nan]), fp8.E4M3,
                                       jnp.float32(1)).astype(jnp.float32)[0]))


def test_values_beyond_the_format_saturate_never_inf_or_nan():
    big = jnp.array([500.0, -1e9, 448.9, 7e4], jnp.float32)
    # a plain cast makes 500 NaN in E4M3 (it has no inf), and 7e4 inf in E5M2
    assert np.isnan(np.asarray(big.astype(fp8.E4M3).astype(jnp.float32))[0])
    assert np.isinf(np.asarray(big.astype(fp8.E5M2).astype(jnp.float32))[3])
    one = jnp.float32(1.0)
    np.testing.assert_array_equal(fp8.quantize(big, fp8.E4M3, one).astype(jnp.float32),
                                  [448, -448, 448, 448])
    np.testing.assert_array_equal(fp8.quantize(big, fp8.E5M2, one).astype(jnp.float32),
                                  [512, -57344, 448, 57344])
    # a bf16 scale rounded below amax / 448 puts the largest value past 448: it saturates
    x = jnp.array([448.0 * 1.003, 1.0], jnp.float32)  # amax / 448 rounds down to 1.0
    s = fp8.scale(fp8.amax(x), fp8.E4M3, jnp.bfloat16)
    assert float(x[0]) / float(s) > 448
    q = fp8.quantize(x, fp8.E4M3, s).astype(jnp.float32)
    assert float(q[0]) == 448 and np.all(np.isfinite(q))


def _independent(x, dtype):
    """x (numpy float64) quantized as fp8 says, with ml_dtypes' casts: (values, scale)."""
    top = float(ml_dtypes.finfo(dtype).max)
    s = np.float32(np.abs(x).max()) / np.float32(top)
    q = np.clip(x.astype(np.float32) / s, -top, top).astype(dtype)
    return q.astype(np.float64), np.float64(s)


def test_fp8_matmul_and_its_gradients_match_an_independent_quantization():
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (2, 5, 3, 16)) * 3   # "...hp", an out-projection's input
    b = jax.random.normal(keys[1], (3, 16, 24)) * 0.1   # "hpd"
    g = jax.random.normal(keys[2], (2, 5, 24)) * 1e-3
    spec = "...hp,hpd->...d"
    y, pullback = jax.vjp(lambda a, b: fp8.matmul(spec, a, b, jnp.float32), a, b)
    da, db = pullback(g)
    (qa, sa), (qb, sb), (qg, sg) = (_independent(np.asarray(t, np.float64), ml)
                                    for t, ml in ((a, ml_dtypes.float8_e4m3fn),
                                                  (b, ml_dtypes.float8_e4m3fn),
                                                  (g, ml_dtypes.float8_e5m2)))
    want = (np.einsum("blhp,hpd->bld", qa * sa, qb * sb),
            np.einsum("bld,hpd->blhp", qg * sg, qb * sb),
            np.einsum("blhp,bld->hpd", qa * sa, qg * sg))
    for name, got, w in zip(("y", "da", "db"), (y, da, db), want):
        error = np.abs(np.asarray(got, np.float64) - w).max() / np.abs(w).max()
        assert error < 1e-5, f"{name}: {error:.1e}"
    # and the gradient is FP8's: the unquantized product is far beyond that tolerance
    unquantized = np.einsum("blhp,bld->hpd", np.asarray(a, np.float64), np.asarray(g))
    assert np.abs(np.asarray(db) - unquantized).max() > 1e-2 * np.abs(unquantized).max()


HYBRID = dict(ngroups=2, n_layer=3, layer_pattern="M*-", attn_num_heads=4,
              attn_num_heads_kv=2, attn_head_dim=16, d_intermediate=128)


@functools.cache
def one_device(fp8_recipe):
    """(loss, gradients) of the tiny hybrid on one device, float32 compute (at "highest"
    precision), its projections in FP8 where fp8_recipe says."""
    graphdef, params, batch = model_and_batch(tiny_config(**HYBRID))

    def run(params, batch):
        return jax.value_and_grad(
            lambda p: nnx.merge(graphdef, p).loss(*batch, fp8=fp8_recipe).mean())(params)
    with jax.default_matmul_precision("highest"):
        value, grads = jax.jit(run, compiler_options=FAST_COMPILE)(params, batch)
    assert np.isfinite(float(value))
    return value, grads


def test_fp8_gradients_are_within_fp8_rounding_of_float32():
    value, grads = one_device(Fp8(skip_layers=0))
    ref_value, ref_grads = one_device(None)
    assert abs(float(value) - float(ref_value)) < 1e-3 * abs(float(ref_value))
    flat = lambda tree: np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(tree)])
    together = np.linalg.norm(flat(grads) - flat(ref_grads)) / np.linalg.norm(flat(ref_grads))
    assert together < 0.15, together
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                              jax.tree.leaves(ref_grads)):
        g, ref = np.asarray(g), np.asarray(ref)
        assert np.all(np.isfinite(g))
        error = np.linalg.norm(g - ref) / np.linalg.norm(ref)
        assert error < 0.3, f"{jax.tree_util.keystr(path)}: {error:.3f}"


def test_fp8_under_fsdp_cp_tp_and_sequence_parallel_matches_one_device():
    recipe = Fp8(skip_layers=0)
    graphdef, params, batch = model_and_batch(tiny_config(**HYBRID))
    mesh = parallel.make_mesh("fsdp=2,cp=2,tp=2")
    specs = parallel.param_specs(params, mesh)
    loss = parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=True, fp8=recipe)
    with jax.default_matmul_precision("highest"):
        value, grads = jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(
            jax.device_put(params, parallel.shardings(mesh, specs)),
            *jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS)))
    ref_value, ref_grads = one_device(recipe)
    assert abs(float(value) - float(ref_value)) < 1e-5
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                              jax.tree.leaves(ref_grads)):
        error = np.abs(np.asarray(g) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()
        assert error < 1e-3, f"{jax.tree_util.keystr(path)}: {error:.1e}"


def test_the_embedding_head_and_first_and_last_layers_stay_in_the_compute_dtype(monkeypatch):
    # Which matmuls the model calls in FP8 and which in the compute dtype, by their weights'
    # shapes: layers M M - M with skip_layers=1 put the second M and the MLP in FP8.
    cfg = tiny_config(n_layer=4, layer_pattern="MM-M", d_intermediate=128)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    calls = {"fp8": [], "compute": []}
    fp8_matmul, compute_matmul = fp8.matmul, common._compute_matmul
    monkeypatch.setattr(fp8, "matmul", lambda spec, a, b, *rest: calls["fp8"].append(
        b.shape) or fp8_matmul(spec, a, b, *rest))
    monkeypatch.setattr(common, "_compute_matmul", lambda spec, a, b, *rest: calls[
        "compute"].append(b.shape) or compute_matmul(spec, a, b, *rest))
    ids = jnp.zeros((2, 16), jnp.int32)
    jax.make_jaxpr(jax.grad(lambda m: m.loss(ids, ids, fp8=Fp8(skip_layers=1),
                                             scan_layers=False).mean()))(model)
    in_proj = model.layers[0].mixer.in_proj()[0].shape
    out_proj = model.layers[0].mixer.out_proj.shape
    mlp = [(64, 128), (64, 128), (128, 64)]  # swiglu: up, gate, down
    head = (cfg.padded_vocab_size, cfg.d_model)
    assert calls["fp8"] == [in_proj, out_proj, *mlp]
    assert calls["compute"] == [in_proj, out_proj, in_proj, out_proj, head]


def test_train_fp8_flags(tmp_path, capsys):
    tiny = ["--batch-size", "8", "--seq-len", "32", "--set", "d_model=64", "--out", "none",
            "--dtype", "bfloat16", "--fp8"]
    with pytest.raises(SystemExit, match="--fp8-skip-layers 1 keeps all 2 layers of the model "
                                         "in --dtype.*use at most 0"):
        main([*tiny, "--steps", "1"])
    metrics = tmp_path / "m.jsonl"
    main([*tiny, "--steps", "2", "--set", "n_layer=3", "--metrics-file", str(metrics)])
    assert "compute bfloat16 (FP8 projections in layers 1..1)" in capsys.readouterr().err
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and np.all(np.isfinite(losses))
