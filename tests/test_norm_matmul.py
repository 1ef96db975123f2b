"""The norm-then-projection kernel (pallas_kernels.decode.norm_matmul) against its plain-JAX
reference through Pallas's interpreter on fresh random inputs, the reference against the
model's own norm and matmul functions, and a decoding step through the fused kernels
against the XLA step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.generate.plan import FUSED_STEP_MAX_BATCH, decode_plan
from mamba_jax.layers.common import dense, gated_rms_norm, matmul, rms_norm
from pallas_kernels.decode.norm_matmul import Blocks, _activate, k_tiles, rms_norm_matmul
from seeds import fresh_rng


def _inputs(rng, b, k, n, ngroups, dtype, gate, bias, residual, w_transposed):
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return dict(x=arr(b, k).astype(dtype), weight=1.0 + 0.1 * arr(k),
                w=((arr(n, k) if w_transposed else arr(k, n)) / np.sqrt(k)).astype(dtype),
                z=arr(b, k + 24).astype(dtype) if gate else None, ngroups=ngroups,
                bias=0.1 * arr(n) if bias else None,
                residual=arr(b, n) if residual else None, w_transposed=w_transposed)


# Each dtype meets each layout, gate/groups and bias/residual setting; k = 1536 is several
# of the kernel's power-of-two feature tiles (1024 and 512, or 6 of 256), n = 40 one-column
# programs (the default blocks for so small an n) or five 8-column ones. The last case
# keeps a bf16 product in float32 (out_dtype, as MLP.fused_step asks).
@pytest.mark.parametrize("b,dtype,gate,ngroups,bias,residual,w_transposed,blocks,out_dtype", [
    (1, jnp.float32, False, 1, False, False, False, Blocks(), None),
    (3, jnp.bfloat16, True, 4, True, True, True, Blocks(8, 256, 4), None),
    (2, jnp.bfloat16, False, 1, False, False, True, Blocks(), None),
    (2, jnp.float32, True, 2, True, True, False, Blocks(8, 256, 4), None),
    (1, jnp.bfloat16, False, 1, True, False, True, Blocks(), jnp.float32)])
def test_kernel_equals_the_reference(b, dtype, gate, ngroups, bias, residual, w_transposed,
                                     blocks, out_dtype):
    rng = fresh_rng()  # fresh inputs every run (tests/seeds.py)
    args = _inputs(rng, b, 1536, 40, ngroups, dtype, gate, bias, residual, w_transposed)
    ref = rms_norm_matmul(**args, eps=1e-5, out_dtype=out_dtype, implementation="xla")
    out = rms_norm_matmul(**args, eps=1e-5, out_dtype=out_dtype, implementation="triton",
                          blocks=blocks)
    assert out.dtype == ref.dtype == (jnp.float32 if residual else out_dtype or dtype)
    assert out.shape == (b, 40) and np.all(np.isfinite(out.astype(jnp.float32)))
    # The same float32 arithmetic summed in another order; a product rounded to bf16 (before
    # any residual is added) may then round to the neighbouring value: one ulp, at most
    # 2**-7 of the largest product.
    tol = 2.0 ** -7 if (out_dtype or dtype) == jnp.bfloat16 else 1e-5
    ref, out = (np.asarray(a.astype(jnp.float32)) for a in (ref, out))
    product = ref - np.asarray(args["residual"]) if residual else ref
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * np.abs(product).max())


@pytest.mark.parametrize("p", [80, 96, 192])
def test_the_gated_out_projection_at_headdims_that_are_no_power_of_two(p):
    """A Mamba block's out_proj input of 4 heads of p (80, Nemotron Nano 2's; 96; 192) in 2
    norm groups: k = 4p features, groups of 2p, each read in power-of-two tiles (128 and 32,
    128 and 64, 256 and 128 here); float32, the same arithmetic summed in another order."""
    rng = fresh_rng()
    args = _inputs(rng, 2, 4 * p, 8, 2, jnp.float32, True, False, True, True)
    ref = rms_norm_matmul(**args, eps=1e-5, implementation="xla")
    out = rms_norm_matmul(**args, eps=1e-5, implementation="triton")
    product = np.asarray(ref) - np.asarray(args["residual"])
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(product).max())


def test_k_is_read_in_few_power_of_two_tiles_that_cover_each_group():
    """Each group's features exactly once, in order, in power-of-two widths of at most bk:
    Nemotron Nano 2's MLP (k 15680, whose largest power-of-two divisor is 64) in 10 loads,
    not 245; its Mamba out_proj (10240 in 8 norm groups of 1280) in 2 a group."""
    for k_group, ngroups, bk, count in ((15680, 1, 2048, 10), (1280, 8, 2048, 16),
                                        (1536, 4, 256, 24), (7, 1, 4, 3)):
        tiles = k_tiles(k_group, ngroups, bk)
        assert sum(len(group) for group in tiles) == count
        for g, group in enumerate(tiles):
            assert group[0][0] == g * k_group
            assert sum(width for _, width in group) == k_group
            assert all(first + width == after for (first, width), (after, _) in
                       zip(group, group[1:]))
            assert all(width & (width - 1) == 0 and width <= bk for _, width in group)


@pytest.mark.parametrize("activation", ["relu2", "swiglu", "gelu"])
def test_without_a_norm_it_is_an_mlps_down_projection(activation):
    """weight None: no norm. v = relu(x)**2 ("relu2"), x * silu(z) (swiglu's up times
    silu(gate)), or exact GeLU (whose erf the kernel approximates to 1.5e-7; its tanh
    approximation checked beside) against jax.nn.gelu, rounded to w's dtype, then the
    product, rounded, plus the residual: the MLP layer's arithmetic (layers.MLP), by the
    reference and the kernel. k = 448 = 7 x 64 (as Nemotron Nano 2's 15680 = 245 x 64) is
    read in tiles of 256, 128 and 64."""
    rng = fresh_rng()
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    up, gate, down, residual = arr(2, 448), arr(2, 448), arr(448, 40) / 448 ** 0.5, arr(2, 40)
    down = down.astype(jnp.bfloat16)
    if activation == "relu2":
        kw, a = dict(activation="relu2"), jnp.square(jax.nn.relu(up))
    elif activation.startswith("gelu"):
        kw, a = dict(activation="gelu"), jax.nn.gelu(up, approximate=False)
        grid = jnp.linspace(-8.0, 8.0, 4001)  # the kernel's GeLUs themselves, against XLA's
        for name, approximate in (("gelu", False), ("gelu_tanh", True)):
            np.testing.assert_allclose(_activate(grid, name), jax.nn.gelu(grid, approximate),
                                       rtol=0, atol=1.5e-7 * 8 + 1e-6)
    else:
        kw, a = dict(z=gate), up * jax.nn.silu(gate)
    expected = residual + matmul("bf,fd->bd", a.astype(jnp.bfloat16), down, jnp.bfloat16,
                                 jnp.bfloat16).astype(jnp.float32)
    for implementation in ("xla", "triton"):
        out = rms_norm_matmul(up, None, down.T, eps=None, residual=residual, w_transposed=True,
                              implementation=implementation, **kw)
        assert out.dtype == jnp.float32 and np.all(np.isfinite(out))
        # float32 sums in another order: the bf16 product may round to its neighbour
        np.testing.assert_allclose(out, expected, rtol=0, atol=2.0 ** -8 * float(
            jnp.max(jnp.abs(expected - residual))))


@pytest.mark.parametrize("window_dtype", [jnp.bfloat16, jnp.float32])
def test_the_window_takes_the_outputs_columns(window_dtype):
    """window=(conv_state, at): conv_state shifted by one with out's columns [at, at + e)
    appended in its dtype, by the kernel (in place) as by the reference."""
    rng = fresh_rng()
    args = _inputs(rng, 2, 256, 48, 1, jnp.bfloat16, False, True, False, True)
    conv_state = jnp.asarray(rng.standard_normal((2, 24, 4)), window_dtype)
    for implementation in ("xla", "triton"):
        out, window = rms_norm_matmul(**args, eps=1e-5, window=(conv_state, 16),
                                      implementation=implementation)
        assert window.dtype == window_dtype and window.shape == conv_state.shape
        np.testing.assert_array_equal(window[:, :, :-1], conv_state[:, :, 1:])
        np.testing.assert_array_equal(window[:, :, -1], out[:, 16:40].astype(window_dtype))
        np.testing.assert_array_equal(out, rms_norm_matmul(**args, eps=1e-5,
                                                           implementation=implementation))
    with pytest.raises(ValueError, match="window \\(2, 24, 4\\) at column 32"):
        rms_norm_matmul(**args, eps=1e-5, window=(conv_state, 32))


def test_the_reference_is_the_models_norm_then_matmul():
    """In-projection: rms_norm then dense; out-projection: gated_rms_norm, matmul and the
    residual add, as Block.step over Mamba2Mixer.step computes them. The model rounds
    v * rstd * weight to bf16 before the product, the reference v * weight (and applies
    rstd to the product): one rounding of each term either way, of at most 2**-9 of it, so
    the two products differ by at most 2**-8 of the sum of the terms' magnitudes; each then
    rounds to bf16, half a bf16 ulp (at most 2**-8 of the value) each."""
    rng = fresh_rng()
    x, weight, w = (_inputs(rng, 2, 256, 48, 1, jnp.bfloat16, False, False, False, False)[key]
                    for key in ("x", "weight", "w"))

    def within_the_roundings(ours, expected, normed, w_kn, residual=0.0):
        f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        terms = np.abs(f64(normed)) @ np.abs(f64(w_kn))  # [b, n]: sum of |v rstd weight w|
        bound = 2.0 ** -8 * terms + 2.0 ** -7 * np.abs(f64(expected) - f64(residual))
        assert np.all(np.abs(f64(ours) - f64(expected)) <= bound)

    residual = x.astype(jnp.float32)
    normed = rms_norm(residual, weight, 1e-5)  # float32
    expected = dense(normed.astype(jnp.bfloat16), w, jnp.bfloat16, out_dtype=jnp.bfloat16)
    within_the_roundings(rms_norm_matmul(residual, weight, w, eps=1e-5), expected, normed, w)

    y, z = x, jnp.asarray(rng.standard_normal((2, 256 + 8)), jnp.bfloat16)
    h, p, g = 8, 32, 2
    # in float32 (y's dtype), unrounded: the same values the model rounds to bf16
    normed = gated_rms_norm(y.astype(jnp.float32).reshape(2, h, p), z[:, :256].reshape(2, h, p),
                            weight.reshape(h, p), 1e-5, g).reshape(2, 256)
    residual = jnp.asarray(rng.standard_normal((2, 48)), jnp.float32)
    expected = residual + matmul("be,de->bd", normed.astype(jnp.bfloat16), w.T, jnp.bfloat16,
                                 jnp.bfloat16).astype(jnp.float32)
    within_the_roundings(rms_norm_matmul(y, weight, w.T, eps=1e-5, z=z, ngroups=g,
                                         residual=residual, w_transposed=True),
                         expected, normed, w, residual)


@pytest.mark.parametrize("batch", [FUSED_STEP_MAX_BATCH, FUSED_STEP_MAX_BATCH + 1])
def test_fused_decoding_step_matches_the_xla_step(batch):
    """A bf16 model's step with step_implementation="triton": up to FUSED_STEP_MAX_BATCH rows
    the fused kernels (Mamba2Mixer.fused_step), above it the step kernel alone."""
    cfg = Mamba2Config.preset("tiny")
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    ids = jnp.asarray(fresh_rng().integers(0, cfg.vocab_size, (batch, 9)))
    _, cache = model.prefill(ids[:, :8])
    logits, new = model.step(ids[:, 8], cache)
    logits_k, new_k = model.step(ids[:, 8], cache, steps=decode_plan(model, batch, "triton").steps)
    assert np.all(np.isfinite(logits_k))
    # bf16 activations: where the two sum float32 in another order a value may round to its
    # neighbouring bf16 value; logits of about 0.6 then move by well under 1e-2.
    np.testing.assert_allclose(logits_k, logits, rtol=0, atol=1e-2)
    # The caches within four bf16 ulps of their largest value (2**-6 of it). Each kernel is
    # within one (its own tests); here the first layer's dt, and every later layer's input,
    # already differ by such roundings, which its window and state then carry (worst over 500
    # runs: 2**-8 of the largest window value, 2.3e-3 of the largest state; an element-wise
    # bound on the windows failed about 1 run in 150, where a sum cancels).
    for c, c_k in zip(new, new_k):
        for name in ("conv_state", "ssm_state"):
            ref, ours = (np.asarray(getattr(a, name), np.float64) for a in (c, c_k))
            np.testing.assert_allclose(ours, ref, rtol=0, atol=2.0 ** -6 * np.abs(ref).max())


# The second case has biases on q, k, v and o_proj, and rotary on half of each head.
@pytest.mark.parametrize("activation,attention_extras", [("relu2", False), ("swiglu", True)])
def test_fused_decoding_step_of_a_hybrid_matches_the_xla_step(activation, attention_extras):
    """At batch 1 with step_implementation="triton" an MLP block is two kernels
    (MLP.fused_step: the norm and input projections, w_in [2f, d] for swiglu; the
    activation, down_proj and residual), and so is an attention block (Attention.fused_step:
    the norm with q, k and v's projections; o_proj and the residual), among fused Mamba
    blocks."""
    cfg = Mamba2Config(layer_pattern="M-*M-", n_layer=5, d_model=64, vocab_size=100,
                       d_state=16, headdim=16, chunk_size=8, d_intermediate=96,
                       attn_num_heads=4, attn_num_heads_kv=2, attn_head_dim=16,
                       mlp_activation=activation, attn_qkv_bias=attention_extras,
                       attn_out_bias=attention_extras,
                       attn_rotary_emb_dim=8 if attention_extras else 0)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    rng = fresh_rng()
    if attention_extras:  # the biases start at zero: make them count
        attention = model.layers[2].mixer
        for name in ("q_bias", "k_bias", "v_bias", "out_bias"):
            bias = getattr(attention, name)
            bias[...] = jnp.asarray(0.1 * rng.standard_normal(bias.shape), jnp.float32)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 9)))
    # jitted: one compile each, not one an operation
    _, cache = nnx.jit(lambda model, ids: model.prefill(ids, cache_len=12))(model, ids[:, :8])
    step = lambda model, implementation: model.step(
        ids[:, 8], cache, steps=decode_plan(model, 1, implementation).steps)
    # three kernels a Mamba block, two an MLP or attention block
    assert str(jax.make_jaxpr(lambda: step(model, "triton"))()).count("pallas_call") == (
        2 * 3 + 3 * 2)
    step = nnx.jit(step, static_argnums=1)
    (logits, new), (logits_k, new_k) = step(model, "xla"), step(model, "triton")
    assert np.all(np.isfinite(logits_k))
    # As in the Mamba-only step above: the same arithmetic, float32 sums in another order.
    np.testing.assert_allclose(logits_k, logits, rtol=0, atol=1e-2)
    # The bf16 roundings that flip in one block feed the next: the fourth layer's state was
    # 2^-6.3 of its largest from XLA's at worst over 40 inputs, once 2^-5.6 (a CI run)
    for ref, ours in zip(jax.tree.leaves(new), jax.tree.leaves(new_k)):
        ref, ours = np.asarray(ref, np.float64), np.asarray(ours, np.float64)
        np.testing.assert_allclose(ours, ref, rtol=0, atol=2.0 ** -5 * np.abs(ref).max())


def test_bad_arguments_are_refused():
    args = _inputs(np.random.default_rng(0), 1, 64, 16, 1, jnp.float32, False, False, False,
                   False)
    with pytest.raises(ValueError, match="implementation='cuda'"):
        rms_norm_matmul(**args, eps=1e-5, implementation="cuda")
    with pytest.raises(ValueError, match="does not match w"):
        rms_norm_matmul(**{**args, "w_transposed": True}, eps=1e-5)
    with pytest.raises(ValueError, match="activation='silu'"):
        rms_norm_matmul(**args, eps=1e-5, activation="silu")
