"""The trainer's loss over a loss mask (instruction data): the mean over the counted tokens
of the whole global batch, the same on one device, on every mesh and at every --grad-accum;
a target outside the mask adds exactly nothing; without a mask, today's mean. On 8 fake CPU
devices (conftest.py); tolerances as tests/mesh_check.py states them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import Mamba2LM, parallel
from mamba_jax.optim import make_optimizer, make_train_step
from mesh_check import FAST_COMPILE, GRAD_ATOL, GRAD_RTOL, LOGIT_ATOL, LOSS_RTOL, tiny_config

ROWS, SEQ = 8, 32
CFG = tiny_config(n_layer=1)


@functools.cache
def model_and_batch():
    """(graphdef, params, (inputs, targets, seq_idx, loss_mask)) [ROWS, SEQ]: packed
    documents, a mask of a few spans per row that counts different numbers of tokens in
    each row (none in row 5), so that a mean of row or micro-batch means differs from the
    mean over the counted tokens."""
    model = Mamba2LM(CFG, rngs=nnx.Rngs(0))
    # logits of O(1)-O(10) (the tied head's rows x 30), not a near-uniform guess: the tokens'
    # losses then differ, and so do the means the tests tell apart
    model.embedding[...] = 30 * model.embedding[...]
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (ROWS, SEQ + 1)).astype(np.int32)
    seq_idx = np.cumsum(rng.random((ROWS, SEQ)) < 0.08, axis=1).astype(np.int32)
    mask = np.zeros((ROWS, SEQ), bool)
    for row in range(ROWS):
        for start in rng.integers(0, SEQ, 1 + row % 3):
            mask[row, start:start + rng.integers(1, 3 + 4 * row)] = True
    mask[5] = False
    return graphdef, params, (ids[:, :-1], ids[:, 1:], seq_idx, mask)


def reference(params, inputs, targets, seq_idx, mask):
    """One device: the model's logits, optax's cross-entropy, sum(mask * loss) / sum(mask)."""
    graphdef = model_and_batch()[0]
    losses = optax.softmax_cross_entropy_with_integer_labels(
        nnx.merge(graphdef, params)(inputs, seq_idx), targets)
    return jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.sum(mask)


@functools.cache
def reference_value_and_grad():
    """(loss, gradients) of reference for model_and_batch(), on one device: computed once
    for every mesh it is compared on."""
    _, params, batch = model_and_batch()
    return jax.jit(jax.value_and_grad(reference), compiler_options=FAST_COMPILE)(params, *batch)


@functools.cache
def sharded_value_and_grad(spec):
    """(jitted value_and_grad of make_loss_fn on `spec`, params and a function placing a
    batch there)."""
    graphdef, params, _ = model_and_batch()
    mesh = parallel.make_mesh(spec)
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    loss = parallel.make_loss_fn(graphdef, specs, mesh)
    place = lambda batch: jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))
    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE), params, place


def assert_close(grads, ref_grads):
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("spec", ["dp=8", "dp=2,cp=2,tp=2"])
def test_the_masked_loss_is_the_mean_over_counted_tokens_on_every_mesh(spec):
    _, params, batch = model_and_batch()
    ref_value, ref_grads = reference_value_and_grad()
    assert np.isfinite(float(ref_value))
    step, placed_params, place = sharded_value_and_grad(spec)
    value, grads = step(placed_params, *place(batch))
    np.testing.assert_allclose(value, ref_value, rtol=0, atol=LOGIT_ATOL)
    assert_close(grads, ref_grads)
    # the mean of the rows' means is another number: the test tells them apart
    per_row = np.asarray(jax.jit(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        nnx.merge(model_and_batch()[0], p)(batch[0], batch[2]), batch[1]))(params))
    rows = batch[3].any(-1)
    row_means = (per_row * batch[3]).sum(-1)[rows] / batch[3].sum(-1)[rows]
    assert abs(row_means.mean() - float(ref_value)) > 100 * LOGIT_ATOL


def test_targets_outside_the_mask_change_neither_the_loss_nor_any_gradient():
    """Other ids at every masked-out target: the same loss and gradients, to the bit (a
    target outside the mask adds exactly nothing); the same change inside the mask moves
    them (the mask is what keeps them out)."""
    _, _, (inputs, targets, seq_idx, mask) = model_and_batch()
    step, params, place = sharded_value_and_grad("dp=8")
    value, grads = step(params, *place((inputs, targets, seq_idx, mask)))
    other = np.where(mask, targets, (targets + 1 + np.arange(SEQ)) % CFG.vocab_size)
    assert (other != targets).sum() > ROWS * SEQ // 2
    value2, grads2 = step(params, *place((inputs, other.astype(np.int32), seq_idx, mask)))
    assert float(value2) == float(value)
    for g, g2 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        np.testing.assert_array_equal(g2, g)
    moved = np.where(mask, (targets + 1) % CFG.vocab_size, targets).astype(np.int32)
    assert float(step(params, *place((inputs, moved, seq_idx, mask)))[0]) != float(value)


def test_an_all_ones_mask_gives_todays_loss_and_gradients():
    """Plain-text and Megatron data count every target: with a mask of ones the loss and
    every gradient are those of the loss without one, to the bit."""
    _, _, (inputs, targets, seq_idx, mask) = model_and_batch()
    step, params, place = sharded_value_and_grad("dp=8")
    ones = np.ones_like(mask)
    value, grads = step(params, *place((inputs, targets, seq_idx, ones)))
    plain, plain_grads = step(params, *place((inputs, targets, seq_idx)))
    assert float(value) == float(plain)
    for g, g2 in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_array_equal(g, g2)


def train(spec, grad_accum, batches):
    """The trainer's jitted step over `batches` on `spec` -> (losses, params, opt_state,
    the step, the batches' sharding)."""
    graphdef, params, _ = model_and_batch()
    tx, _ = make_optimizer(params, 1e-2, len(batches), 1, 0.1, 1.0)
    mesh = parallel.make_mesh(spec)
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(jax.tree.map(jnp.copy, params), parallel.shardings(mesh, specs))
    opt_state = jax.jit(tx.init)(params)
    step = make_train_step(parallel.make_loss_fn(graphdef, specs, mesh), tx)
    rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    losses = []
    for batch in batches:
        arrays = tuple(parallel.global_array(a.reshape(grad_accum, -1, SEQ), rows)
                       for a in batch)
        params, opt_state, loss, _ = step(params, opt_state, arrays)
        losses.append(float(loss))
    return losses, params, opt_state, step, rows


def test_grad_accum_gives_the_mean_over_the_batchs_counted_tokens():
    """--grad-accum 2 splits the batch into micro-batches that count 3x as many tokens as
    each other: its steps give --grad-accum 1's losses (a mean of the micro-batches' means
    would not); a batch that counts no token changes neither the parameters nor the
    optimizer's state."""
    _, _, batch = model_and_batch()
    mask = batch[3].copy()
    mask[:4] &= np.arange(SEQ) % 4 == 0  # the first micro-batch counts fewer
    batches = [(*batch[:3], mask), (*batch[:3], np.roll(mask, 1, axis=0))]
    whole, params, opt_state, step, rows = train("dp=2,cp=2,tp=2", 1, batches)
    split, *_ = train("dp=2,cp=2,tp=2", 2, batches)
    np.testing.assert_allclose(split, whole, rtol=LOSS_RTOL)
    # each micro-batch's own mean: the masked loss of the whole batch with the other
    # micro-batch's mask cleared (the program the masked-loss test compiled on this mesh)
    loss, placed_params, place = sharded_value_and_grad("dp=2,cp=2,tp=2")
    *tokens, first_mask = batches[0]
    first = [float(loss(placed_params, *place((*tokens, first_mask & half[:, None])))[0])
             for half in (np.arange(ROWS) < 4, np.arange(ROWS) >= 4)]
    assert abs(np.mean(first) - whole[0]) > 100 * LOSS_RTOL * whole[0]
    # a step on a batch with no counted token
    nothing = (*batch[:3], np.zeros_like(mask))
    before = jax.tree.map(np.asarray, (params, opt_state))
    after_params, after_state, loss, grad_norm = step(
        params, opt_state, tuple(parallel.global_array(a[None], rows) for a in nothing))
    assert float(loss) == 0.0 and float(grad_norm) == 0.0
    for a, b in zip(jax.tree.leaves((after_params, after_state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
