import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_jax import Mamba2Config, Mamba2LM


def tiny(**overrides):
    return Mamba2Config.preset("tiny", n_layer=2, d_model=64, d_state=16, headdim=16,
                               chunk_size=16, **overrides)


def test_initialisation_follows_mamba_ssm():
    cfg = Mamba2Config.preset("tiny", d_model=256, n_layer=4, headdim=8)  # 64 heads
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    mixer = model.layers[0].mixer
    m = cfg.mamba2
    dt = jax.nn.softplus(mixer.dt_bias[...])
    assert jnp.all(dt >= m.dt_min * 0.999) and jnp.all(dt <= m.dt_max * 1.001)
    # log-uniform: the median sits near the geometric mean of the range
    assert abs(math.log(float(jnp.median(dt))) - math.log(math.sqrt(m.dt_min * m.dt_max))) < 0.7
    A = jnp.exp(mixer.A_log[...])
    assert jnp.all(A >= 1.0) and jnp.all(A <= 16.0) and float(A.max() - A.min()) > 8
    np.testing.assert_array_equal(mixer.D[...], 1.0)
    # out_proj: U(+-1/sqrt(d_inner)) / sqrt(n_layer)
    bound = 1 / math.sqrt(m.expand * cfg.d_model) / math.sqrt(cfg.n_layer)
    assert float(jnp.abs(mixer.out_proj[...]).max()) <= bound
    assert float(jnp.abs(mixer.out_proj[...]).max()) > 0.9 * bound
    assert abs(float(jnp.std(model.embedding[...])) - 0.02) < 0.002
    assert all(leaf.dtype == jnp.float32
               for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("tie", [True, False])
def test_forward_shapes_and_tied_head(tie):
    cfg = tiny(tie_embeddings=tie, vocab_size=250)  # padded to 256
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((2, 21), jnp.int32) + 7)
    assert logits.shape == (2, 21, 256) and logits.dtype == jnp.float32
    assert hasattr(model, "lm_head") != tie


def test_the_scan_and_the_step_get_A_dt_and_D_in_float32_under_bf16(monkeypatch):
    # A = -exp(A_log) computed in bf16 would round A to 3 significant digits (mamba_ssm's
    # float32 A_log rule): the scan must receive A, dt_bias and D in float32, and so must
    # the one-token step.
    from mamba_jax.layers import mamba2
    seen = {}

    def spy(x, dt, A, B, C, **kw):
        fn, args = kw["inputs"]  # x, B, C = fn(*args): the conv
        seen.update(x=jax.eval_shape(fn, *args)[0].dtype, A=A.dtype, D=kw["D"].dtype,
                    dt_bias=kw["dt_bias"].dtype)
        return ssd(x, dt, A, B, C, **kw)
    ssd = mamba2.ssd
    monkeypatch.setattr(mamba2, "ssd", spy)
    model = Mamba2LM(tiny(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    model(jnp.zeros((1, 8), jnp.int32))
    assert seen == dict(x=jnp.bfloat16, A=jnp.float32, D=jnp.float32, dt_bias=jnp.float32)
    mixer = model.layers[0].mixer
    A = mixer.step_weights().A
    assert A.dtype == jnp.float32
    # float32's exp, within 1e-6 of float64's (bf16 would be 4e-3 off).
    np.testing.assert_allclose(A, -np.exp(np.asarray(mixer.A_log[...], np.float64)),
                               rtol=1e-6)


def test_bfloat16_compute_keeps_ssm_parameters_and_state_in_float32():
    cfg = tiny(ngroups=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 40)))
    f32 = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    bf16 = Mamba2LM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    mixer = bf16.layers[0].mixer
    assert mixer.A_log[...].dtype == mixer.D[...].dtype == mixer.dt_bias[...].dtype == jnp.float32
    _, cache = bf16.prefill(ids)
    assert cache[0].ssm_state.dtype == jnp.float32
    ref = f32(ids)
    out = bf16(ids)
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 3e-2


@pytest.mark.parametrize("ngroups,prompt", [(1, 5), (2, 23)])
def test_prefill_then_steps_equal_the_full_forward(ngroups, prompt):
    cfg = tiny(ngroups=ngroups, tie_embeddings=False)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(1))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 40)))
    full = model(ids)
    logits, cache = model.prefill(ids[:, :prompt])
    np.testing.assert_allclose(logits, full[:, :prompt], rtol=1e-5, atol=1e-5)
    step = jax.jit(lambda g, s, t, c: nnx.merge(g, s).step(t, c))
    graphdef, state = nnx.split(model)
    for t in range(prompt, 40):
        logits, cache = step(graphdef, state, ids[:, t], cache)
        # float32; the step is the recurrence, the forward the chunked scan
        np.testing.assert_allclose(logits, full[:, t], rtol=1e-4, atol=1e-4)


def test_packed_documents_equal_separate_sequences():
    cfg = tiny()
    model = Mamba2LM(cfg, rngs=nnx.Rngs(2))
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (1, 30)))
    seq_idx = jnp.asarray([[0] * 12 + [1] * 18])
    packed = model(ids, seq_idx=seq_idx)
    separate = jnp.concatenate([model(ids[:, :12]), model(ids[:, 12:])], axis=1)
    np.testing.assert_allclose(packed, separate, rtol=1e-5, atol=1e-5)


def test_residual_in_fp32_off_keeps_the_stream_in_compute_dtype():
    model = Mamba2LM(tiny(residual_in_fp32=False), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert model.embed(jnp.zeros((1, 3), jnp.int32)).dtype == jnp.bfloat16
    model = Mamba2LM(tiny(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert model.embed(jnp.zeros((1, 3), jnp.int32)).dtype == jnp.float32


@pytest.mark.parametrize("loss_chunk", [0, 5])
def test_a_loss_chunk_that_does_not_divide_the_sequence_is_named(loss_chunk):
    model = Mamba2LM(tiny(), rngs=nnx.Rngs(0))
    ids = jnp.zeros((1, 12), jnp.int32)
    with pytest.raises(ValueError, match=f"loss_chunk={loss_chunk} must be a positive "
                                         "divisor of the sequence length 12"):
        model.loss(ids, ids, loss_chunk=loss_chunk)


def test_inputs_of_the_wrong_shape_or_dtype_are_named_before_any_layer():
    # They were broadcasting and indexing errors deep in a layer (or a conv's channel count).
    model = Mamba2LM(tiny(), rngs=nnx.Rngs(0))
    ids = jnp.zeros((2, 8), jnp.int32)
    _, states = model(ids, return_states=True)
    _, other_states = Mamba2LM(tiny().replace(**{"mamba2.d_state": 8}), rngs=nnx.Rngs(0))(
        ids, return_states=True)
    for call, match in [
            (lambda: model(ids[0]), r"Mamba2LM: input_ids of shape \(8,\) and dtype int32; "
                                    r"give \[batch, seqlen\] integer token ids"),
            (lambda: model(ids.astype(jnp.float32)), r"and dtype float32"),
            # a list has no dtype: jnp.result_type's TypeError; no token: the conv's message
            (lambda: model([[1, 2]]), r"Mamba2LM: input_ids is a list; give an array"),
            (lambda: model(ids[:, :0]), r"Mamba2LM: input_ids of shape \(2, 0\) hold no token"),
            # the gather wrapped -1 to the last row, and a row past the last made NaN; a
            # target of -100 (an ignore index elsewhere) scored the logsumexp alone
            (lambda: model(ids.at[0, 3].set(-1)), r"Mamba2LM: input_ids hold \[-1\], outside "
                                                  r"the model's token ids \[0, 256\)"),
            (lambda: model.prefill(ids.at[1, 0].set(256)), r"input_ids hold \[256\]"),
            (lambda: model.loss(ids, ids.at[0, 0].set(-100)),
             r"Mamba2LM.loss: targets hold \[-100\], outside the model's token ids \[0, 256\); "
             r"there is no ignore index"),
            (lambda: model.loss(ids, ids.astype(jnp.float32)), r"targets of dtype float32"),
            (lambda: model(ids, ids.astype(jnp.float32)), r"seq_idx of dtype float32"),
            (lambda: model(ids, ids[:, :4]), r"Mamba2LM: seq_idx has shape \(2, 4\); it "
                                             r"takes one value per token, the inputs' "
                                             r"\[batch, seqlen\] = \(2, 8\)"),
            (lambda: model.loss(ids, ids[:, 1:]), r"Mamba2LM.loss: targets has shape \(2, 7\)"),
            (lambda: model.prefill(ids, ids[0]), r"Mamba2LM.prefill: seq_idx has shape \(8,\)"),
            # states of another batch, or not the layer's kind: a concatenation's or an
            # attribute's error inside
            (lambda: model(ids[:1], initial_states=states), r"initial_states\[0\] holds "
                                                           r"states of \[2\] rows for a "
                                                           r"batch of 1"),
            (lambda: model(ids, initial_states=[s.ssm_state for s in states]),
             r"initial_states\[0\] is \w+, not the MambaCache layer 0 takes"),
            # a conv window of another length was read without an error (other numbers), a
            # state of another model failed in a concatenation
            (lambda: model(ids, initial_states=[s._replace(conv_state=s.conv_state[..., :2])
                                                for s in states]),
             r"initial_states\[0\] holds arrays of shapes \[\(\d+, 2\), .*\] a row, where "
             r"layer 0 takes \[\(\d+, 4\), "),
            (lambda: model(ids, initial_states=other_states), r"the states of another model")]:
        with pytest.raises(ValueError, match=match):
            call()
    # A field given as None is zeros (the shapes are checked field by field)
    zeros = [s._replace(conv_state=jnp.zeros_like(s.conv_state)) for s in states]
    np.testing.assert_array_equal(
        model(ids, initial_states=[s._replace(conv_state=None) for s in states]),
        model(ids, initial_states=zeros))


def test_the_layers_one_after_the_other_are_traced_once_a_run(monkeypatch):
    """scan_layers=False: a run's four layers are one function traced once and called per
    layer (a jit: its jaxpr, its derivatives' and its lowering reused), not four traces,
    with the gradient taken; the loss is the scan's."""
    from mamba_jax import model as model_module
    traces = []
    block_call = model_module.Block.__call__
    monkeypatch.setattr(model_module.Block, "__call__",
                        lambda self, *a, **k: traces.append(1) or block_call(self, *a, **k))
    cfg = Mamba2Config(d_model=32, n_layer=4, vocab_size=32,
                       mamba2=dict(d_state=8, headdim=8, chunk_size=8))
    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, 32)

    def loss(params, scan_layers):
        model = nnx.merge(graphdef, params)
        return model.loss(ids[:, :-1], ids[:, 1:], scan_layers=scan_layers).mean()
    value, grads = jax.value_and_grad(loss)(params, False)
    assert len(traces) == 1
    assert np.isfinite(float(value)) and all(
        np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(value, loss(params, True), rtol=1e-6)


def _largest_value(jaxpr) -> int:
    """The most elements of any value a jaxpr computes, its inner jaxprs' included."""
    most = 0
    for eqn in jaxpr.eqns:
        most = max([most, *(math.prod(v.aval.shape) for v in eqn.outvars
                            if hasattr(v.aval, "shape"))])
        for param in eqn.params.values():
            for inner in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if isinstance(inner, jax.extend.core.Jaxpr):
                    most = max(most, _largest_value(inner))
    return most


def test_a_chunk_size_far_above_the_sequence_pads_no_whole_chunk():
    """The chunked scans padded a sequence to a whole chunk: chunk_size 65536 over 8 tokens
    made [8, 65536, ...] values and a [65536, 65536] decay matrix a layer (out of memory,
    the trainer naming the batch). A chunk over the whole sequence is the same scan (the
    scans' tests hold every chunk size to their oracles)."""
    sections = dict(chunk_size=65536, headdim=16, d_state=8)
    cfg = Mamba2Config(d_model=32, n_layer=2, layer_pattern="M3", vocab_size=64,
                       mamba2=sections, mamba3=sections)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)))
    graphdef, state = nnx.split(model)
    logits = lambda state, ids: nnx.merge(graphdef, state)(ids)
    assert _largest_value(jax.make_jaxpr(logits)(state, ids).jaxpr) < 20_000  # the embedding
