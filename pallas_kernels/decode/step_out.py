"""A Mamba block's one-token step after its in-projection, through its out-projection: the
conv, the SSM update and the gate (pallas_kernels.ssd.step), then the gated RMSNorm, out_proj
and the residual add (pallas_kernels.decode.norm_matmul), at batch 1 as one cooperative
kernel where the GPU holds all its programs at once.

    residual, state, sync = mamba_step_out(window, zxbcdt, conv_w, conv_b, A, D, dt_bias,
                                           state, residual, norm_weight, w_out, eps=1e-5,
                                           ngroups=g, sync=sync, implementation="triton")

Legend and operands as pallas_kernels.ssd.step's mamba_step_shifted (window already shifted),
plus residual [b, d], norm_weight [h*p], w_out [d, h*p] (nn.Linear's layout) and sync; the
state float32 or bfloat16 (an Int8State is for large batches, where the step kernel runs
alone: mamba_jax.generate.plan).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import hardware
from pallas_kernels.decode import norm_matmul
from pallas_kernels.ssd import step as ssd_step
from pallas_kernels.triton_call import call, off_gpu


def mamba_step_out(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, residual,
                   norm_weight, w_out, *, eps, ngroups, bias=None, sync=None,
                   dt_limit=(0.0, math.inf), y_dtype=jnp.float32, implementation="xla"):
    """The rest of a Mamba block's one-token step after its in-projection:
    mamba_step_shifted(gate=True), then the gated RMSNorm (norm_weight [h*p], eps, ngroups
    groups), out_proj (w_out [d, h*p], nn.Linear's layout, bias [d] or None) and the
    residual add (residual [b, d]) as norm_matmul.rms_norm_matmul computes them. Returns
    (residual [b, d], the new state, sync).

    sync: None, or an int32 [1] counter that only this function updates (zeros at first;
    carry it from one call to the next). On a GPU at batch 1 with it, "triton" runs both as
    one cooperative kernel: program j runs the step's program j and then out_proj's columns
    [j * bn, (j + 1) * bn); it issues the loads of its out_proj weights first, so that they
    are in flight through the latency-bound step, and between the two it waits at a grid-wide
    barrier (an atomic counter in sync) until every program's y is written. Its programs
    must all be resident at once, so it runs only where there are no more of them than the
    GPU holds (hardware.cooperative_programs); elsewhere, and in Pallas's interpreter (which
    runs programs one at a time), "triton" runs the step kernel and the norm-matmul kernel,
    one after the other, the same code per program."""
    if isinstance(state, ssd_step.Int8State):
        raise ValueError("mamba_step_out: an int8 state (Int8State) is not taken here; run "
                         "pallas_kernels.ssd.step.mamba_step_shifted and the out-projection "
                         "apart")
    b = state.shape[0]
    planned = _cooperative_plan(state, w_out, sync) if implementation == "triton" else None
    if planned is None:
        y, state = ssd_step.mamba_step_shifted(
            window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, dt_limit=dt_limit,
            y_dtype=y_dtype, gate=True, implementation=implementation)
        out = norm_matmul.rms_norm_matmul(
            y.reshape(b, -1), norm_weight, w_out, eps=eps, ngroups=ngroups, bias=bias,
            residual=residual, w_transposed=True, implementation=implementation)
        return out, state, sync
    return _cooperative(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, residual,
                        norm_weight, w_out, eps=eps, ngroups=ngroups, bias=bias, sync=sync,
                        dt_limit=dt_limit, y_dtype=y_dtype, plan=planned)


def _cooperative_plan(state, w_out, sync):
    """(block_p, block_n, programs) of the cooperative kernel, or None where it does not
    run (mamba_step_out): the step kernel's tiles at 4 warps, out_proj's columns split
    evenly over its programs in a power of two of at most norm_matmul.SLAB_ELEMENTS
    weights each, and no more programs than hardware.cooperative_programs()."""
    b, h, p, n = state.shape
    if sync is None or b != 1:
        return None
    bp, warps = ssd_step.filled_blocks(ssd_step.Blocks(), b, h, p, n)
    programs = h * (p // bp)
    d, k = w_out.shape
    bn = d // programs
    if (warps != 4 or d % programs or bn & (bn - 1) or bn * k > norm_matmul.SLAB_ELEMENTS
            or programs > hardware.cooperative_programs()):
        return None
    return bp, bn, programs


def _arrive_and_wait(sync_ref, programs, threads):
    """A grid-wide barrier on an int32 counter that only grows. Each program adds one once its
    threads' stores are done (a barrier of its threads, then the atomic: acquire-release at
    GPU scope, CUTLASS's semaphore pattern), then reads the counter with the same atomic
    (adding 0) until every program of the launch has arrived. A launch starts with the
    counter at a multiple of `programs`, and at most programs - 1 arrive before a program's
    own add, so the value it finds there says which multiple ends the launch. threads: off
    in Pallas's interpreter, which has none to hold at a barrier."""
    if threads:
        plgpu.debug_barrier()
    zero = jnp.zeros((), jnp.int32)  # the counter's index, and what a read adds
    arrived = plgpu.atomic_add(sync_ref, zero, zero + 1)
    target = (arrived // programs + 1) * programs
    # Polled by the atomic, not by plain (volatile) loads and an acquire after them: that
    # took more time a token in mamba2-1.3b (docs/performance.md). carry[1] * 0
    # is a zero made in the loop: Pallas's interpreter takes no constant array there.
    jax.lax.while_loop(lambda carry: carry[0] < carry[1],
                       lambda carry: (plgpu.atomic_add(sync_ref, carry[1] * 0, carry[1] * 0),
                                      carry[1]),
                       (arrived + 1, target))
    if threads:
        plgpu.debug_barrier()


def _step_out_kernel(*refs, n_step, n_out, step_options, out_options, blocks_per_head,
                     programs):
    step_in, out_in = refs[:n_step], refs[n_step:n_step + n_out]
    # after the inputs' counter (the same buffer as the output's)
    y_ref, state_ref, out_ref, sync_ref = refs[n_step + n_out + 1:]
    j = pl.program_id(0)

    def step():
        ssd_step.step_program(*step_in, y_ref, state_ref,
                              ids=(0, j // blocks_per_head, j % blocks_per_head), flat_y=True,
                              **step_options)
        _arrive_and_wait(sync_ref, programs, jax.default_backend() == "gpu")

    bn = out_options["bn"]
    norm_matmul.compute_columns(y_ref, *out_in, out_ref, start=pl.multiple_of(j * bn, bn),
                                after_load=step, **out_options)


def _cooperative(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, residual, norm_weight,
                 w_out, *, eps, ngroups, bias, sync, dt_limit, y_dtype, plan):
    """The cooperative kernel of mamba_step_out for plan (_cooperative_plan)."""
    b, h, p, n = state.shape
    bp, bn, programs = plan
    step_options, step_args = ssd_step.step_call(
        window, None, conv_w, conv_b, (zxbcdt, zxbcdt.shape[1] - h), A, D, dt_bias, state,
        bp=bp, dt_limit=dt_limit, y_dtype=y_dtype, gate=True)
    out_options, out_args, _ = norm_matmul.kernel_call(
        norm_weight, w_out, eps=eps, z=None, ngroups=ngroups, bias=bias, residual=residual,
        w_transposed=True, window=None, out_dtype=w_out.dtype, activation=None,
        blocks=norm_matmul.Blocks(block_n=bn))
    kernel = functools.partial(_step_out_kernel, n_step=len(step_args), n_out=len(out_args),
                               step_options=step_options, out_options=out_options,
                               blocks_per_head=p // bp, programs=programs)
    args = (*step_args, *out_args, sync)
    # y (gated, float32) goes through global memory from each program to all of them
    out_shape = [jax.ShapeDtypeStruct((b, h * p), jnp.float32),
                 jax.ShapeDtypeStruct(state.shape, state.dtype),
                 jax.ShapeDtypeStruct(residual.shape, residual.dtype),
                 jax.ShapeDtypeStruct(sync.shape, sync.dtype)]
    _, state, out, sync = call(kernel, (programs,), out_shape, 4, None,
                               off_gpu(), "mamba_step_out",
                               {len(step_args) - 1: 1, len(args) - 1: 3})(*args)  # state, counter
    return out, state, sync
