"""States in and out of the model: the forward over [a; b] equals the forward over a, then over
b from a's final states (values, and gradients into a's part through the states), on one
device and under a mesh; a learnable initial state that trains and is checkpointed; a
prefill that continues a cache.

Tolerances, float32: logits and hidden states within 1e-5 absolute (O(1) values; the scan
of [a; b] and of a then b add the same terms in another chunking); gradients within 1e-5
of the parameter's largest gradient + 1e-4 relative (float32 sums in another order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from mamba_jax import Mamba2Config, Mamba2LM, parallel
from mamba_jax.convert import from_pretrained, save_pretrained
from mamba_jax.checkpoint import Checkpointer
from mamba_jax.init_from import load_training_checkpoint
from mesh_check import FAST_COMPILE, take_the_kernels, tiny_config

CUT, SEQ = 13, 32  # a's length: not a multiple of the chunk (16)
CFG = tiny_config(n_layer=3, layer_pattern="MM-", d_model=32, mlp=dict(d_intermediate=32))


def batch(cfg, rows=2, seq=SEQ, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)
    # Row 0: one document across the cut; row 1: a document starts inside a, another in b.
    seq_idx = np.zeros((rows, seq), np.int32)
    seq_idx[1, 5:] = 1
    seq_idx[1, 20:] = 2
    return ids, seq_idx


# A fixed random projection of the hidden states [rows, SEQ, d]: a scalar whose gradient
# reaches every position (a sum of squares of normed outputs would mostly cancel).
WEIGHT = np.random.default_rng(9).standard_normal((2, SEQ, CFG.d_model)).astype(np.float32)


def objective(hidden_fn):
    """A scalar of the hidden states of [a; b], whole or in two pieces joined by the states:
    hidden_fn(params, ids, seq_idx, initial_states, return_states)."""
    def whole(params, ids, seq_idx):
        hidden = hidden_fn(params, ids, seq_idx, None, False)
        return (hidden * WEIGHT).sum(), hidden

    def pieces(params, ids, seq_idx):
        h_a, states = hidden_fn(params, ids[:, :CUT], seq_idx[:, :CUT], None, True)
        h_b = hidden_fn(params, ids[:, CUT:], seq_idx[:, CUT:], states, False)
        joined = jnp.concatenate([h_a, h_b], axis=1)
        return (joined * WEIGHT).sum(), joined
    return whole, pieces


def assert_grads_close(grads, ref):
    """Within 1e-4 relative + 1e-5 of the parameter's largest gradient (float32 sums over
    the positions in another order, with another chunking)."""
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        assert np.all(np.isfinite(r))
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


@pytest.fixture(scope="module")
def one_device():
    """(graphdef, params, the hidden states of [a; b] and the gradients of `whole`)."""
    graphdef, params = nnx.split(Mamba2LM(CFG, rngs=nnx.Rngs(0)))

    def hidden_fn(params, ids, seq_idx, initial_states, return_states):
        return nnx.merge(graphdef, params).hidden(ids, seq_idx, initial_states=initial_states,
                                                  return_states=return_states)
    whole, pieces = objective(hidden_fn)

    @jax.jit
    def run(params, ids, seq_idx):
        (_, hidden), grads = jax.value_and_grad(whole, has_aux=True)(params, ids, seq_idx)
        (_, joined), joined_grads = jax.value_and_grad(pieces, has_aux=True)(params, ids,
                                                                             seq_idx)
        return hidden, grads, joined, joined_grads
    return graphdef, params, run(params, *batch(CFG))


def test_a_forward_continued_from_the_states_equals_the_whole_forward(one_device):
    _, _, (hidden, grads, joined, joined_grads) = one_device
    np.testing.assert_allclose(joined, hidden, rtol=0, atol=1e-5)
    # b's part reaches a's through the states: without them the gradients would differ.
    assert_grads_close(joined_grads, grads)


@pytest.mark.parametrize("kernels", [False, True], ids=["xla", "kernels"])
def test_states_continue_under_a_mesh(one_device, kernels, monkeypatch):
    # fsdp, cp and tp (sequence parallel) at once: the states of a's last cp device enter
    # b's first, and under tp each rank's conv window and heads' states go back to it.
    # kernels: the Mamba2 layers as the fused mixer on the kernels (in Pallas's
    # interpreter), against the one device's XLA path: its one group spans the tp ranks,
    # each reading it, the conv takes b's window and cp's halo and the scan the states.
    graphdef, params, (hidden, grads, _, _) = one_device
    calls = take_the_kernels(monkeypatch) if kernels else []
    mesh = parallel.make_mesh("fsdp=2,cp=2,tp=2")
    specs = parallel.param_specs(params, mesh)
    sharded_params = jax.device_put(params, parallel.shardings(mesh, specs))
    whole_fn = parallel.make_hidden_fn(graphdef, specs, mesh)
    states_fn = parallel.make_hidden_fn(graphdef, specs, mesh, return_states=True)

    def hidden_fn(params, ids, seq_idx, initial_states, return_states):
        return (states_fn if return_states else whole_fn)(params, ids, seq_idx,
                                                          initial_states)
    _, pieces = objective(hidden_fn)
    # a (13 tokens) and b (19) do not split over cp*tp = 4: the mesh runs them padded to 16
    # and 20, a's padding in front (a document of its own, which leaves no state) and b's
    # behind.
    ids, seq_idx = batch(CFG)
    def pad(x, before, after, value):
        return np.pad(x, ((0, 0), (before, after)) + ((0, 0),) * (x.ndim - 2),
                      constant_values=value)
    a_ids, b_ids = pad(ids[:, :CUT], 3, 0, 0), pad(ids[:, CUT:], 0, 1, 0)
    a_seq, b_seq = pad(seq_idx[:, :CUT], 3, 0, -1), pad(seq_idx[:, CUT:], 0, 1, 9)
    tokens = NamedSharding(mesh, parallel.TOKENS)

    def run(params, a_ids, a_seq, b_ids, b_seq):
        def loss(params):
            h_a, states = hidden_fn(params, a_ids, a_seq, None, True)
            h_b = hidden_fn(params, b_ids, b_seq, states, False)
            return (h_a * w_a).sum() + (h_b * w_b).sum(), (h_a, h_b)
        return jax.value_and_grad(loss, has_aux=True)(params)
    w_a, w_b = pad(WEIGHT[:, :CUT], 3, 0, 0), pad(WEIGHT[:, CUT:], 0, 1, 0)  # 0: padding
    (_, (h_a, h_b)), joined_grads = jax.jit(run, compiler_options=FAST_COMPILE)(
        sharded_params, *jax.device_put((a_ids, a_seq, b_ids, b_seq), tokens))
    joined = np.concatenate([np.asarray(h_a)[:, 3:], np.asarray(h_b)[:, :SEQ - CUT]], axis=1)
    np.testing.assert_allclose(joined, hidden, rtol=0, atol=1e-5)
    assert_grads_close(joined_grads, grads)
    assert bool(calls) == kernels


@pytest.mark.parametrize("layers", ["13", "M*"])
def test_every_kinds_states_from_a_mesh_are_the_one_devices(layers):
    """Each Mamba kind's state after the whole sequence under cp (the last part's, on every
    device: Mamba-1's and Mamba-3's were their own parts') and tp (Mamba-3's k [b, r, h, n]
    sharded over its heads, not its ranks); attention's, the keys of every token, named."""
    sections = {"3": {"mamba3.d_state": 16, "mamba3.headdim": 32},
                "*": {"attention.num_heads": 4, "attention.num_heads_kv": 2}}
    cfg = Mamba2Config.preset("tiny", n_layer=2, layer_pattern=layers, **{
        key: value for symbol in layers for key, value in sections.get(symbol, {}).items()})
    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    ids = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
    mesh = parallel.make_mesh("dp=2,cp=2,tp=2")
    specs = parallel.param_specs(params, mesh)
    sharded_params = jax.device_put(params, parallel.shardings(mesh, specs))
    states_fn = parallel.make_hidden_fn(graphdef, specs, mesh, return_states=True)
    if "*" in layers:
        with pytest.raises(ValueError, match=r"an attention layer's state is the keys and "
                                             r"values of every token"):
            states_fn(sharded_params, ids)
        return
    _, one = jax.jit(lambda params: nnx.merge(graphdef, params).hidden(
        ids, return_states=True))(params)
    _, sharded = jax.jit(states_fn)(sharded_params, jax.device_put(ids, NamedSharding(
        mesh, parallel.TOKENS)))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(sharded),
                                 jax.tree.leaves(one)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_prefill_continues_a_cache():
    cfg = tiny_config(n_layer=1, d_model=32)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(1))
    ids, _ = batch(cfg)
    prefill = jax.jit(lambda ids, cache: model.prefill(ids, cache=cache))
    logits, cache = prefill(ids, None)
    logits_a, cache_a = prefill(ids[:, :CUT], None)
    logits_b, cache_b = prefill(ids[:, CUT:], cache_a)
    np.testing.assert_allclose(jnp.concatenate([logits_a, logits_b], 1), logits, rtol=0,
                               atol=1e-5)
    for got, want in zip(jax.tree.leaves(cache_b), jax.tree.leaves(cache)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_learnable_initial_state_trains_and_is_checkpointed(tmp_path):
    cfg = tiny_config(n_layer=1, d_model=32, **{"mamba2.learnable_init_state": True})
    model = Mamba2LM(cfg, rngs=nnx.Rngs(2))
    mixer = model.layers[0].mixer
    assert not mixer.init_states[...].any()  # zeros at init
    ids, _ = batch(cfg)

    @nnx.jit
    def grads_and_logits(model, initial_states):
        grads = nnx.grad(lambda m: m.loss(ids[:, :-1], ids[:, 1:]).mean())(model)
        return grads, model(ids), model(ids, initial_states=initial_states)
    trained = jax.random.normal(jax.random.key(0), mixer.init_states.shape)
    mixer.init_states[...] = trained
    zeros = mixer.init_cache(2)
    zeros = (zeros._replace(ssm_state=jnp.zeros_like(zeros.ssm_state)),)
    grads, logits, from_zeros = grads_and_logits(model, zeros)
    assert np.abs(grads["layers"][0]["mixer"]["init_states"][...]).max() > 0  # it trains
    # It is the state a sequence starts from (and decoding: init_cache) where none is given.
    start = mixer.init_cache(2).ssm_state
    np.testing.assert_array_equal(start, jnp.broadcast_to(trained, start.shape))
    assert np.abs(logits - from_zeros).max() > 1e-3
    # Our (trainer's) checkpoints and our own layout hold it; a published layout asked for
    # by name refuses it, naming ours (NemotronH's config refusal named hf as the fix,
    # which has no tensor for it either).
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"params": nnx.state(model)}, {"config": {"model": cfg.to_dict(),
                                                           "train": {}}})
    ckpt.close()
    restored, _ = load_training_checkpoint(tmp_path)
    np.testing.assert_array_equal(restored.layers[0].mixer.init_states[...], trained)
    with pytest.raises(ValueError, match=r"format='nemotron_h' cannot express mamba2.dt_limit"
                                         r".*; no published layout holds it: "
                                         r"format='mamba_jax'"):
        save_pretrained(model, tmp_path / "named", format="nemotron_h")
    assert not (tmp_path / "named").exists()  # refused before its folder was made
    save_pretrained(model, tmp_path / "hf")  # the default: our own layout, as no other
    restored = from_pretrained(tmp_path / "hf")
    np.testing.assert_array_equal(restored.layers[0].mixer.init_states[...], trained)


def test_initial_states_for_a_layer_without_state_are_refused():
    # Traced, not run: the refusals are of the states' kinds, not their values.
    model = nnx.eval_shape(lambda: Mamba2LM(CFG, rngs=nnx.Rngs(3)))
    ids, _ = batch(CFG)
    # (MambaCache, MambaCache, None): the MLP has none
    states = nnx.eval_shape(lambda model: model.init_cache(2), model)
    with pytest.raises(ValueError, match=r"initial_states\[2\] \(or a prefill's cache\): "
                                         r"layer 2 is MLP"):
        nnx.eval_shape(lambda model: model(ids, initial_states=states[:2] + (states[0],)),
                       model)
    with pytest.raises(ValueError, match="give a state for all of them or for none"):
        nnx.eval_shape(lambda model: model(ids, initial_states=(states[0], None, None)), model)


def test_states_a_layer_cannot_take_back_are_refused_naming_it():
    """Mamba-1 layers give their states (return_states) but do not continue from one: the
    call and a prefill from its cache are refused, naming the layer and the ways on."""
    cfg = Mamba2Config.preset("tiny-mamba1", d_model=32, n_layer=1, layer_pattern="1")
    # Traced, not run: the refusals are of the states' kinds, not their values.
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.ones((1, 8), jnp.int32)
    _, states = nnx.eval_shape(lambda model: model(ids, return_states=True), model)
    refusal = (r"initial_states\[0\] \(or a prefill's cache\): layer 0 is Mamba1Mixer, which "
               r"cannot continue from a state \(Mamba2 layers can\); give None for it, or run "
               r"the whole sequence at once")
    with pytest.raises(ValueError, match=refusal):
        nnx.eval_shape(lambda model: model(ids, initial_states=states), model)
    _, cache = nnx.eval_shape(lambda model: model.prefill(ids), model)
    with pytest.raises(ValueError, match=refusal):
        nnx.eval_shape(lambda model: model.prefill(ids, cache=cache), model)
