"""Every registered layer kind (mamba_jax.layers.registry.KINDS), held to the same cases: its
parameters declare logical axes, its forward on a mesh equals one device's, its checkpoint
key tables invert, and its one-token steps (XLA, and its kernels in Pallas's interpreter)
follow its forward (a causal kind's; a non-causal kind has none), over int8 states too. A
new kind is tested here by being registered.

Each kind is tested in a model of the pattern `S M S S` (S its symbol): one layer of it
alone, then a run of two (the model scans a run); on a mesh, in a model of its one layer (the
layers' stack under a mesh is the same for every kind, tests/test_parallel.py's; the XLA
compile of the four layers took 2.5x as long), with tests/mesh_check.py's tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_jax import Mamba2LM
from mamba_jax.generate.plan import decode_plan
from mamba_jax.layers import checkpoint_keys
from mamba_jax.layers.registry import KINDS
from mamba_jax.sharding import logical_axes
from mesh_check import assert_matches_single_device, tiny_config

# Small sections for the kinds whose defaults are too large (or empty) for a tiny model.
# The Mamba layers 12 heads wide (192, not expand * d_model = 128: NemotronH's independent
# width), the attention's 4 x 8 = 32 not d_model either.
SECTIONS = dict(mamba2=dict(nheads=12),
                attention=dict(num_heads=4, num_heads_kv=2, head_dim=8, rotary_emb_dim=4,
                               qkv_bias=True, out_bias=True),
                mlp=dict(d_intermediate=48), mamba1=dict(d_state=8, chunk_size=8),
                # MIMO (the rank axis split with the heads), out-projection norm, one B/C
                # group (replicated on the tp ranks), rotary over all of d_state.
                mamba3=dict(d_state=16, headdim=16, chunk_size=16, is_mimo=True, mimo_rank=2,
                            is_outproj_norm=True, rope_fraction=1.0))
SYMBOLS = sorted(KINDS)
CAUSAL = [s for s in SYMBOLS if KINDS[s].causal]  # the kinds that decode one token at a time


def kind_config(symbol, **changes):
    pattern = symbol + "M" + 2 * symbol
    return tiny_config(n_layer=len(pattern), layer_pattern=pattern, **SECTIONS, **changes)


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_every_parameter_declares_its_logical_axes(symbol):
    model = nnx.eval_shape(lambda: Mamba2LM(kind_config(symbol), rngs=nnx.Rngs(0)))
    for path, variable in jax.tree_util.tree_leaves_with_path(
            nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        assert len(logical_axes(variable, jax.tree_util.keystr(path))) == variable.ndim


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_forward_on_a_mesh_matches_one_device(symbol):
    # fsdp, cp and tp (sequence parallel) at once, over packed documents.
    cfg = kind_config(symbol).replace(n_layer=1, layer_pattern=symbol)
    assert_matches_single_device(cfg, "fsdp=2,cp=2,tp=2", True, seq_len=64, packed=True)


@pytest.mark.parametrize("symbol,fmt", [(s, fmt) for s in SYMBOLS
                                        for fmt in sorted(KINDS[s].checkpoint_keys)])
def test_checkpoint_keys_invert(symbol, fmt):
    # The parameters the format holds (NemotronH has no attention biases and no SwiGLU gate:
    # mamba_jax.convert refuses to write a model that has them there).
    model = Mamba2LM(kind_config(symbol), rngs=nnx.Rngs(1))
    table = KINDS[symbol].checkpoint_keys[fmt]
    held = {p for entry in table.values() for p in entry.params}
    params = {name: np.asarray(v[...]) for name, v in vars(model.layers[0].mixer).items()
              if isinstance(v, nnx.Param) and name in held}
    assert params
    tensors = checkpoint_keys.to_torch(table, params)

    def take(key, shape):
        assert tensors[key].shape == shape, key
        return tensors.pop(key)
    back = checkpoint_keys.from_torch(table, take, {k: v.shape for k, v in params.items()})
    assert not tensors  # every tensor read
    assert back.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)


# The decoding cases' programs, jitted once for the module: the float32 and int8 cases of a
# kind share the prefill's and the XLA step's compiles (a model of the same structure, the
# same shapes). Prompts of 8 tokens, then 3 steps, 1 row (the fused step kernels' batch).
LENGTH, PROMPT = 11, 8
_prefill = nnx.jit(lambda model, ids: model.prefill(ids, cache_len=LENGTH))
_step = nnx.jit(lambda model, token, cache, steps: model.step(token, cache, steps=steps),
                static_argnums=3)


def decoding_case(symbol, seed):
    """(config, model, ids [1, LENGTH], the prefill's (logits, cache) of the first PROMPT)."""
    cfg = kind_config(symbol)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(seed))
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, LENGTH)))
    return cfg, model, ids, _prefill(model, ids[:, :PROMPT])


@pytest.mark.parametrize("symbol", CAUSAL)
def test_one_token_steps_follow_the_forward(symbol):
    # float32: the XLA step is the recurrence where the forward is the chunked scan (1e-4);
    # each step kernel the kind has, in Pallas's interpreter, equals the XLA step within
    # float32 sums in another order (1e-4).
    cfg, model, ids, (logits, cache) = decoding_case(symbol, 2)
    full = nnx.jit(lambda model, ids: model(ids))(model, ids)  # one compile, not one an op
    np.testing.assert_allclose(logits, full[:, :PROMPT], rtol=0, atol=1e-5)
    xla = ("xla",) * len(cfg.layers)
    kernels = decode_plan(model, 1, "triton").steps  # fused where a kind has it
    for t in range(PROMPT, LENGTH):
        logits, new_cache = _step(model, ids[:, t], cache, xla)
        np.testing.assert_allclose(logits, full[:, t], rtol=0, atol=1e-4)
        if set(kernels) != {"xla"}:
            logits_k, _ = _step(model, ids[:, t], cache, kernels)
            np.testing.assert_allclose(logits_k, logits, rtol=0, atol=1e-4)
        cache = new_cache


@pytest.mark.parametrize("symbol", CAUSAL)
def test_one_token_steps_over_int8_states_follow_float32s(symbol):
    # generate(ssm_state_dtype="int8"): a kind with an SSM state stores it as an Int8State
    # (int8 values, a float32 scale per row of d_state) and each step dequantises it,
    # steps in float32 and quantises afresh: three steps' logits within 2e-2 of the float32
    # cache's (a value is off by at most half its row's step, max / 254), not equal to them.
    from pallas_kernels.ssd.step import Int8State
    cfg, model, ids, (_, cache32) = decoding_case(symbol, 3)
    xla = ("xla",) * len(cfg.layers)
    cache8 = model.cache_for_decoding(cache32, xla, "int8")
    quantised = [isinstance(leaf, Int8State) for c in cache8
                 for leaf in jax.tree.leaves(c, is_leaf=lambda v: isinstance(v, Int8State))]
    # the kind's layers (positions 0, 2, 3) and the Mamba2 layer (1) hold Int8States where
    # they have SSM states; attention and MLP layers keep what they had
    assert sum(quantised) == (4 if KINDS[symbol].name in ("mamba1", "mamba2", "mamba3") else 1)
    worst = 0.0
    for t in range(PROMPT, LENGTH):
        logits32, cache32 = _step(model, ids[:, t], cache32, xla)
        logits8, cache8 = _step(model, ids[:, t], cache8, xla)
        assert np.all(np.isfinite(logits8))
        worst = max(worst, float(jnp.max(jnp.abs(logits8 - logits32))))
    assert 0.0 < worst < 2e-2, worst
