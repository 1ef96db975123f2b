"""The comparison every mesh test makes: a model's logits, loss and every gradient under a
mesh (the trainer's sharded loss, mamba_jax.parallel) against one device's (the model's own
forward and optax's cross-entropy), on 8 fake CPU devices (conftest.py); and the trainer's
first steps under a mesh against one device's.

Tolerances (float32 throughout): logits and loss within 1e-5 absolute (they are O(1)-O(10));
every gradient within 1e-5 absolute + 1e-4 relative of the single-device gradient (a psum
or reduce-scatter adds the same terms in another order, nothing more); training losses
within 1e-5 relative. NaN fails every comparison (assert_allclose treats it as unequal
unless both sides are NaN, and the single-device side is checked finite).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels.conv as conv
import pallas_kernels.norm as norm
import pallas_kernels.ssd as ssd
from mamba_jax import Mamba2Config, Mamba2LM, parallel
from mamba_jax.layers import mamba2
from mamba_jax.sharding import param_name
from mamba_jax.optim import make_optimizer, make_train_step
from mamba_jax.parallel import global_array

# Opt level 0 halves XLA:CPU compile time (the budget here is compiles); every side of each
# comparison is compiled the same way.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
LOGIT_ATOL, GRAD_ATOL, GRAD_RTOL, LOSS_RTOL = 1e-5, 1e-5, 1e-4, 1e-5


def xla_flags(devices: int) -> str:
    """conftest's XLA_FLAGS for a process of its own with `devices` CPU devices: its other
    flags (the quick compiles) kept, so that the process shares the tests' compilation
    cache."""
    return os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8",
                                           f"--xla_force_host_platform_device_count={devices}")
BATCH, SEQ = 4, 32


def tiny_config(**changes) -> Mamba2Config:
    """nheads = 2*64/16 = 8 (tp up to 8), padded vocab 112 = 8*14 (a size no other axis
    has, so the HLO tests can look for it)."""
    base = dict(d_model=64, n_layer=2, vocab_size=100, d_state=16, headdim=16, chunk_size=16)
    return Mamba2Config(**{**base, **changes})


def mamba_config(ngroups=1, nheads=8) -> Mamba2Config:
    return tiny_config(ngroups=ngroups, d_model=8 * nheads)


def packed_seq_idx(seq_len):
    """[BATCH, seq_len] document ids whose boundaries fall inside and exactly on the edges of
    the halves, quarters and eighths of the sequence (the parts of cp = 2, 4, 8)."""
    starts = np.random.default_rng(3).random((BATCH, seq_len)) < 0.06
    starts[0, seq_len // 2] = starts[1, seq_len // 4] = starts[2, 3 * seq_len // 8] = True
    starts[3] = False  # one document through every part: the state crosses them all
    return np.cumsum(starts, axis=1).astype(np.int32)


@functools.cache
def model_and_batch(cfg: Mamba2Config, seq_len=SEQ, packed=False):
    """(graphdef, params, batch): batch = (inputs, targets), plus seq_idx if packed. The
    biases that start at zero are made nonzero, so that one added on every tp rank (instead
    of once) would show."""
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(state))))
    state = jax.tree_util.tree_map_with_path(
        lambda path, w: (0.1 * jax.random.normal(next(keys), w.shape)
                         if param_name(path).endswith("bias") and not w.any() else w), state)
    nnx.update(model, state)
    graphdef, params = nnx.split(model)
    ids = np.random.default_rng(cfg.mamba2.ngroups).integers(0, cfg.vocab_size,
                                                             (BATCH, seq_len + 1))
    batch = (ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32))
    return graphdef, params, batch + ((packed_seq_idx(seq_len),) if packed else ())


def reference_loss(graphdef):
    """The single-device loss: the model's logits and optax's cross-entropy."""
    def loss(params, inputs, targets, seq_idx=None):
        logits = nnx.merge(graphdef, params)(inputs, seq_idx)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss


@functools.cache
def single_device(cfg: Mamba2Config, seq_len=SEQ, packed=False):
    """((loss, gradients), logits) of one device; the logits without seq_idx."""
    graphdef, params, batch = model_and_batch(cfg, seq_len, packed)
    loss = reference_loss(graphdef)

    def run(params, batch):
        return jax.value_and_grad(loss)(params, *batch), nnx.merge(graphdef, params)(batch[0])
    (value, grads), logits = jax.jit(run, compiler_options=FAST_COMPILE)(params, batch)
    assert np.isfinite(float(value)) and np.all(np.isfinite(logits))
    return (value, grads), logits


def sharded(cfg: Mamba2Config, spec, sp, seq_len=SEQ, packed=False, loss_chunk=None):
    """((loss, gradients), logits) under the mesh `spec`, and the parameters' specs."""
    graphdef, params, batch = model_and_batch(cfg, seq_len, packed)
    mesh = parallel.make_mesh(spec)
    parallel.check_layout(cfg, mesh, batch_size=BATCH, seq_len=seq_len, sequence_parallel=sp,
                          loss_chunk=loss_chunk)
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    batch = jax.device_put(batch, NamedSharding(mesh, parallel.TOKENS))
    loss = parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=sp,
                                 loss_chunk=loss_chunk)
    logits = parallel.make_logits_fn(graphdef, specs, mesh, sequence_parallel=sp)

    def run(params, batch):
        return jax.value_and_grad(loss)(params, *batch), logits(params, batch[0])
    return jax.jit(run, compiler_options=FAST_COMPILE)(params, batch), specs


def assert_matches_single_device(cfg: Mamba2Config, spec, sp, seq_len=SEQ, packed=False,
                                 loss_chunk=None):
    """Logits, loss and every gradient of `spec` equal one device's (module tolerances);
    packed: the loss and gradients over packed documents (seq_idx); loss_chunk: the loss
    computed that many positions at a time. Returns the parameters' specs."""
    ((value, grads), logits), specs = sharded(cfg, spec, sp, seq_len, packed, loss_chunk)
    (ref_value, ref_grads), ref_logits = single_device(cfg, seq_len, packed)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGIT_ATOL)
    np.testing.assert_allclose(value, ref_value, rtol=0, atol=LOGIT_ATOL)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    assert len(flat) == len(ref)
    for path, g in flat:
        np.testing.assert_allclose(g, ref[path], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   err_msg=jax.tree_util.keystr(path))
    # The gradients come back sharded as the parameters are (ready for the update).
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs)):
        assert g.sharding.spec == s
    return specs


def _five_batches(cfg):
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (5, 2 * BATCH, SEQ + 1))
    return [(w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32)) for w in ids]


@functools.cache
def train_losses(spec, sp, grad_accum, cfg: Mamba2Config = mamba_config()):
    """Five steps of the trainer's jitted step on a mesh -> (losses, the compiled step,
    the final params and optimizer state)."""
    graphdef, params, _ = model_and_batch(cfg)
    tx, _ = make_optimizer(params, 1e-2, 5, 1, 0.1, 1.0)
    mesh = parallel.make_mesh(spec)
    specs = parallel.param_specs(params, mesh)
    # A copy: the step donates its params, and device_put may reuse the cached buffers.
    params = jax.device_put(jax.tree.map(jnp.copy, params), parallel.shardings(mesh, specs))
    opt_state = jax.jit(tx.init)(params)
    step = make_train_step(parallel.make_loss_fn(graphdef, specs, mesh, sequence_parallel=sp),
                           tx)
    rows = NamedSharding(mesh, P(None, *parallel.TOKENS))
    batches = [tuple(global_array(a.reshape(grad_accum, -1, SEQ), rows) for a in batch)
               for batch in _five_batches(cfg)]
    step = step.lower(params, opt_state, batches[0]).compile(FAST_COMPILE)
    losses = []
    for batch in batches:
        params, opt_state, loss, _ = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, step, params, opt_state


@functools.cache
def single_device_train_losses(cfg: Mamba2Config = mamba_config()):
    graphdef, params, _ = model_and_batch(cfg)
    tx, _ = make_optimizer(params, 1e-2, 5, 1, 0.1, 1.0)
    params = jax.tree.map(jnp.copy, params)  # the step donates them; the cached ones stay
    opt_state, losses = tx.init(params), []
    batches = [(inputs[None], targets[None]) for inputs, targets in _five_batches(cfg)]
    step = make_train_step(reference_loss(graphdef), tx).lower(
        params, opt_state, batches[0]).compile(FAST_COMPILE)
    for batch in batches:
        params, opt_state, loss, _ = step(params, opt_state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    return losses


def take_the_kernels(monkeypatch):
    """The layer on the SSD's, the conv's and the norms' kernels (the gated norm's and the
    residual add and norm's) from here on (their "auto" takes them on a GPU only) -> a list
    that gains an entry at each call of the fused mixer (pallas_kernels.mamba2_mixer)."""
    monkeypatch.setattr(ssd, "kernels_are_faster", lambda x, B: True)
    monkeypatch.setattr(conv, "kernels_run", lambda *args: True)
    monkeypatch.setattr(norm, "kernels_run", lambda *args: True)
    monkeypatch.setattr(norm, "add_kernels_run", lambda *args: True)
    calls = []
    fused = mamba2.mamba2_mixer
    monkeypatch.setattr(mamba2, "mamba2_mixer", lambda *a: calls.append(1) or fused(*a))
    return calls
