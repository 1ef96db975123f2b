"""The SSD scan over a sequence split into K parts that are scanned at the same time: across
devices (context parallelism, `ssd_context_parallel`) or within each row on one device
(`ssd_segmented`, for the XLA path; the kernels join a row's parts in their custom_vjp,
vjp.py, with the same steps).

ssd_context_parallel is called inside `jax.shard_map` with the sequence axis of x, dt, B, C
and seq_idx split over the mesh axis `axis_name`: device k holds part k of every row. Legend
as in reference.py (b batch, l one part of the sequence, h heads, p headdim, g groups, r
heads per group, n d_state), plus K parts.

The scan is linear in its state, so the state entering part k follows from what each part
before it would leave from a zero state (recurrentgemma's `multi_shard_correction` passes
states the same way for a diagonal RNN):

1. each part's final state from a zero state, F_k = sum_s exp(sum_{u>s} dt_u A) dt_s x_s
   B_s^T over the tokens of its last document (one einsum, l h p n multiply-adds; no scan),
   and its total decay a_k = exp(sum_t dt_t A) (0 where the part holds a document start:
   the state resets there and nothing before it survives the part);
2. one all-gather over `axis_name` of (F, a, first and last seq_idx) [K, b, h, p, n] +
   [K, b, h] + [K, b, 2]: a few MB, independent of the sequence length (for segments of a
   row on one device, a reshape);
3. every part folds the parts before its own, S_{k+1} = c_{k+1} (a_k S_k + F_k) with
   S_0 = initial_state (or 0) and c_k = 0 where part k's first token starts a new document
   (its seq_idx differs from part k-1's last);
4. each part runs the scan once, entered by S_k as its initial state (the scan applies an
   initial state to the tokens before the row's first document start, as S_k must be).

So the whole costs one scan plus step 1's einsum, and no pass over y: an earlier version
scanned each part from zero and added the entering state's read-out exp(cumsum) C_t . S_k
to y afterwards, a float32 [l, h, p] product and a pass over y (a third of a long row's
forward by an estimate; docs/performance.md). Gradients flow through
the scan's initial state, the fold, the all-gather (its transpose is a reduce-scatter) and
the einsum.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels.ssd.reference import (accumulation_dtype, document_ids, process_dt,
                                          weighted_state)


def _zero_state_finals(x, dt, A, B, *, dt_bias, dt_softplus, dt_limit, seq_idx):
    """Step 1 for the parts in x's rows: F [b, h, p, n] (float32, float64 for float64 x), a
    [b, h], and the part's first and last seq_idx [b, 2]."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    acc = accumulation_dtype(x)
    # The same dt processing as the scan, so these decays are the scan's decays.
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit).astype(acc)  # [b, l, h]
    dA = dt * A.astype(acc)
    # The decay from each token to the part's end, as a sum over the tokens after it (a
    # reverse cumulative sum, exact where the decay is not negligible), not as a difference
    # of two long cumulative sums.
    to_end = jnp.exp(lax.cumsum(dA, axis=1, reverse=True) - dA)  # [b, l, h]
    weights = to_end * dt
    decay = jnp.exp(jnp.sum(dA, axis=1))  # [b, h]
    if seq_idx is not None:
        in_last, survives = last_document(document_ids(seq_idx))
        weights = weights * in_last[..., None]
        decay = decay * survives
    final = weighted_state(x.reshape(b, l, g, h // g, p), B,
                           weights.reshape(b, l, g, h // g), acc)
    return final.reshape(b, h, p, n), decay, part_ends(seq_idx, b)


def last_document(doc):
    """doc [rows, l] document ids -> (in_last [rows, l]: the positions of each row's last
    document, the only tokens whose input reaches the row's end; survives [rows, 1]: no
    document starts in the row, so a state entering it reaches its end)."""
    last = doc[:, -1:]
    return doc == last, last == 0


def part_ends(seq_idx, rows):
    """Each row's first and last seq_idx [rows, 2] int32; zeros without seq_idx (one
    document: every part continues the one before)."""
    if seq_idx is None:
        return jnp.zeros((rows, 2), jnp.int32)
    return jnp.stack([seq_idx[:, 0], seq_idx[:, -1]], axis=-1).astype(jnp.int32)


def entering_states(finals, decays, ends, initial_state):
    """Step 3: finals [K, b, h, p, n], decays [K, b, h], ends [K, b, 2] of the K parts in
    order -> the state entering each part [K, b, h, p, n] float32."""
    K, b, h, p, n = finals.shape
    state = (jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    entering = [state]
    for k in range(1, K):  # K is static and small; each step is [b, h, p, n]
        carried = decays[k - 1][..., None, None] * state + finals[k - 1]
        continues = ends[k, :, 0] == ends[k - 1, :, 1]  # [b]
        state = jnp.where(continues[:, None, None, None], carried, 0.0)
        entering.append(state)
    return jnp.stack(entering)


def ssd_context_parallel(scan, x, dt, A, B, C, *, axis_name, D=None, dt_bias=None,
                         dt_softplus=False, dt_limit=(0.0, math.inf), initial_state=None,
                         seq_idx=None, reverse=False):
    """This device's part of the SSD over a sequence split on `axis_name` (in shard_map).

    scan(x, dt, A, B, C, **options) -> (y, final_state): the single-device scan (ssd's
    chosen implementation), run once on the local part entered by the state the parts
    before it pass on (steps 1-4 above). Arguments and results as `pallas_kernels.ssd.ssd`
    for x [b, l, h, p] etc., with l this device's part; initial_state [b, h, p, n] enters
    the first part; final_state is the state after this device's last token. reverse: the
    parts are in reverse device order (each device passes its part flipped, the scan of a
    reversed sequence): the state passes from the last device to the first.
    """
    options = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   seq_idx=seq_idx)
    finals, decays, ends = lax.all_gather(_zero_state_finals(x, dt, A, B, **options),
                                          axis_name)
    index = lax.axis_index(axis_name)
    if reverse:
        finals, decays, ends = (jnp.flip(a, axis=0) for a in (finals, decays, ends))
        index = finals.shape[0] - 1 - index
    s_in = entering_states(finals, decays, ends, initial_state)[index]
    return scan(x, dt, A, B, C, D=D, initial_state=s_in, **options)


def entering_rows(finals, decays, ends, initial_state, segments):
    """Step 3 for rows split into `segments` parts that are scanned as rows of their own:
    finals [b * K, h, p, n], decays [b * K, h], ends [b * K, 2] of each row's parts in order,
    initial_state [b, h, p, n] entering each row -> the state entering each part
    [b * K, h, p, n] float32."""
    parts = lambda a: jnp.moveaxis(a.reshape(-1, segments, *a.shape[1:]), 1, 0)  # [K, b, ..]
    entering = entering_states(parts(finals), parts(decays), parts(ends), initial_state)
    return jnp.moveaxis(entering, 0, 1).reshape(finals.shape)


def ssd_segmented(scan, x, dt, A, B, C, *, segments, D=None, dt_bias=None, dt_softplus=False,
                  dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None):
    """The SSD of each row split into `segments` equal parts scanned at once as rows of
    their own, each entered by the state the parts before it pass on (steps 1-4 above).
    Arguments and results as `pallas_kernels.ssd.ssd` for x [b, l, h, p] etc.; l must be a
    multiple of segments."""
    b, l = x.shape[:2]
    K = segments
    rows = lambda a: None if a is None else a.reshape(b * K, l // K, *a.shape[2:])
    xr, dtr, Br, Cr = map(rows, (x, dt, B, C))
    options = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   seq_idx=rows(seq_idx))
    s_in = entering_rows(*_zero_state_finals(xr, dtr, A, Br, **options), initial_state, K)
    y, final = scan(xr, dtr, A, Br, Cr, D=D, initial_state=s_in, **options)
    return y.reshape(x.shape), final.reshape(b, K, *final.shape[1:])[:, -1]
