"""Mamba-1's selective scan as Pallas kernels lowered through Triton, forward and backward,
behind a `jax.custom_vjp`.

Legend: b batch, l sequence (padded to a multiple of the kernel chunk t), d channels
(d_inner), bd channels per program, n d_state, c = l // t chunks.

The state [d, n] has a decay of its own per (channel, state) entry, exp(dt_t[d] A[d, n]),
so the scan has no matmul form (Mamba2's SSD has one decay per head); like mamba_ssm's
selective_scan CUDA kernel, each program walks its channels' tokens in order with the state
[bd, n] in registers, and nothing of size [b, l, d, n] ever reaches memory.

- `_forward_kernel`, grid (b, d / bd): token by token, h = exp(dt A) h + dt x B^T,
  y = h C + D x; when differentiating it also saves the state entering every chunk
  [b, c, d, n] (the backward's only residual beyond the inputs: 1/t of the states).
- `_backward_kernel`, grid (b, d / bd): the chunks in reverse, each one's states recomputed
  forward from its saved entering state (t of them, unrolled, in registers; the tokens'
  inputs are loaded again on the way back rather than kept) and then walked backward
  carrying dh, the gradient of the state leaving the token. Per token dx, d(dt),
  this program's part of dB and dC (summed over the d / bd programs after the kernel), and
  dA and dD summed in registers.

Every input the kernels see is prepared in XLA, which differentiates it: dt after bias,
softplus and clamp (float32), A = -exp(A_log), document ids (a document start zeroes the
decay into it). Loads are widened to float32; states and sums are float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton_call import call, split_optional

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles and launch shapes. `block_d` (bd) a power of two; `chunk` (t) the tokens per
    saved state, unrolled in the backward kernel (its registers hold t + 1 states)."""
    chunk: int = 8
    block_d: int = 32
    forward_warps: int = 2
    backward_warps: int = 2
    stages: int = 1


def supports(d, n):
    """Whether the kernels take d channels and d_state n: n a power of two, d a multiple of
    16 (the block is the largest power of two up to Config.block_d that divides d)."""
    return n & (n - 1) == 0 and d % 16 == 0


def _block_d(config, d):
    bd = config.block_d
    while d % bd:
        bd //= 2
    return bd


def _token(x_ref, dt_ref, B_ref, C_ref, doc_ref, A, bi, i, ds):
    """Token i of this program's channels: x, dt [bd], B, C [n] float32, and the decay
    exp(dt A) [bd, n] into it (zero at a document start)."""
    x, dt = x_ref[bi, i, ds].astype(f32), dt_ref[bi, i, ds]
    B, C = B_ref[bi, i, :].astype(f32), C_ref[bi, i, :].astype(f32)
    decay = jnp.exp(dt[:, None] * A)
    if doc_ref is not None:
        decay = jnp.where(doc_ref[bi, i] == doc_ref[bi, jnp.maximum(i - 1, 0)], decay, 0.0)
    return x, dt, B, C, decay


def _forward_kernel(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, init_ref, *rest, t, bd,
                    has_doc, save_states):
    doc_ref, (y_ref, final_ref, *states_ref) = split_optional(rest, has_doc)
    bi, ds = pl.program_id(0), pl.ds(pl.program_id(1) * bd, bd)
    A, D = A_ref[ds, :], D_ref[ds]

    def token(i, state):
        x, dt, B, C, decay = _token(x_ref, dt_ref, B_ref, C_ref, doc_ref, A, bi, i, ds)
        state = decay * state + (dt * x)[:, None] * B[None, :]
        y_ref[bi, i, ds] = (jnp.sum(state * C[None, :], axis=1) + D * x).astype(y_ref.dtype)
        return state

    def chunk(k, state):
        if save_states:
            states_ref[0][bi, k, ds, :] = state
        return jax.lax.fori_loop(k * t, (k + 1) * t, token, state)

    final_ref[bi, ds, :] = jax.lax.fori_loop(0, x_ref.shape[1] // t, chunk,
                                             init_ref[bi, ds, :])


def _backward_kernel(x_ref, dt_ref, A_ref, B_ref, C_ref, D_ref, states_ref, dy_ref,
                     dfinal_ref, *rest, t, bd, has_doc):
    doc_ref, (dx_ref, ddt_ref, dA_ref, dB_ref, dC_ref, dinit_ref, dD_ref) = split_optional(
        rest, has_doc)
    bi, di = pl.program_id(0), pl.program_id(1)
    ds = pl.ds(di * bd, bd)
    A, D = A_ref[ds, :], D_ref[ds]
    nchunks = x_ref.shape[1] // t

    def chunk(j, carry):
        dh, dA, dD = carry  # dh [bd, n]: the gradient of the state leaving chunk k
        k = nchunks - 1 - j
        states = [states_ref[bi, k, ds, :]]  # states[s]: the state entering token s
        for s in range(t):  # recompute the chunk's states, kept in registers
            x, dt, B, C, decay = _token(x_ref, dt_ref, B_ref, C_ref, doc_ref, A, bi,
                                        k * t + s, ds)
            states.append(decay * states[-1] + (dt * x)[:, None] * B[None, :])
        for s in reversed(range(t)):
            i = k * t + s
            # The token's inputs loaded again (from cache) rather than kept: registers hold
            # the t + 1 states only.
            x, dt, B, C, decay = _token(x_ref, dt_ref, B_ref, C_ref, doc_ref, A, bi, i, ds)
            dy = dy_ref[bi, i, ds].astype(f32)
            dh = dh + dy[:, None] * C[None, :]  # the gradient of h_i
            dC_ref[di, bi, i, :] = jnp.sum(dy[:, None] * states[s + 1], axis=0)
            dB_ref[di, bi, i, :] = jnp.sum(dh * (dt * x)[:, None], axis=0)
            dh_B = jnp.sum(dh * B[None, :], axis=1)  # [bd]
            dx_ref[bi, i, ds] = (dh_B * dt + D * dy).astype(dx_ref.dtype)
            decayed = decay * states[s]  # exp(dt A) h_{i-1}
            ddt_ref[bi, i, ds] = dh_B * x + jnp.sum(dh * A * decayed, axis=1)
            dA = dA + dh * dt[:, None] * decayed
            dD = dD + dy * x
            dh = decay * dh
        return dh, dA, dD

    n = A.shape[-1]
    dh, dA, dD = jax.lax.fori_loop(0, nchunks, chunk, (dfinal_ref[bi, ds, :],
                                                       jnp.zeros((bd, n), f32),
                                                       jnp.zeros((bd,), f32)))
    dinit_ref[bi, ds, :] = dh
    dA_ref[bi, ds, :] = dA
    dD_ref[bi, ds] = dD


def forward(x, dt, A, B, C, D, initial_state, doc, *, config, save_states, interpret):
    """Chunk-padded x [b, l, d], dt [b, l, d] float32, A [d, n] float32, B, C [b, l, n], D
    [d] float32, initial_state [b, d, n] float32, doc [b, l] int32 or None -> (y [b, l, d]
    x.dtype, final_state [b, d, n] float32, and when save_states the state entering every
    chunk [b, c, d, n] float32)."""
    b, l, d = x.shape
    n = A.shape[-1]
    t, bd = config.chunk, _block_d(config, d)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((b, d, n), f32)]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((b, l // t, d, n), f32))
    kernel = functools.partial(_forward_kernel, t=t, bd=bd, has_doc=doc is not None,
                               save_states=save_states)
    args = (x, dt, A, B, C, D, initial_state) + (() if doc is None else (doc,))
    return call(kernel, (b, d // bd), out_shape, config.forward_warps, config.stages,
                interpret, "selective_scan_forward")(*args)


def backward(x, dt, A, B, C, D, doc, states, dy, dfinal, *, config, interpret):
    """The gradients of forward's (y, final_state) for the cotangents dy [b, l, d] and
    dfinal [b, d, n]: (dx, ddt [b, l, d] float32, dA [d, n], dB, dC [b, l, n] float32,
    dinitial_state [b, d, n], dD [d])."""
    b, l, d = x.shape
    n = A.shape[-1]
    t, bd = config.chunk, _block_d(config, d)
    shape = lambda *s: jax.ShapeDtypeStruct(s, f32)
    kernel = functools.partial(_backward_kernel, t=t, bd=bd, has_doc=doc is not None)
    args = (x, dt, A, B, C, D, states, dy, dfinal) + (() if doc is None else (doc,))
    dx, ddt, dA, dB, dC, dinit, dD = call(
        kernel, (b, d // bd),
        [jax.ShapeDtypeStruct(x.shape, x.dtype), shape(b, l, d), shape(b, d, n),
         shape(d // bd, b, l, n), shape(d // bd, b, l, n), shape(b, d, n), shape(b, d)],
        config.backward_warps, config.stages, interpret, "selective_scan_backward")(*args)
    return dx, ddt, dA.sum(0), dB.sum(0), dC.sum(0), dinit, dD.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def scan(config, interpret, x, dt, A, B, C, D, initial_state, doc):
    """forward's (y, final_state), differentiable (the kernels' backward) in every input
    but doc."""
    return forward(x, dt, A, B, C, D, initial_state, doc, config=config, save_states=False,
                   interpret=interpret)


def _scan_fwd(config, interpret, x, dt, A, B, C, D, initial_state, doc):
    y, final, states = forward(x, dt, A, B, C, D, initial_state, doc, config=config,
                               save_states=True, interpret=interpret)
    return (y, final), (x, dt, A, B, C, D, doc, states)


def _scan_bwd(config, interpret, residuals, cotangents):
    x, dt, A, B, C, D, doc, states = residuals
    dy, dfinal = cotangents
    dx, ddt, dA, dB, dC, dinit, dD = backward(
        x, dt, A, B, C, D, doc, states, dy.astype(x.dtype), dfinal.astype(f32),
        config=config, interpret=interpret)
    return dx, ddt, dA, dB.astype(B.dtype), dC.astype(C.dtype), dD, dinit, None


scan.defvjp(_scan_fwd, _scan_bwd)
