"""The SSD scan over a sequence split into K parts that are scanned at the same time: across
devices (context parallelism, `ssd_context_parallel`) or within each row on one device
(`ssd_segmented`, which gives the kernels K times the programs when batch x heads is too
small to fill the GPU).

ssd_context_parallel is called inside `jax.shard_map` with the sequence axis of x, dt, B, C
and seq_idx split over the mesh axis `axis_name`: device k holds part k of every row. Legend
as in reference.py (b batch, l one part of the sequence, h heads, p headdim, g groups, r
heads per group, n d_state), plus K parts.

The scan is linear in its state, so part k's outputs are its outputs from a zero state
plus the contribution of the state S_k entering it (recurrentgemma's
`multi_shard_correction` does the same for a diagonal RNN):

1. each device scans its part from zero, giving y0 and its final state F_k, and the part's
   total decay a_k = exp(sum_t dt_t A) (0 where the part holds a document start: the state
   resets there and nothing before it survives the part);
2. one all-gather over `axis_name` of (F, a, first and last seq_idx) [K, b, h, p, n] +
   [K, b, h] + [K, b, 2]: a few MB, independent of the sequence length (for segments of a
   row on one device, a reshape);
3. every device folds the parts before its own, S_{k+1} = c_{k+1} (a_k S_k + F_k) with
   S_0 = initial_state (or 0) and c_k = 0 where part k's first token starts a new document
   (its seq_idx differs from part k-1's last), and keeps S_k;
4. y_t += exp(cumsum(dt A)_t) C_t . S_k for the tokens before part k's first document
   start (the others never see S_k).

The correction (step 4) costs one readout of the state, O(l h p n), like the chunked
scan's own inter-chunk term; rerunning the scan from S_k would cost a second full scan.
Gradients flow through the all-gather (its transpose is a reduce-scatter) and the fold.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels.ssd.reference import document_ids, process_dt


def _zero_state_scan(scan, x, dt, A, B, C, *, D, dt_bias, dt_softplus, dt_limit, seq_idx):
    """Step 1 for the parts in x's rows: y0, F, a as above, the decay from each part's
    start to each token [b, l, h], whether each token precedes the part's first document
    start [b, l] and the part's first and last seq_idx [b, 2]."""
    b, l = x.shape[:2]
    y0, final0 = scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                      dt_limit=dt_limit, seq_idx=seq_idx)
    # The same dt processing as the scan, so the decays below are the scan's decays.
    dA_cs = jnp.cumsum(process_dt(dt, dt_bias, dt_softplus, dt_limit).astype(jnp.float32)
                       * A.astype(jnp.float32), axis=1)  # [b, l, h]
    if seq_idx is None:
        first_doc = jnp.ones((b, l), bool)  # every token continues the entering state
        ends = jnp.zeros((b, 2), jnp.int32)
    else:
        first_doc = document_ids(seq_idx) == 0  # [b, l]: before the part's first doc start
        ends = jnp.stack([seq_idx[:, 0], seq_idx[:, -1]], axis=-1).astype(jnp.int32)
    decay = jnp.exp(dA_cs[:, -1]) * first_doc[:, -1:]  # [b, h]
    return y0, final0, decay, dA_cs, first_doc, ends


def _entering_states(finals, decays, ends, initial_state):
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


def _corrected(y0, final0, decay, dA_cs, first_doc, C, s_in):
    """Step 4 for the parts in the rows of y0 [b, l, h, p], each entered by s_in
    [b, h, p, n]: (y, the state after the part)."""
    b, l, h, p = y0.shape
    g, n = C.shape[2:]
    weight = jnp.exp(dA_cs) * first_doc[..., None]  # [b, l, h]
    readout = jnp.einsum("blgn,bgrpn->blgrp", C.astype(jnp.float32),
                         s_in.reshape(b, g, h // g, p, n)).reshape(b, l, h, p)
    y = (y0.astype(jnp.float32) + weight[..., None] * readout).astype(y0.dtype)
    return y, decay[..., None, None] * s_in + final0


def ssd_context_parallel(scan, x, dt, A, B, C, *, axis_name, D=None, dt_bias=None,
                         dt_softplus=False, dt_limit=(0.0, math.inf), initial_state=None,
                         seq_idx=None):
    """This device's part of the SSD over a sequence split on `axis_name` (in shard_map).

    scan(x, dt, A, B, C, **options) -> (y, final_state): the single-device scan (ssd's
    chosen implementation), run on the local part from a zero state. Arguments and results
    as `pallas_kernels.ssd.ssd` for x [b, l, h, p] etc., with l this device's part;
    initial_state [b, h, p, n] enters the first part; final_state is the state after this
    device's last token.
    """
    y0, final0, decay, dA_cs, first_doc, ends = _zero_state_scan(
        scan, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=dt_limit, seq_idx=seq_idx)
    finals, decays, all_ends = lax.all_gather((final0, decay, ends), axis_name)
    s_in = _entering_states(finals, decays, all_ends, initial_state)[lax.axis_index(axis_name)]
    return _corrected(y0, final0, decay, dA_cs, first_doc, C, s_in)


def ssd_segmented(scan, x, dt, A, B, C, *, segments, D=None, dt_bias=None, dt_softplus=False,
                  dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None):
    """The SSD of each row split into `segments` equal parts scanned as rows of their own,
    then joined by the fold and correction above. Arguments and results as
    `pallas_kernels.ssd.ssd` for x [b, l, h, p] etc.; l must be a multiple of segments."""
    b, l = x.shape[:2]
    K = segments
    if l % K:
        raise ValueError(f"ssd: segments={K} must divide the sequence length {l}")
    rows = lambda a: None if a is None else a.reshape(b * K, l // K, *a.shape[2:])
    y0, final0, decay, dA_cs, first_doc, ends = _zero_state_scan(
        scan, rows(x), rows(dt), A, rows(B), rows(C), D=D, dt_bias=dt_bias,
        dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=rows(seq_idx))
    parts = lambda a: jnp.moveaxis(a.reshape(b, K, *a.shape[1:]), 1, 0)  # [K, b, ...]
    s_in = _entering_states(parts(final0), parts(decay), parts(ends), initial_state)
    y, final = _corrected(y0, final0, decay, dA_cs, first_doc, rows(C),
                          jnp.moveaxis(s_in, 0, 1).reshape(final0.shape))
    return y.reshape(x.shape), final.reshape(b, K, *final.shape[1:])[:, -1]
