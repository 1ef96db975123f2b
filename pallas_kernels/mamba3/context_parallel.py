"""The Mamba-3 scan over a sequence split across devices (context parallelism), called inside
`jax.shard_map` with the sequence axis of every per-token input split over `axis_name`:
device k holds part k of every row. Legend as in reference.py, plus K parts.

The scan is linear in its SSM state and its angle is a sum, so, as for the SSD
(pallas_kernels.ssd.context_parallel), the state entering part k follows from what each
part before it leaves from a zero state:

1. each part's final Mamba3State from a zero state (its angle, its SSM state F_k over the
   tokens of its last document, its last rotated k and last x), its total decay
   a_k = exp(sum adt) and the trapezoid weight (1 - sigma) dt of its first token, which
   the previous part's last k and x take inside it; one pass of elementwise work and one
   einsum, no scan;
2. one all-gather of those ([K, b, h, p, n] and smaller, independent of the length);
3. every part folds the parts before its own: where part k-1 holds no document start, the
   state it leaves is the state it was entered with carried through it (the angle adds,
   the SSM state decays with the trapezoid's term of the entering k and x added first, and
   its own F and last k are rotated by the entering angle, because its tokens' angles
   count from there); where it does, only its own; and nothing crosses into a part whose
   first token starts a new document;
4. each part runs the scan once, entered by that state.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.mamba3.reference import (Mamba3State, entering_ssm, first_weight, prepare,
                                             rotate, wrap)
from pallas_kernels.ssd.context_parallel import last_document, part_ends
from pallas_kernels.ssd.reference import document_ids


def zero_state_finals(C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, mimo_x, rotary,
                      seq_idx):
    """Step 1: (the part's final Mamba3State from a zero state, its decay a [b, h], its first
    token's trapezoid weight [b, h], whether no document starts in it [b], its first and
    last seq_idx [b, 2])."""
    b = x.shape[0]
    theta, _, k, v, sigma, w, _ = prepare(C, B, x, dt, trap, angles, C_bias, B_bias,
                                          mimo_x=mimo_x, rotary=rotary, seq_idx=seq_idx)
    adt = adt.astype(w.dtype)
    to_end = jnp.exp(lax.cumsum(adt, axis=1, reverse=True) - adt)  # [b, l, h]
    decay = jnp.exp(jnp.sum(adt, axis=1))
    survives = jnp.ones((b,), bool)
    if seq_idx is not None:
        in_last, survives = last_document(document_ids(seq_idx))
        to_end = to_end * in_last[..., None]
        decay = decay * survives
        survives = survives[:, 0]
    kw = k.astype(w.dtype) * (to_end * w)[:, :, None, :, None]
    ssm = jnp.einsum("blrhp,blrhn->bhpn", v.astype(w.dtype), kw)
    final = Mamba3State(theta[:, -1], ssm, k[:, -1].astype(w.dtype), x[:, -1].astype(w.dtype))
    return final, decay, first_weight(sigma, dt), survives, part_ends(seq_idx, b)


def entering_states(finals: Mamba3State, decays, first_weights, survive, ends,
                    initial_state, mimo_x, rotary):
    """Step 3: the K parts' zero-state finals (each field [K, b, ...]), decays [K, b, h],
    first-token weights [K, b, h], survive [K, b] and ends [K, b, 2] -> the Mamba3State
    entering each part (fields [K, b, ...])."""
    K = decays.shape[0]
    state = (Mamba3State(*(jnp.zeros_like(f[0]) for f in finals)) if initial_state is None
             else Mamba3State(*(s.astype(f.dtype) for s, f in zip(initial_state, finals))))
    entering = [state]
    for k in range(1, K):  # K is static and small
        j = k - 1
        entered = entering_ssm(state, first_weights[j], mimo_x)
        own = Mamba3State(*(f[j] for f in finals))
        carried = Mamba3State(
            wrap(state.angle + own.angle),
            decays[j][..., None, None] * entered + rotate(own.ssm, state.angle[:, :, None],
                                                          rotary),
            rotate(own.k, state.angle[:, None], rotary), own.x)
        left = Mamba3State(*(jnp.where(_rows(survive[j], c), c, o)
                             for c, o in zip(carried, own)))
        continues = ends[k, :, 0] == ends[j, :, 1]
        state = Mamba3State(*(jnp.where(_rows(continues, s), s, 0.0) for s in left))
        entering.append(state)
    return Mamba3State(*(jnp.stack(f) for f in zip(*entering)))


def _rows(mask, t):
    return mask.reshape(mask.shape + (1,) * (t.ndim - 1))


def mamba3_context_parallel(scan, C, B, x, adt, dt, trap, angles, C_bias, B_bias, *,
                            axis_name, D=None, mimo_x=None, rotary="pairwise",
                            initial_state=None, seq_idx=None):
    """This device's part of the scan over a sequence split on `axis_name` (in shard_map).
    scan(...) -> (y, final_state): the single-device scan, run once on the local part
    entered by the state the parts before it pass on. Arguments and results as
    `pallas_kernels.mamba3.mamba3_scan`, with l this device's part."""
    options = dict(mimo_x=mimo_x, rotary=rotary, seq_idx=seq_idx)
    gathered = lax.all_gather(zero_state_finals(C, B, x, adt, dt, trap, angles, C_bias,
                                                B_bias, **options), axis_name)
    entering = entering_states(*gathered, initial_state, mimo_x, rotary)
    s_in = Mamba3State(*(f[lax.axis_index(axis_name)] for f in entering))
    return scan(C, B, x, adt, dt, trap, angles, C_bias, B_bias, D=D, initial_state=s_in,
                **options)
