"""Mamba-1's selective scan in plain JAX: the token-by-token recurrence (the oracle for the
XLA form, xla.py, and the kernels, triton.py) and one token's update (the decoding step's).

Legend: b batch, l sequence, d channels (d_inner; each its own SSM), n d_state.

The scan computes, per document of a packed row (Gu & Dao, 2023, Algorithm 2, "S6"),

    h_t = exp(dt_t A) * h_t-1 + (dt_t x_t) B_t           (h_t: [d, n]; A: [d, n])
    y_t = h_t C_t + D x_t

with h_-1 = initial_state (or 0) for the first document and 0 at every later document
start. dt is the processed step (after bias, softplus, clamp: process_dt); A = -exp(A_log).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ssd.reference import accumulation_dtype


def restarts(seq_idx, b, l):
    """[b, l] bool: the positions where a new document starts (never position 0, whose
    previous state is the initial state)."""
    if seq_idx is None:
        return jnp.zeros((b, l), bool)
    return jnp.pad(seq_idx[:, 1:] != seq_idx[:, :-1], ((0, 0), (1, 0)))


def selective_scan_naive(x, dt, A, B, C, *, D=None, initial_state=None, seq_idx=None):
    """The recurrence one token at a time; the oracle for every other form.

    x [b, l, d], dt [b, l, d] (processed), A [d, n], B and C [b, l, n], D [d] or None,
    initial_state [b, d, n] or None, seq_idx [b, l] or None -> (y [b, l, d] in x.dtype,
    final_state [b, d, n]). Accumulates in float32, or float64 for float64 inputs.
    """
    b, l, d = x.shape
    n = A.shape[-1]
    acc = accumulation_dtype(x)
    state = (jnp.zeros((b, d, n), acc) if initial_state is None
             else initial_state.astype(acc))

    def step(state, inputs):
        x_t, dt_t, B_t, C_t, restart = inputs
        decay = jnp.where(restart[:, None, None], 0.0, jnp.exp(dt_t[..., None] * A.astype(acc)))
        state = decay * state + (dt_t * x_t)[..., None] * B_t[:, None, :]
        return state, jnp.einsum("bdn,bn->bd", state, C_t)

    time_major = [jnp.moveaxis(a.astype(acc) if a.dtype != bool else a, 1, 0)
                  for a in (x, dt, B, C, restarts(seq_idx, b, l))]
    state, y = jax.lax.scan(step, state, time_major)
    y = jnp.moveaxis(y, 0, 1)
    if D is not None:
        y = y + D.astype(acc) * x.astype(acc)
    return y.astype(x.dtype), state


def selective_state_update(state, x, dt, A, B, C, D=None):
    """One token of the recurrence (a decoding step): state [b, d, n] (any float dtype), x
    [b, d], dt [b, d] (processed), A [d, n], B and C [b, n], D [d] or None -> (y [b, d], the
    new state [b, d, n]), both float32 (the caller stores the state in its own dtype)."""
    f32 = lambda a: a.astype(jnp.float32)
    dt, x = f32(dt), f32(x)
    state = jnp.exp(dt[..., None] * f32(A)) * f32(state) + (dt * x)[..., None] * f32(B)[:, None]
    y = jnp.einsum("bdn,bn->bd", state, f32(C))
    return (y if D is None else y + f32(D) * x), state
