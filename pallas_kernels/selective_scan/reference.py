"""Mamba-1's selective scan in plain JAX: the token-by-token recurrence (the oracle) and a
chunked parallel form.

Legend: b batch, l sequence, d channels (d_inner; each its own SSM), n d_state, c chunks,
q positions inside one chunk.

Both compute, per document of a packed row (Gu & Dao, 2023, Algorithm 2, "S6"),

    h_t = exp(dt_t A) * h_t-1 + (dt_t x_t) B_t           (h_t: [d, n]; A: [d, n])
    y_t = h_t C_t + D x_t

with h_-1 = initial_state (or 0) for the first document and 0 at every later document
start. dt is the processed step (after bias, softplus, clamp: process_dt); A = -exp(A_log).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ssd.reference import accumulation_dtype, d_skip


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


def selective_scan_chunked(x, dt, A, B, C, *, chunk_size=64, D=None, initial_state=None,
                           seq_idx=None):
    """The same scan as selective_scan_naive, in parallel inside chunks of chunk_size
    tokens: a prefix scan over the chunk's (decay, input) pairs (_prefix_scan), then the
    state entering the chunk decayed to each position; a sequential scan carries the state
    across the chunks. Any l (padded inside with dt = 0: no input, decay 1).

    Each chunk's body is rematerialised: the [b, q, d, n] decays and states it builds (the
    scan's whole cost in memory) are rebuilt in the backward pass rather than kept for all
    l tokens, so memory is that of one chunk's [b, q, d, n] plus the [b, c, d, n] states
    entering the chunks. Arguments and results as selective_scan_naive.
    """
    b, l, d = x.shape
    n = A.shape[-1]
    acc = accumulation_dtype(x)
    q = min(chunk_size, l)
    pad = (-l) % q
    restart = restarts(seq_idx, b, l)
    if pad:
        zeros = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        x, dt, B, C, restart = map(zeros, (x, dt, B, C, restart))
    c = (l + pad) // q
    chunks = lambda a: jnp.moveaxis(a.reshape(b, c, q, *a.shape[2:]), 1, 0)  # [c, b, q, ...]
    state = (jnp.zeros((b, d, n), acc) if initial_state is None
             else initial_state.astype(acc))

    @jax.checkpoint
    def chunk(state, inputs):
        x_c, dt_c, B_c, C_c, restart_c = inputs
        dt_c = dt_c.astype(acc)
        decay = jnp.where(restart_c[..., None, None], 0.0,
                          jnp.exp(dt_c[..., None] * A.astype(acc)))  # [b, q, d, n]
        drive = (dt_c * x_c.astype(acc))[..., None] * B_c.astype(acc)[:, :, None, :]
        through, own = _prefix_scan(decay, drive)
        states = through * state[:, None] + own  # [b, q, d, n]
        y = jnp.einsum("bqdn,bqn->bqd", states, C_c.astype(acc))
        return states[:, -1], y

    state, y = jax.lax.scan(chunk, state, tuple(map(chunks, (x, dt, B, C, restart))))
    y = jnp.moveaxis(y, 0, 1).reshape(b, c * q, d)[:, :l]
    if D is not None:
        y = y + d_skip(D, x[:, :l, :, None], acc)[..., 0]  # each channel a head of one
    return y.astype(x.dtype), state



def _prefix_scan(decay, drive):
    """decay, drive [b, q, ...] -> (the products of decay over positions 0..t, the state at
    t from a zero state, h_t = decay_t h_t-1 + drive_t), by log2(q) doubling steps
    (Hillis-Steele): each step combines every position with the one 2^k before it. More
    work than lax.associative_scan's odd/even recursion (q log q against 2q), but less to
    compile: the gradient of a chunked scan took 2.3 s against its 5.8 s on the CPU."""
    q, k = decay.shape[1], 1
    while k < q:
        earlier = lambda a, identity: jnp.concatenate(
            [jnp.full_like(a[:, :k], identity), a[:, :-k]], axis=1)
        drive = decay * earlier(drive, 0.0) + drive
        decay = decay * earlier(decay, 1.0)
        k *= 2
    return decay, drive


def selective_state_update(state, x, dt, A, B, C, D=None):
    """One token of the recurrence (a decoding step): state [b, d, n] (any float dtype), x
    [b, d], dt [b, d] (processed), A [d, n], B and C [b, n], D [d] or None -> (y [b, d], the
    new state [b, d, n]), both float32 (the caller stores the state in its own dtype)."""
    f32 = lambda a: a.astype(jnp.float32)
    dt, x = f32(dt), f32(x)
    state = jnp.exp(dt[..., None] * f32(A)) * f32(state) + (dt * x)[..., None] * f32(B)[:, None]
    y = jnp.einsum("bdn,bn->bd", state, f32(C))
    return (y if D is None else y + f32(D) * x), state
