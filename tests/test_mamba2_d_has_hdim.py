"""A Mamba2 layer with D per head channel (mamba2.D_has_hdim, mamba_ssm's D_has_hdim: its D of
d_inner, our D [h, p]): the layer against a float64 oracle written from its definition
(values and every gradient, D's per channel), on the XLA path (the fused mixer on the
kernels equals it: tests/test_mamba2_mixer.py); the decoding steps (XLA's, the step
kernel's and the fused block's) against the forward, where mamba_ssm's own step broadcasts D
per head; the mamba_ssm
checkpoint layout both ways (D of d_inner, in its (h p) order), the layouts without it
refusing it. Its tensor-parallel split of D's heads: tests/test_kernel_path.py's cp x tp case.

Tolerances, float32 against float64 (O(1) values): outputs within 2e-5 absolute; gradients
within 1e-4 relative + 1e-5 of the parameter's largest (float32 sums over 2 x 21 positions);
steps within 1e-4 of the forward's logits (the recurrence against the chunked scan, as
tests/test_model.py's).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from mamba_jax import Mamba2Config, Mamba2LM, from_pretrained, save_pretrained
from mamba_jax.layers.mamba2 import Mamba2Mixer
from pallas_kernels.ssd.reference import ssd_naive

CFG = Mamba2Config(d_model=32, n_layer=2, vocab_size=50, d_state=16, headdim=16, ngroups=2,
                   chunk_size=16, **{"mamba2.D_has_hdim": True})
SEQ_IDX = np.array([[0] * 9 + [1] * 12, [0] * 21])


def randomised(module, seed):
    """module with its D (and the other parameters that start constant: dt_bias aside, the
    norm) drawn per entry, so that a D read per head would show."""
    state = nnx.state(module, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    for path, v in nnx.to_flat_state(state):
        if path[-1] in ("D", "norm"):
            v.set_value(1 + 0.5 * jax.random.normal(next(keys), v.shape))
    nnx.update(module, state)
    return module


def oracle(params, u, seq_idx, cfg=CFG):
    """The mixer's output [b, l, d] from its parameters, in float64 (jax x64): the
    projections, the conv per document, the recurrence (ssd_naive without its D), y + D * x
    channel by channel, the gated norm per group and out_proj."""
    m = cfg.mamba2
    b, l, _ = u.shape
    (_, h, p), (_, g, n), k = params["x_proj"].shape, params["B_proj"].shape, m.d_conv
    z = jnp.einsum("bld,dhp->blhp", u, params["z_proj"])
    xBC = jnp.concatenate([jnp.einsum("bld,d...->bl...", u, params[r]).reshape(b, l, -1)
                           for r in ("x_proj", "B_proj", "C_proj")], -1)
    w = jnp.concatenate([params[r + "_conv"].reshape(k, -1) for r in "xBC"], -1)
    bias = jnp.concatenate([params[r + "_conv_bias"].reshape(-1) for r in "xBC"])
    same = seq_idx[:, :, None] == seq_idx[:, None, :]  # [b, t, s]
    taps = [jnp.where(same[:, t, max(t - k + 1, 0):t + 1, None],
                      xBC[:, max(t - k + 1, 0):t + 1], 0.0) for t in range(l)]
    conv = jnp.stack([bias + jnp.einsum("bje,je->be", tap, w[k - tap.shape[1]:])
                      for tap in taps], 1)
    xBC = jax.nn.silu(conv)
    x = xBC[..., :h * p].reshape(b, l, h, p)
    B, C = (t.reshape(b, l, g, n) for t in jnp.split(xBC[..., h * p:], 2, axis=-1))
    dt = jnp.einsum("bld,dh->blh", u, params["dt_proj"])
    y, _ = ssd_naive(x, dt, -jnp.exp(params["A_log"]), B, C, dt_bias=params["dt_bias"],
                     dt_softplus=True, seq_idx=jnp.asarray(seq_idx))
    y = y + params["D"] * x
    gated = (y * jax.nn.silu(z)).reshape(b, l, g, -1)
    normed = gated * jax.lax.rsqrt(jnp.mean(gated ** 2, -1, keepdims=True) + cfg.norm_eps)
    return jnp.einsum("blhp,hpd->bld", normed.reshape(b, l, h, p) * params["norm"],
                      params["out_proj"])


def test_a_D_per_head_channel_matches_the_float64_oracle():
    mixer = randomised(Mamba2Mixer(CFG, rngs=nnx.Rngs(0)), 1)
    assert mixer.D[...].shape == (4, 16)  # [h, p]
    graphdef, params = nnx.split(mixer)
    u = jax.random.normal(jax.random.key(2), (2, 21, CFG.d_model))
    weight = jax.random.normal(jax.random.key(3), u.shape)
    flat = lambda params: {path[0]: v[...] for path, v in nnx.to_flat_state(params)}

    def objective(params, u):
        out, _ = nnx.merge(graphdef, params)(u, jnp.asarray(SEQ_IDX))
        return jnp.vdot(out, weight), out
    (_, out), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))(
        params, u)
    with jax.enable_x64(True):
        up = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (flat(params), u, weight))
        reference = lambda params, u: jnp.vdot(oracle(params, u, SEQ_IDX), up[2])
        want = oracle(*up[:2], SEQ_IDX)
        want_grads = jax.jit(jax.grad(reference, argnums=(0, 1)))(*up[:2])
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-5)
    got = {**flat(grads[0]), "u": grads[1]}
    for name, r in {**want_grads[0], "u": want_grads[1]}.items():
        r = np.asarray(r)
        assert np.abs(r).max() > 0, name
        np.testing.assert_allclose(got[name], r, rtol=1e-4, atol=1e-5 * np.abs(r).max(),
                                   err_msg=name)


@pytest.fixture(scope="module")
def model():
    return randomised(Mamba2LM(CFG.replace(tie_embeddings=False), rngs=nnx.Rngs(4)), 5)


@pytest.mark.parametrize("how", ["xla", "kernel", "fused"])
def test_the_steps_with_D_per_channel_equal_the_forward(model, how):
    """mamba_ssm's step passes its D to selective_state_update as repeat(D, "h -> h p"),
    which a D of d_inner does not fit; ours reads each channel's D in every step form."""
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 50, (1, 9)))
    full = model(ids)
    logits, cache = model.prefill(ids[:, :5])
    steps = (how,) * len(model.layers)
    cache = model.cache_for_decoding(cache, steps)
    step = nnx.jit(lambda model, t, c: model.step(t, c, steps=steps))
    for t in range(5, 9):
        logits, cache = step(model, ids[:, t], cache)
        np.testing.assert_allclose(logits, full[:, t], rtol=1e-4, atol=1e-4)


def test_the_mamba_ssm_layout_holds_D_of_d_inner_both_ways(model, tmp_path):
    save_pretrained(model, tmp_path / "out", format="mamba_ssm")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["ssm_cfg"]["D_has_hdim"] is True
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    D = np.asarray(model.layers[0].mixer.D[...])
    # mamba_ssm's D [d_inner], read as rearrange(D, "(h p) -> h p")
    np.testing.assert_array_equal(tensors["backbone.layers.0.mixer.D"], D.reshape(-1))
    loaded = from_pretrained(tmp_path / "out")
    assert loaded.config.mamba2.D_has_hdim
    np.testing.assert_array_equal(loaded.layers[0].mixer.D[...], D)
    ids = jnp.asarray(np.random.default_rng(7).integers(0, 50, (2, 11)))
    np.testing.assert_array_equal(loaded(ids), model(ids))
    with pytest.raises(ValueError, match="NemotronH has one D a head"):
        save_pretrained(model, tmp_path / "nemotron_h", format="nemotron_h")
    assert not (tmp_path / "nemotron_h").exists()
    # "hf": transformers' Mamba2 has one D a head too, so the first layout that holds it
    from mamba_jax.convert import check_exportable, load_config
    from mamba_jax.formats import refusal
    assert "transformers' Mamba2 has one D a head" in refusal(model.config, "hf")
    assert check_exportable(model.config) == "mamba_ssm"
    save_pretrained(model, tmp_path / "hf")
    assert load_config(tmp_path / "hf")[1] == "mamba_ssm"
