"""The Mamba-3 scan on the SSD's Pallas kernels (pallas_kernels.ssd: forward and backward,
their custom_vjp), with XLA elementwise work around them.

Legend as reference.py. After `reference.prepare` (the angles, the rotated q and k, the
trapezoid weights w and eta), the scan is an SSD whose decay is adt and whose weight on
v_s k_s^T is w_s, read out through q, less a term local to each token:

    y_t,R = sum_{(s, r) <= (t, R)} exp(adt_{s+1} + ... + adt_t) w_s (q_t,R . k_s,r) v_s,r
            + sum_{r > R} w_t (q_t,R . k_t,r) v_t,r - eta_t sum_r (q_t,R . k_t,r) v_t,r
            + D v_t,R

The kernels run it over the l * r positions (t, r) in order, each with its rank's k (their
B), q (C) and v (x), the weight w_t, and the decay adt_t on the first rank of each token and
none on the others: the state at (t, R) then holds every token before t and ranks 0..R of
t, so what the sum above needs beyond that, the ranks after R of token t, is added here with
the next token's share of the diagonal (eta) taken off: an r x r product per token and
head. SISO is r = 1. The initial state enters with its previous token's trapezoid term
folded in, as in the chunked form. B and C are per head (the rotation's angle is per head).

Gradients: the kernels' custom_vjp for x, the weights, the decays, B, C, the initial state
and D; automatic differentiation carries them through the rotation, the angles and the
trapezoid weights to every input.

Memory: the rotated q and k are per head (g = 1 becomes h copies) and the rotation's
float32 intermediates are larger still, so neither is kept for the backward pass. The
kernels compute q, k and v inside their custom_vjp from C, B, x and the angle state theta
(ssd_weighted's `inputs`) and the backward recomputes them; the token's own-ranks term
takes q . k from the unrotated C and B (`token_products`). With the gate and the angles'
sum checkpointed too (mamba_jax.layers.mamba3, reference.token_terms), a mamba3-1.3b layer
on the kernels keeps 117 MB per 2048-token row in training, where it kept 744 MB (by
print_saved_residuals).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mamba3.reference import (Mamba3State, accumulation_dtype, entering_ssm,
                                             first_weight, rotated, token_terms, values)
from pallas_kernels.ssd import triton
from pallas_kernels.ssd.vjp import ssd_weighted


def mamba3_kernels(C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, D=None, mimo_x=None,
                   rotary="pairwise", initial_state=None, seq_idx=None, interpret=None):
    """Arguments and results as reference.mamba3_chunked (its chunk is the kernels' own);
    interpret=None runs Pallas's interpreter where there is no GPU."""
    b, l, h, p = x.shape
    r, _, n = C.shape[2:]
    acc = accumulation_dtype(x)
    init = None if initial_state is None else Mamba3State(*(s.astype(acc)
                                                            for s in initial_state))
    theta, sigma, w, eta = token_terms(x, dt, trap, angles, seq_idx=seq_idx,
                                       initial_angle=None if init is None else init.angle)
    h0 = None if init is None else entering_ssm(init, first_weight(sigma, dt), mimo_x)

    positions = lambda t: t.reshape(b, l * r, *t.shape[3:])  # [b, l, r, ...] -> (t, r) rows
    per_rank = lambda t: jnp.broadcast_to(t[:, :, None], (b, l, r, *t.shape[2:]))
    # What q, k and v are computed of (mimo_x only for MIMO: an argument, not a closure, so
    # that its gradient comes back through the kernels' vjp).
    args = (C, B, x, theta, C_bias, B_bias) + (() if mimo_x is None else (mimo_x,))

    def qkv(C, B, x, theta, C_bias, B_bias, mimo_x=None):
        return rotated(C, B, x, theta, C_bias, B_bias, mimo_x, rotary=rotary)

    def vkq_positions(*args):  # the kernels' x, B and C
        q, k, v = qkv(*args)
        return positions(v), positions(k), positions(q)

    first_rank = jnp.zeros((1, 1, r, 1), acc).at[:, :, 0].set(1.0)
    y, final_ssm = ssd_weighted(
        None, positions(per_rank(w)), positions(first_rank * adt.astype(acc)[:, :, None]),
        None, None, backend=triton, interpret=interpret, D=D, initial_state=h0,
        seq_idx=None if seq_idx is None else positions(per_rank(seq_idx)),
        inputs=(vkq_positions, args))
    y = y.reshape(b, l, r, h, p).astype(acc)

    @jax.checkpoint  # recomputes v in the backward pass rather than keep it
    def own_ranks(w, eta, C, B, x, C_bias, B_bias, mimo_x=None):
        """Each token's own ranks: those after R, not yet in the state at (t, R), and eta's
        share."""
        qk = token_products(C, B, C_bias, B_bias, h, acc)
        later = jnp.triu(jnp.ones((r, r), acc), 1)[None, None, :, :, None]  # [R, r]: r > R
        local = qk * (later * w[:, :, None, None] - eta[:, :, None, None])
        v = values(x, mimo_x, acc).astype(x.dtype)
        return jnp.einsum("blRrh,blrhp->blRhp", local.astype(v.dtype), v,
                          preferred_element_type=acc)
    y = y + own_ranks(w, eta, *args[:3], *args[4:])
    _, k_last, _ = qkv(*(a[:, -1:] if i < 4 else a for i, a in enumerate(args)))
    final = Mamba3State(theta[:, -1], final_ssm, k_last[:, 0], x[:, -1])
    return y.astype(x.dtype), final


def token_products(C, B, C_bias, B_bias, h, acc):
    """q_t,R . k_t,r [b, l, r, r, h] in acc for C, B [b, l, r, g, n] and their biases
    [h, r, n]: the products of one token's rotated q and k, taken before the rotation, which
    turns both by the same angle and so keeps their dot product. Summed as the group's
    C . B and the bias terms, no per-head q or k is made ([b, l, r, h, n], h / g copies of
    C and B)."""
    b, l, r, g, n = C.shape
    per_group = lambda bias: bias.astype(C.dtype).astype(acc).reshape(g, h // g, r, n)
    C, B = C.astype(acc), B.astype(acc)
    C_bias, B_bias = per_group(C_bias), per_group(B_bias)
    qk = (jnp.einsum("blRgn,blrgn->blRrg", C, B)[..., None]
          + jnp.einsum("blRgn,gGrn->blRrgG", C, B_bias)
          + jnp.einsum("gGRn,blrgn->blRrgG", C_bias, B)
          + jnp.einsum("gGRn,gGrn->RrgG", C_bias, B_bias))
    return qk.reshape(b, l, r, r, h)
