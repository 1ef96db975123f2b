import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from mamba_jax.layers import common as layers
from mamba_jax.layers.common import gated_rms_norm, rms_norm
from pallas_kernels.conv import causal_conv1d
from flax import nnx

from mamba_jax import Mamba2Config
from mamba_jax.model import Block, Stream, remat_policy


def test_causal_conv1d_matches_direct_convolution():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 5)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    y = causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias))
    expected = np.zeros_like(x)
    for t in range(9):
        for j in range(4):
            src = t - 3 + j
            if src >= 0:
                expected[:, t] += w[j] * x[:, src]
    expected = jax.nn.silu(expected + bias)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)


def test_causal_conv1d_restarts_at_document_starts():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 12, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    doc = jnp.asarray([[0] * 7 + [1] * 5])
    y = causal_conv1d(x, w, None, doc)
    alone = jnp.concatenate([causal_conv1d(x[:, :7], w), causal_conv1d(x[:, 7:], w)], axis=1)
    np.testing.assert_allclose(y, alone, rtol=1e-6, atol=1e-6)


def test_gated_norm_normalises_each_group_separately():
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)  # h=4, p=3
    z = jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    out = gated_rms_norm(y, z, w, 1e-5, ngroups=2)
    gated = np.asarray(y * jax.nn.silu(z))
    for grp in range(2):
        heads = slice(2 * grp, 2 * grp + 2)
        part = gated[:, heads].reshape(2, -1)
        expected = part / np.sqrt((part ** 2).mean(-1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(out[:, heads], expected.reshape(2, 2, 3) * w[heads],
                                   rtol=1e-5, atol=1e-6)


def test_norms_compute_in_float32_and_return_the_input_dtype():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 64)) * 300, jnp.bfloat16)
    out = rms_norm(x, jnp.ones(64), 1e-5)
    assert out.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float32)
    ref = ref / np.sqrt((ref ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("spec, a_shape, b_shape", [
    ("...d,df->...f", (2, 5, 8), (8, 12)),          # the projections (dense)
    ("...hp,hpd->...d", (2, 5, 3, 4), (3, 4, 8)),   # out_proj over heads
    ("bld,vd->blv", (2, 5, 8), (11, 8)),            # the LM head
])
def test_matmul_gradient_runs_in_the_compute_dtype(spec, a_shape, b_shape):
    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(ka, a_shape, jnp.bfloat16)
    b = jax.random.normal(kb, b_shape, jnp.float32)
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, a, b)).shape
    g = jax.random.normal(kg, out_shape, jnp.float32)
    loss = lambda a, b, dtype: (layers.matmul(spec, a, b, dtype) * g).sum()

    # float32 compute: exactly einsum's gradient.
    a32 = a.astype(jnp.float32)
    want = jax.grad(lambda a, b: (jnp.einsum(spec, a, b, precision="highest") * g).sum(),
                    argnums=(0, 1))(a32, b)
    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss, argnums=(0, 1))(a32, b, jnp.float32)
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    # bf16 compute: gradients in a's and b's dtypes, within bf16 rounding of the float32 ones
    # (the cotangent and b are rounded to bf16: relative error about 2**-8 per element).
    da, db = jax.grad(loss, argnums=(0, 1))(a, b, jnp.bfloat16)
    assert da.dtype == jnp.bfloat16 and db.dtype == jnp.float32
    for x, y in zip((da, db), want):
        x = np.asarray(x, np.float32)
        assert np.isfinite(x).all()
        assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max()

    # Every matmul, the forward one and the two of the backward pass, takes two bf16
    # operands (none mixes in float32).
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(a, b, jnp.bfloat16)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16]


def test_split_last_is_jnp_split_with_one_concatenation_for_its_gradient():
    a = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11))
    cotangents = tuple(jax.random.normal(jax.random.PRNGKey(i), (2, 3, n))
                       for i, n in enumerate((4, 5, 2), 1))
    ours, ours_vjp = jax.vjp(lambda a: layers.split_last(a, (4, 5, 2)), a)
    split, split_vjp = jax.vjp(lambda a: tuple(jnp.split(a, [4, 9], axis=-1)), a)
    for o, s in zip(ours, split):
        np.testing.assert_array_equal(o, s)
    np.testing.assert_array_equal(ours_vjp(cotangents)[0], split_vjp(cotangents)[0])
    jaxpr = jax.make_jaxpr(lambda a, c: jax.vjp(
        lambda a: layers.split_last(a, (4, 5, 2)), a)[1](c))(a, cotangents)
    assert str(jaxpr).count("concatenate") == 1
    assert "optimization_barrier" in str(jaxpr)


def saved_residuals(f, *args):
    """print_saved_residuals' lines for f(*args), but those of the arguments: "bf16[8,16]
    output of dot_general from ..."."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


def test_block_remat_keeps_the_matmul_results_and_recomputes_the_rest():
    # remat "block" saves what the matmuls return (their dots are visible to its policy
    # through matmul's custom JVP); the backward pass recomputes the elementwise sin.
    def f(x, w1, w2):
        h = jnp.sin(layers.matmul("bd,df->bf", x, w1, jnp.bfloat16, jnp.bfloat16))
        return layers.matmul("bd,df->bf", h, w2, jnp.bfloat16).sum()

    def saved(remat):
        lines = saved_residuals(jax.checkpoint(f, policy=remat_policy(remat, fsdp=False)),
                                jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 16)),
                                jnp.ones((16, 16)))
        return [line.split()[0] for line in lines]
    assert saved("block") == ["bf16[8,16]"]
    assert saved("full") == []


def test_a_mamba2_layer_on_the_kernels_keeps_neither_chunk_states_nor_the_gated_norm(
        monkeypatch):
    # Without remat, the backward pass recomputes the SSD's per-chunk states (twice x's
    # bytes at d_state 128) and the gated norm's output (x's bytes) rather than keeping them
    # from the forward pass: what a layer keeps is its inputs, the projections, the conv's
    # output and the scan's output, all [b, l, ...] (and the weights in the compute dtype).
    import pallas_kernels.ssd as ssd
    monkeypatch.setattr(ssd, "kernels_are_faster", lambda x, B: True)  # the GPU's choice
    cfg = Mamba2Config(d_model=64, n_layer=1, vocab_size=16, mamba2=dict(
        d_state=32, headdim=16, chunk_size=16))
    block = Block(cfg, "M", rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    graphdef, state = nnx.split(block)
    b, l = 2, 64

    def loss(state, residual):
        stream = Stream.start(residual, jnp.bfloat16)
        return nnx.merge(graphdef, state)(stream)[0].value().sum()
    lines = saved_residuals(loss, state, jnp.zeros((b, l, 64), jnp.float32))
    assert any("pallas_call" in line for line in lines), lines  # the kernels' y
    assert not any("gated_rms_norm" in line for line in lines), lines
    assert all(line.split()[0].count(",") <= 3 for line in lines), lines  # no [b, c, h, p, n]


def test_a_mamba3_layer_on_the_kernels_keeps_no_rotated_per_head_terms(monkeypatch):
    # The forward kernel turns each head's B and C as it reads the group's, and the
    # backward pass makes its per-head turned copies inside the kernels' custom_vjp; it
    # recomputes the gate's and the angle sum's float32 terms too: what the
    # layer keeps is its input, the projections, the angle state theta and the scan's y and
    # gated output, nothing of shape [b, l, r, h, n] and nothing float32 the size of x.
    import pallas_kernels.mamba3 as mamba3
    monkeypatch.setattr(mamba3, "kernels_are_faster", lambda x, B: True)  # the GPU's choice
    cfg = Mamba2Config(d_model=64, n_layer=1, vocab_size=16, layer_pattern="3", mamba3=dict(
        d_state=32, headdim=16, chunk_size=16))
    block = Block(cfg, "3", rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    graphdef, state = nnx.split(block)
    b, l, h, n = 2, 64, 8, 32

    def loss(state, residual):
        stream = Stream.start(residual, jnp.bfloat16)
        return nnx.merge(graphdef, state)(stream)[0].value().sum()
    lines = saved_residuals(loss, state, jnp.zeros((b, l, 64), jnp.float32))
    assert any("ssd_weighted" in line for line in lines), lines  # the kernels' weights
    assert not any(f"[{b},{l},1,{h},{n}]" in line for line in lines), lines
    x_sized = [line for line in lines if line.startswith(f"f32[{b},{l},1,{h},16]")
               or line.startswith(f"f32[{b},{l},{h},16]")]
    assert not x_sized, x_sized
