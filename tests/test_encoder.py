"""The bidirectional layer (B) against a float64 NumPy reference written from its definition
(mamba_jax/layers/bidirectional.py: a naive recurrence forward and backward, summed), with
packed documents; Mamba2Encoder's pooling and its inputs; one layer sharded by
parallel.make_block_fn. Its mesh equality (fsdp, cp,
tp at once, packed) is test_layer_kinds' for every kind.

Tolerances: float32 against float64, outputs within 2e-5 absolute (O(1) values).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import Mamba2Config, parallel
from mamba_jax.encoder import Mamba2Encoder
from mamba_jax.model import Stream
from mamba_jax.layers.bidirectional import BidirectionalMamba2

CFG = dict(d_model=16, n_layer=1, layer_pattern="B", vocab_size=20, d_state=4, headdim=8,
           chunk_size=8)
SEQ_IDX = np.array([[0] * 11 + [1] * 9, [0] * 20])


def reference(mixer, u, seq_idx):
    """The layer's output [b, l, d] in float64 from its parameters: per document, each
    token's output reads the conv of the inputs around it and both recurrences."""
    P = {".".join(map(str, path)): np.asarray(v[...], np.float64)
         for path, v in nnx.state(mixer).flat_state()}
    m = mixer.cfg.mamba2
    u = np.asarray(u, np.float64)
    b, l, _ = u.shape
    h, p, g, n, k = P["dt_bias"].shape[0], m.headdim, m.ngroups, m.d_state, m.d_conv
    z = np.einsum("bld,dhp->blhp", u, P["z_proj"])
    xBC = np.concatenate([np.einsum("bld,d...->bl...", u, P[r]).reshape(b, l, -1)
                          for r in ("x_proj", "B_proj", "C_proj")], -1)
    dt_raw = np.einsum("bld,dh->blh", u, P["dt_proj"])
    silu = lambda a: a / (1 + np.exp(-a))

    def conv(suffix, left):
        w = np.concatenate([P[r + "_conv" + suffix].reshape(k, -1) for r in "xBC"], -1)
        bias = np.concatenate([P[r + "_conv_bias" + suffix].reshape(-1) for r in "xBC"])
        out = np.zeros_like(xBC)
        for i in range(b):
            for t in range(l):
                acc = bias.copy()
                for j in range(k):
                    s = t - left + j
                    if 0 <= s < l and seq_idx[i, s] == seq_idx[i, t]:
                        acc += w[j] * xBC[i, s]
                out[i, t] = silu(acc)
        return out

    def scan(xBC_conv, suffix, order):
        x = xBC_conv[..., :h * p].reshape(b, l, h, p)
        B = xBC_conv[..., h * p:h * p + g * n].reshape(b, l, g, n)
        C = xBC_conv[..., h * p + g * n:].reshape(b, l, g, n)
        dt = np.logaddexp(0, dt_raw + P["dt_bias" + suffix])
        A = -np.exp(P["A_log" + suffix])
        y = np.zeros((b, l, h, p))
        for i in range(b):
            state, prev = np.zeros((h, p, n)), None
            for t in order:
                if seq_idx[i, t] != prev:
                    state, prev = np.zeros((h, p, n)), seq_idx[i, t]
                grp = np.arange(h) // (h // g)
                state = (np.exp(dt[i, t] * A)[:, None, None] * state
                         + dt[i, t][:, None, None] * x[i, t][:, :, None] * B[i, t, grp][:, None])
                y[i, t] = np.einsum("hpn,hn->hp", state, C[i, t, grp]) \
                    + P["D" + suffix][:, None] * x[i, t]
        return y
    if mixer.cfg.bidirectional.centred_conv:
        forward = backward = conv("", (k - 1) // 2)
    else:
        forward, backward = conv("", k - 1), conv("_b", 0)
    y = scan(forward, "", range(l)) + scan(backward, "_b", range(l - 1, -1, -1))
    gated = y * silu(z)
    grouped = gated.reshape(b, l, g, -1)
    normed = grouped / np.sqrt((grouped ** 2).mean(-1, keepdims=True) + mixer.cfg.norm_eps)
    return np.einsum("blhp,hpd->bld", normed.reshape(b, l, h, p) * P["norm"], P["out_proj"])


@pytest.mark.parametrize("centred", [True, False])
def test_bidirectional_layer_matches_its_definition(centred):
    cfg = Mamba2Config(**CFG, **{"bidirectional.centred_conv": centred})
    mixer = BidirectionalMamba2(cfg, rngs=nnx.Rngs(0))
    # Each direction's own D, dt_bias and A_log, unlike each other: at init every D is one,
    # and a backward direction that read the forward's would pass
    keys = iter(jax.random.split(jax.random.key(2), 6))
    for name in ("D", "D_b", "dt_bias", "dt_bias_b", "A_log", "A_log_b"):
        value = getattr(mixer, name)
        value[...] = jax.random.uniform(next(keys), value.shape, minval=-1.0, maxval=1.5)
    u = jax.random.normal(jax.random.key(1), (2, 20, 16))
    out, cache = mixer(u, jnp.asarray(SEQ_IDX))
    assert cache is None
    np.testing.assert_allclose(out, reference(mixer, u, SEQ_IDX), rtol=0, atol=2e-5)


def test_encoder_pools_the_tokens_it_is_given():
    encoder = Mamba2Encoder(Mamba2Config(**CFG), rngs=nnx.Rngs(2))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 20, (2, 20)))
    tokens = encoder(ids)
    assert tokens.shape == (2, 20, 16)
    mask = jnp.arange(20)[None] < jnp.array([[20], [7]])
    np.testing.assert_allclose(encoder(ids, mask=mask, pool="mean"),
                               [tokens[0].mean(0), tokens[1, :7].mean(0)], rtol=1e-6)
    # Features in place of token ids skip the embedding: its rows give the same outputs.
    np.testing.assert_allclose(encoder(encoder.embedding[...][ids]), tokens, rtol=1e-6)
    with pytest.raises(ValueError, match=r"features of shape \(2, 20, 8\)"):
        encoder(jnp.zeros((2, 20, 8)))
    with pytest.raises(ValueError, match="pool='max'"):
        encoder(ids, pool="max")
    with pytest.raises(ValueError, match="Mamba2Encoder: inputs is a list; give an array"):
        encoder(ids.tolist())  # an AttributeError on its dtype
    # Per-token inputs of another shape, and a mask nothing would read, are named.
    with pytest.raises(ValueError, match=r"Mamba2Encoder: mask has shape \(2, 7\); it takes "
                                         r"one value per token, the inputs' \[batch, seqlen\] "
                                         r"= \(2, 20\)"):
        encoder(ids, mask=mask[:, :7], pool="mean")
    with pytest.raises(ValueError, match="mask selects the tokens pool='mean' averages"):
        encoder(ids, mask=mask)
    for inputs in (ids, encoder.embedding[...][ids]):
        with pytest.raises(ValueError, match=r"seq_idx has shape \(20,\)"):
            encoder(inputs, jnp.zeros(20, jnp.int32))


def test_encoder_layers_one_after_the_other_give_the_scans_outputs_and_gradients(layer_scans):
    # make_hidden_fn's scan_layers=False over packed documents, two B layers (one scan
    # otherwise): no layer scan, the same outputs and every parameter's gradient.
    encoder = Mamba2Encoder(Mamba2Config(**dict(CFG, n_layer=2, layer_pattern="BB")),
                            rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(encoder)
    mesh = parallel.make_mesh("dp=2,tp=2,cp=2")
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    rows = NamedSharding(mesh, parallel.TOKENS)
    ids = jax.device_put(np.random.default_rng(1).integers(0, 20, (2, 20)).astype(np.int32),
                         rows)
    seq_idx = jax.device_put(SEQ_IDX.astype(np.int32), rows)

    # A fixed random direction of the outputs (their squares' sum would be nearly constant
    # after the final RMS norm: gradients of rounding noise).
    direction = jnp.asarray(np.random.default_rng(5).normal(size=(2, 20, 16)), jnp.float32)

    def outputs_and_grads(scan_layers):
        hidden = parallel.make_hidden_fn(graphdef, specs, mesh, scan_layers=scan_layers)
        loss = lambda params: (hidden(params, ids, seq_idx) * direction).sum()
        return jax.jit(lambda p: (hidden(p, ids, seq_idx), jax.grad(loss)(p)))(params)
    out, grads = outputs_and_grads(False)
    assert not layer_scans
    ref_out, ref_grads = outputs_and_grads(True)
    assert layer_scans and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-5)
    # float32 sums in another order: within 1e-5 of each parameter's largest gradient (seen
    # 2e-6).
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(jnp.abs(r).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_one_sharded_layer_matches_one_device():
    # parallel.make_block_fn: fsdp, cp and tp (sequence parallel) at once; float32 sums over
    # tp ranks in another order (1e-5).
    cfg = Mamba2Config(**{**CFG, "d_model": 32})
    graphdef, params = nnx.split(Mamba2Encoder(cfg, rngs=nnx.Rngs(3)).layers[0])
    mesh = parallel.make_mesh("fsdp=2,cp=2,tp=2")
    specs = parallel.param_specs(params, mesh)
    residual = jax.random.normal(jax.random.key(4), (2, 16, 32))
    seq_idx = jnp.asarray(np.repeat([[0] * 7 + [1] * 9], 2, 0))
    block = jax.jit(parallel.make_block_fn(graphdef, specs, mesh))
    out = block(jax.device_put(params, parallel.shardings(mesh, specs)),
                jax.device_put(residual, NamedSharding(mesh, P(("dp", "fsdp"), ("cp", "tp")))),
                jax.device_put(seq_idx, NamedSharding(mesh, parallel.TOKENS)))
    want = nnx.merge(graphdef, params)(Stream.start(residual, jnp.float32), seq_idx)[0].value()
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
