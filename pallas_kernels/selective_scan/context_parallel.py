"""The selective scan over a sequence split across devices (context parallelism), called
inside `jax.shard_map` with the sequence axis of x, dt, B, C and seq_idx split over the
mesh axis `axis_name`: device k holds part k of every row.

The scan is linear in its state, as Mamba2's (pallas_kernels.ssd.context_parallel, whose
fold this reuses): each part's final state from a zero state F_k and its total decay
a_k = exp(A sum_t dt_t) [b, d, n] (0 where the part holds a document start) are
all-gathered (a few MB: [K, b, d, n] twice, independent of the sequence length), every
device folds the parts before its own into the state entering it, and scans its part once
more entered by that state. Unlike the SSD, whose zero-state final is one einsum, Mamba-1's
per-(channel, state) decays have no matmul form: F_k is the scan's own final state, so a
device scans its part twice (the first pass keeps only the final state).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.ssd.context_parallel import entering_states, last_document, part_ends
from pallas_kernels.ssd.reference import document_ids


def selective_scan_context_parallel(scan, x, dt, A, B, C, *, axis_name, D=None,
                                    initial_state=None, seq_idx=None):
    """This device's part of the selective scan of processed dt over a sequence split on
    `axis_name`. scan(x, dt, A, B, C, D=, initial_state=, seq_idx=) -> (y, final_state):
    the single-device scan. Shapes as pallas_kernels.selective_scan with l this device's
    part; initial_state enters the first part; final_state is the state after this
    device's last token."""
    b, _, d = x.shape
    n = A.shape[-1]
    _, final = scan(x, dt, A, B, C, D=None, initial_state=None, seq_idx=seq_idx)
    decay = jnp.exp(A.astype(jnp.float32) * jnp.sum(dt.astype(jnp.float32), axis=1)[..., None])
    if seq_idx is not None:
        decay = decay * last_document(document_ids(seq_idx))[1][..., None]
    # As [b, d*n, 1, 1] "heads" of one state entry each: the SSD fold's layout.
    as_heads = lambda a: a.reshape(b, d * n, 1, 1)
    finals, decays, ends = lax.all_gather(
        (as_heads(final.astype(jnp.float32)), decay.reshape(b, d * n),
         part_ends(seq_idx, b)), axis_name)
    s_in = entering_states(finals, decays, ends, None if initial_state is None
                           else as_heads(initial_state))[lax.axis_index(axis_name)]
    return scan(x, dt, A, B, C, D=D, initial_state=s_in.reshape(b, d, n), seq_idx=seq_idx)
