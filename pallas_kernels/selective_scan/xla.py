"""Mamba-1's selective scan in XLA ops, for any platform (implementation="xla"), forward and
backward behind a `jax.custom_vjp`: the recurrence of reference.selective_scan_naive walked
q = chunk_size tokens per loop step, the q tokens of a step unrolled.

Legend: b batch, l sequence (padded to a multiple of q), d channels (d_inner), n d_state,
q tokens per loop step, c = l // q loop steps.

Each (channel, state) entry has its own decay exp(dt_t[d] A[d, n]), so the scan has no
matmul form (the SSD's one decay per head makes its chunks matmuls): every form does
O(b l d n) elementwise work, and on a CPU the time goes to the [b, l, d, n] arrays that
cross memory. Here none is ever built: the state [b, d, n] (a few hundred KB, in cache) is
the loop's carry, updated token by token, and each token's contractions over d or n
(y_t = h_t C_t; in the backward dB, dC, the gradient through B and dA's share) are small
einsums, which XLA's CPU backend runs as dots, faster than as its reductions. A log-step
prefix scan over chunks of [b, q, d, n] decays and states (the form this replaced), or
lax.associative_scan, writes and reads such arrays log2(q) times over; the oracle, one
lax.scan over tokens that JAX differentiates, keeps per-token residuals of that size
(BENCHMARKS.md, "Mamba-1 on a CPU", times the scan against it). Unrolling q tokens per
loop step costs compile time, which grows faster than linearly in q.

- forward: the loop over the c steps carries the state; when differentiating it also
  returns the state entering every step [c, b, d, n] (1/q of the states: the backward's
  only residual beyond the inputs).
- backward: the steps in reverse, each one's q states (and decays) recomputed from its
  saved entering state, then walked backward carrying dh, the gradient of the state
  leaving the token: per token dx, d(dt), dB, dC, and dA [d, n] summed in the carry.

Inputs are the processed dt (after bias, softplus, clamp) and A = -exp(A_log): XLA
differentiates those outside. Accumulates in float32, or float64 for float64 inputs (the
tests); the einsums at HIGHEST precision (a GPU would otherwise round their float32
operands to TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.selective_scan.reference import restarts
from pallas_kernels.ssd.reference import accumulation_dtype, d_skip

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def selective_scan_xla(x, dt, A, B, C, *, chunk_size=8, D=None, initial_state=None,
                       seq_idx=None):
    """The scan of reference.selective_scan_naive, q = chunk_size tokens unrolled per loop
    step. Any l (padded inside with dt = 0: no input, decay 1).

    x [b, l, d] (float32, bfloat16 or float64), dt [b, l, d] (processed), A [d, n], B and C
    [b, l, n] (x's dtype or any float), D [d] or None, initial_state [b, d, n] or None,
    seq_idx [b, l] or None -> (y [b, l, d] in x.dtype, final_state [b, d, n] in the
    accumulation dtype: float32, or float64 for float64 x).
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
    steps = lambda a: jnp.moveaxis(a, 1, 0).reshape(c, q, b, *a.shape[2:])  # [c, q, b, ...]
    # 0 where a document starts: the decay into it is zero
    keep = None if seq_idx is None else steps(1 - restart.astype(acc))
    state = (jnp.zeros((b, d, n), acc) if initial_state is None
             else initial_state.astype(acc))
    y, final_state = _scan(steps(x), steps(dt.astype(acc)), A.astype(acc), steps(B), steps(C),
                           keep, state)
    y = jnp.moveaxis(y.reshape(c * q, b, d)[:l], 0, 1)
    if D is not None:
        y = y + d_skip(D, x[:, :l, :, None], acc)[..., 0]  # each channel a head of one
    return y.astype(x.dtype), final_state


def _token(A, state, x, dt, B, keep):
    """One token: state [b, d, n], x and dt [b, d], B [b, n], keep [b] or None -> (its decay
    exp(dt A) [b, d, n], zero at a document start, and the state leaving it), in A's
    dtype."""
    decay = jnp.exp(dt[..., None] * A)
    if keep is not None:
        decay = decay * keep[:, None, None]
    u = (dt * x.astype(A.dtype))[..., None] * B.astype(A.dtype)[:, None, :]
    return decay, decay * state + u


def _at(a, s):
    return None if a is None else a[s]


@jax.custom_vjp
def _scan(x, dt, A, B, C, keep, state):
    """x, dt [c, q, b, d], A [d, n], B, C [c, q, b, n], keep [c, q, b] or None, state
    [b, d, n] -> (y [c, q, b, d], final_state [b, d, n]) in A's dtype."""
    return _forward(x, dt, A, B, C, keep, state)[0]


def _forward(x, dt, A, B, C, keep, state):
    acc = A.dtype

    def step(state, inputs):
        x_c, dt_c, B_c, C_c, keep_c = inputs
        entering, ys = state, []
        for s in range(x_c.shape[0]):
            _, state = _token(A, state, x_c[s], dt_c[s], B_c[s], _at(keep_c, s))
            ys.append(_einsum("bdn,bn->bd", state, C_c[s].astype(acc)))
        return state, (jnp.stack(ys), entering)

    final_state, (y, entering) = jax.lax.scan(step, state, (x, dt, B, C, keep))
    return (y, final_state), (x, dt, A, B, C, keep, entering)


def _backward(residuals, cotangents):
    x, dt, A, B, C, keep, entering = residuals
    dy, dfinal = cotangents
    acc = A.dtype

    def step(carry, inputs):
        dh, dA = carry  # dh [b, d, n]: the gradient of the state leaving this loop step
        (x_c, dt_c, B_c, C_c, keep_c, dy_c), state = inputs
        q = x_c.shape[0]
        states, decays = [state], []  # states[s]: the state entering token s
        for s in range(q):
            decay, state = _token(A, state, x_c[s], dt_c[s], B_c[s], _at(keep_c, s))
            states.append(state)
            decays.append(decay)
        dx, ddt, dB, dC = [None] * q, [None] * q, [None] * q, [None] * q
        for s in reversed(range(q)):
            x_s, dt_s = x_c[s].astype(acc), dt_c[s]
            B_s, C_s, dy_s = B_c[s].astype(acc), C_c[s].astype(acc), dy_c[s].astype(acc)
            dh = dh + dy_s[..., None] * C_s[:, None, :]  # now the gradient of h_s
            dC[s] = _einsum("bd,bdn->bn", dy_s, states[s + 1])
            dB[s] = _einsum("bdn,bd->bn", dh, dt_s * x_s)
            dh_B = _einsum("bdn,bn->bd", dh, B_s)  # [b, d]
            dx[s] = dh_B * dt_s
            # through exp(dt A) h_{s-1}: the decay's own gradient
            through = dh * decays[s] * states[s]  # [b, d, n]
            ddt[s] = dh_B * x_s + _einsum("bdn,dn->bd", through, A)
            dA = dA + _einsum("bdn,bd->dn", through, dt_s)
            dh = decays[s] * dh
        return (dh, dA), tuple(map(jnp.stack, (dx, ddt, dB, dC)))

    start = (dfinal.astype(acc), jnp.zeros(A.shape, acc))
    (dstate, dA), (dx, ddt, dB, dC) = jax.lax.scan(
        step, start, ((x, dt, B, C, keep, dy), entering), reverse=True)
    return (dx.astype(x.dtype), ddt, dA, dB.astype(B.dtype), dC.astype(C.dtype),
            None if keep is None else jnp.zeros_like(keep), dstate)


_scan.defvjp(_forward, _backward)
