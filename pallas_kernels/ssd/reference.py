"""The SSD scan in plain JAX: the naive recurrence (the oracle) and the chunked form.

Legend for every shape here: b batch, l sequence, h heads, p headdim, g groups (B/C
groups; head i reads group i // (h/g)), r heads per group, n d_state, c chunks, q and s
positions inside one chunk.

Both functions compute, per document of a packed row,

    h_t = exp(dt_t * A) h_{t-1} + dt_t * x_t B_t^T        (h_t: [h, p, n])
    y_t = h_t C_t + D * x_t

with h_{-1} = initial_state (or 0) for the first document and 0 at every later document
start. `ssd_naive` runs that loop token by token; `ssd_chunked` is the state-space-duality
algorithm of Mamba2 (Dao & Gu, 2024): quadratic attention-like work inside a chunk, a short
recurrence across chunks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """dt [b, l, h] -> float32 (or float64) dt after bias, softplus and clamp, as mamba_ssm."""
    dt = dt.astype(jnp.promote_types(dt.dtype, jnp.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.astype(dt.dtype)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = jnp.clip(dt, lo, hi)
    return dt


def document_ids(seq_idx):
    """seq_idx [b, l] (any ints) -> [b, l] int32 ids that start at 0 and grow by one at
    every position where seq_idx changes, so "same document" is an equality test even when
    a caller reuses ids (0, 1, 0)."""
    change = (seq_idx[:, 1:] != seq_idx[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros_like(change[:, :1]), jnp.cumsum(change, axis=1)], axis=1)


def take_groups(B, index):
    """B [b, l, g, n] (or C, or any [b, l, g, ...]) -> its groups index [k] int32, [b, l, k,
    ...]: a slice where k is 1 (the heads that read those groups, a tensor-parallel rank's,
    whose groups tp does not divide)."""
    if index.shape[0] == 1:
        return jax.lax.dynamic_slice_in_dim(B, index[0], 1, axis=2)
    return jnp.take(B, index, axis=2)


def weighted_state(x, B, weights, acc):
    """sum_s weights_s x_s B_s^T, the state a span of tokens leaves from a zero state:
    x [..., s, g, r, p], B [..., s, g, n], weights [..., s, g, r] (decay to the span's end
    times dt, in acc) -> [..., g, r, p, n] in acc. x is weighted in acc, then rounded to its
    own dtype for the matmul (bf16 operands, acc accumulation), as the kernels do."""
    xw = (x.astype(acc) * weights[..., None]).astype(x.dtype)
    return jnp.einsum("...sgrp,...sgn->...grpn", xw, B, preferred_element_type=acc)


def accumulation_dtype(x):
    # float64 inputs (the oracle's tests) stay float64; everything else accumulates in float32.
    return jnp.promote_types(x.dtype, jnp.float32)


def ssd_naive(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None):
    """The recurrence, one token at a time. Slow; the oracle for every other implementation.

    Returns (y [b, l, h, p] in x.dtype, final_state [b, h, p, n] float32/float64).
    """
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    acc = accumulation_dtype(x)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit).astype(acc)
    B_h = jnp.repeat(B.astype(acc), h // g, axis=2)  # [b, l, h, n]
    C_h = jnp.repeat(C.astype(acc), h // g, axis=2)
    if seq_idx is None:
        reset = jnp.zeros((b, l), bool)
    else:
        reset = jnp.pad(seq_idx[:, 1:] != seq_idx[:, :-1], ((0, 0), (1, 0)))
    state = (jnp.zeros((b, h, p, n), acc) if initial_state is None
             else initial_state.astype(acc))

    def step(state, inputs):
        x_t, dt_t, B_t, C_t, reset_t = inputs
        decay = jnp.where(reset_t[:, None], 0.0, jnp.exp(dt_t * A.astype(acc)))  # [b, h]
        state = (state * decay[:, :, None, None]
                 + (dt_t[:, :, None] * x_t)[..., None] * B_t[:, :, None, :])
        return state, jnp.einsum("bhpn,bhn->bhp", state, C_t)

    time_major = [jnp.moveaxis(a, 1, 0) for a in (x.astype(acc), dt, B_h, C_h, reset)]
    state, y = jax.lax.scan(step, state, time_major)
    y = jnp.moveaxis(y, 0, 1)
    if D is not None:
        y = y + d_skip(D, x, acc)
    return y.astype(x.dtype), state


@functools.partial(jax.checkpoint, static_argnums=(2,))
def d_skip(D, x, acc):
    """D [h] or [h, p] times x [b, l, h, p], in acc.

    Rematerialized (jax.checkpoint): differentiating keeps D and x, in x's own dtype (the
    scan keeps x anyway), and widens x again in the backward pass, instead of keeping the
    widened copy: for bf16 x a float32 [b, l, h, p] per layer, 12.9 GB of a mamba2-1.3b
    train step at 8 x 2048 (bench/profile_step.py's HLO)."""
    D = D.astype(acc)
    return (D[:, None] if D.ndim == 1 else D) * x.astype(acc)


def ssd_chunked(x, dt, A, B, C, *, chunk_size, D=None, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None):
    """The chunked SSD algorithm in XLA ops; any l (padded to a chunk multiple inside; a
    chunk_size above l is one chunk of l tokens, not a chunk_size one mostly padding).

    Matmul operands stay in x's dtype (bf16 allowed) with float32 accumulation; decays,
    cumulative sums and states are float32 (float64 for float64 inputs).
    Returns (y [b, l, h, p] in x.dtype, final_state [b, h, p, n]).
    """
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    q = min(chunk_size, l)
    acc = accumulation_dtype(x)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit).astype(acc)
    doc = None if seq_idx is None else document_ids(seq_idx)

    # Pad to whole chunks. Padded steps have dt = 0 (padding after softplus): no input and
    # decay exp(0) = 1, so the final state is the state after the last real token.
    pad = (-l) % q
    if pad:
        zeros = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        x, dt, B, C = zeros(x), zeros(dt), zeros(B), zeros(C)
        if doc is not None:
            doc = jnp.pad(doc, ((0, 0), (0, pad)), mode="edge")
    c = (l + pad) // q
    x = x.reshape(b, c, q, g, r, p)
    B = B.reshape(b, c, q, g, n)
    C = C.reshape(b, c, q, g, n)
    dt = dt.reshape(b, c, q, g, r).transpose(0, 1, 3, 4, 2)  # [b, c, g, r, q]
    dA_cs = jnp.cumsum(dt * A.astype(acc).reshape(g, r)[:, :, None], axis=-1)  # [b, c, g, r, q]

    causal = jnp.tril(jnp.ones((q, q), bool))
    if doc is None:
        same_doc = causal[None, None]  # [1, 1, q, s]
    else:
        doc = doc.reshape(b, c, q)
        same_doc = causal & (doc[:, :, :, None] == doc[:, :, None, :])  # [b, c, q, s]

    # 1. Inside each chunk: (C B^T, masked by the decay from s to q) times dt x. The decay is
    # a difference of cumulative sums, never a cumsum over a masked [q, s] matrix.
    CB = jnp.einsum("bcqgn,bcsgn->bcgqs", C, B, preferred_element_type=acc)
    segsum = dA_cs[..., :, None] - dA_cs[..., None, :]  # [b, c, g, r, q, s]
    mask = same_doc[:, :, None, None]
    decay = jnp.exp(jnp.where(mask, segsum, -jnp.inf))
    M = CB[:, :, :, None] * decay * dt[..., None, :]
    y = jnp.einsum("bcgrqs,bcsgrp->bcqgrp", M.astype(x.dtype), x, preferred_element_type=acc)

    # 2. Each chunk's own contribution to the state at its end: sum_s decay_s dt_s x_s B_s^T,
    # counting only tokens of the document that is open at the chunk's end.
    decay_to_end = jnp.exp(dA_cs[..., -1:] - dA_cs)  # [b, c, g, r, s]
    if doc is not None:
        decay_to_end = decay_to_end * (doc == doc[:, :, -1:])[:, :, None, None]
    chunk_states = weighted_state(x, B, (decay_to_end * dt).transpose(0, 1, 4, 2, 3), acc)

    # 3. Across chunks: a sequential scan multiplying whole-chunk decays. A cumsum over all
    # chunks would lose float32 precision on long sequences; the chunk count is small.
    chunk_decay = jnp.exp(dA_cs[..., -1])  # [b, c, g, r]
    if doc is not None:
        # The document open when chunk c starts (the initial state belongs to the first).
        entry_doc = jnp.concatenate([doc[:, :1, 0], doc[:, :-1, -1]], axis=1)  # [b, c]
        chunk_decay = chunk_decay * (doc[:, :, -1] == entry_doc)[:, :, None, None]
    state = (jnp.zeros((b, g, r, p, n), acc) if initial_state is None
             else initial_state.astype(acc).reshape(b, g, r, p, n))

    def pass_state(state, inputs):
        decay_c, own_c = inputs
        return state * decay_c[..., None, None] + own_c, state

    final_state, entry_states = jax.lax.scan(
        pass_state, state, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0)))
    entry_states = jnp.moveaxis(entry_states, 0, 1)  # [b, c, g, r, p, n]

    # 4. The state entering each chunk, decayed to each position and read out through C.
    decay_from_entry = jnp.exp(dA_cs)  # [b, c, g, r, q]
    if doc is not None:
        decay_from_entry = decay_from_entry * (doc == entry_doc[:, :, None])[:, :, None, None]
    y_entry = jnp.einsum("bcqgn,bcgrpn->bcqgrp", C, entry_states.astype(C.dtype),
                         preferred_element_type=acc)
    y = y + y_entry * decay_from_entry.transpose(0, 1, 4, 2, 3)[..., None]

    y = y.reshape(b, c * q, h, p)[:, :l]
    if D is not None:
        y = y + d_skip(D, x.reshape(b, c * q, h, p)[:, :l], acc)
    return y.astype(x.dtype), final_state.reshape(b, h, p, n)
