"""The optimizer and the jitted training step.

AdamW with linear warmup then cosine decay (or WSD: warmup, stable, linear decay), global-norm
clipping, and no weight decay where a parameter was created with decay=False
(mamba_jax.layers.common.param: A_log, D, dt_bias, norms and biases, as mamba_ssm's recipes).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax

from mamba_jax.sharding import is_param

SCHEDULES = ("cosine", "wsd")

# XLA's options for the training and evaluation steps on a GPU (ignored on a CPU): cuBLAS's
# GEMMs rather than XLA's Triton GEMM fusions, whose autotuning made mamba2-1.3b's first
# compile several times longer on a GPU (docs/performance.md), and no
# cuBLASLt, without which jax 0.11.2's compile of a hybrid with MLP layers failed there
# ("BlasLt is unavailable"). The speeds in BENCHMARKS.md were measured with both. Under
# --fp8 the FP8 GEMMs are cuBLASLt's whatever these say (XLA's GEMM rewriter makes every
# dot of dequantized FP8 operands a cuBLASLt FP8 call without reading the flag): the choice
# is per GEMM, FP8 ones on cuBLASLt, the rest (the LM head, the bf16 layers) on cuBLAS.
TRAIN_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False,
                          "xla_gpu_enable_cublaslt": False}
# Bitwise-reproducible GPU steps (the trainer's --deterministic): XLA's scatter-adds (such
# as the embedding's gradient) and reductions in a fixed order instead of by atomics. On a
# GPU two runs of the same tiny steps gave losses that differed within a few steps without
# it and were identical with it, for a slower mamba2-1.3b step (docs/performance.md). Our Pallas
# kernels use no atomics in training.
DETERMINISTIC_OPTIONS = {"xla_gpu_deterministic_ops": True}


def train_compiler_options(deterministic: bool = False) -> dict:
    """TRAIN_COMPILER_OPTIONS (and DETERMINISTIC_OPTIONS if deterministic) but those that
    the XLA_FLAGS environment variable sets, which are left to it."""
    flags = os.environ.get("XLA_FLAGS", "")
    options = {**TRAIN_COMPILER_OPTIONS, **(DETERMINISTIC_OPTIONS if deterministic else {})}
    return {name: value for name, value in options.items() if name not in flags}


def weight_decay_mask(params):
    """A pytree like params (an nnx.State): True where weight decay applies, as each
    parameter declared where it was created (its `decay` metadata)."""
    return jax.tree.map(lambda v: jax.tree.map(lambda _: v.get_metadata().get("decay", True), v),
                        params, is_leaf=is_param)


WSD_DECAY_FRACTION = 0.2  # "wsd": the last fifth of the steps decays


def _wsd_decay(steps):
    return max(int(steps * WSD_DECAY_FRACTION), 1)


def warmup_steps(steps, warmup, schedule="cosine"):
    """The steps the schedule warms up over: warmup, shortened to leave a step after it (the
    warmup's first step applies a rate of 0, so a one-step run does not warm up at all), and
    for "wsd" to leave its decay whole (it was cut off at the last step, short of lr/10)."""
    room = steps - _wsd_decay(steps) if schedule == "wsd" else steps - 1
    return max(min(warmup, room), 0)


def make_schedule(lr, steps, warmup, schedule="cosine"):
    """Learning rate by step: linear warmup to lr, then cosine to lr/10 ("cosine"), or hold
    lr and decay linearly to lr/10 over the last WSD_DECAY_FRACTION of the steps ("wsd")."""
    warmup = warmup_steps(steps, warmup, schedule)
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, 2), lr * 0.1)
    if schedule == "wsd":
        decay = _wsd_decay(steps)
        stable = max(steps - warmup - decay, 0)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr),
             optax.linear_schedule(lr, lr * 0.1, decay)], [warmup, warmup + stable])
    raise ValueError(f"--schedule {schedule!r}: use one of {SCHEDULES}")


def make_optimizer(params, lr, steps, warmup, weight_decay, clip, schedule="cosine"):
    """(optax transformation, learning-rate schedule) for params."""
    lr_at = make_schedule(lr, steps, warmup, schedule)
    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(lr_at, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay,
                    mask=weight_decay_mask(params)))
    return tx, lr_at


def opt_state_shardings(tx, params, param_shardings, replicated):
    """Where the step puts tx's state: each moment placed like the parameter it tracks and
    every other leaf (Adam's step count) on `replicated`. params may be abstract."""
    return optax.tree_map_params(tx, lambda _, sharding: sharding,
                                 jax.eval_shape(tx.init, params), param_shardings,
                                 transform_non_params=lambda _: replicated)


def init_opt_state(tx, params, param_shardings, replicated):
    """tx.init(params) placed by opt_state_shardings: so the second step reuses the first
    one's compilation, and under fsdp no device ever holds the whole state."""
    shardings = opt_state_shardings(tx, params, param_shardings, replicated)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def make_train_step(loss_fn, tx, *, deterministic=False):
    """step(params, opt_state, batch, *frozen) -> (params, opt_state, loss, grad_norm),
    jitted. frozen: a model's parts that do not train (mamba_jax.adapters: the base beside
    the adapters), passed to loss_fn(params, *frozen, *micro_batch) and not differentiated:
    the gradients and the optimizer state are of params alone.

    batch = (inputs, targets), (inputs, targets, seq_idx) or (inputs, targets, seq_idx,
    loss_mask), each [micro-batches, b, l] (--grad-accum), accumulated in a scan. The loss is
    the mean over the batch's counted tokens (every token without a loss_mask): each
    micro-batch's mean (loss_fn's) weighs by its share of them, not 1 / micro-batches, so it
    is the same whatever the split. A batch that counts no token changes nothing: its loss
    and gradients are 0 and the update is skipped (the parameters and the optimizer state,
    its step count too, stay as they were). Shardings ride on the arrays; params and
    opt_state are donated. Compiled with train_compiler_options(deterministic).
    """
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(params, opt_state, batch, *frozen):
        n, masked = batch[0].shape[0], len(batch) > 3
        counts = batch[3].sum((1, 2), dtype=jnp.int32) if masked else None
        if n == 1:  # no loop: a scan costs a little even over one micro-batch
            loss, grads = jax.value_and_grad(loss_fn)(params, *frozen, *(a[0] for a in batch))
        else:
            shares = (counts / jnp.maximum(counts.sum(), 1) if masked
                      else jnp.full(n, 1 / n, jnp.float32))

            def accumulate(total, xs):
                share, micro_batch = xs
                loss, grads = jax.value_and_grad(loss_fn)(params, *frozen, *micro_batch)
                return jax.tree.map(lambda t, x: t + share * x, total, (loss, grads)), None
            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, (shares, batch))
        if masked:
            params, opt_state = jax.lax.cond(counts.sum() > 0, update, lambda p, o, _: (p, o),
                                             params, opt_state, grads)
        else:
            params, opt_state = update(params, opt_state, grads)
        return params, opt_state, loss, optax.tree.norm(grads)
    return jax.jit(step, donate_argnums=(0, 1),
                   compiler_options=train_compiler_options(deterministic))
