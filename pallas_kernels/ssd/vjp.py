"""The SSD scan on a kernel backend: XLA preprocessing around a `jax.custom_vjp` core.

Legend: b batch, l sequence, h heads, p headdim, g groups, n d_state, t the backend's
kernel chunk.

The core takes what the kernels need, all chunk-padded: x, dt [b, h, l] after softplus, cs
[b, h, l] (the chunk-local cumulative sum of dt * A), B, C, initial_state, doc [b, l], and
D [h, p] float32 (the skip y += D x, inside the kernels: as an XLA fusion after the
forward kernel it read y and x and wrote y again, a large share of a forward's kernel
time, and its gradient was more passes over dy, x and dx; docs/performance.md). Its
custom_vjp pairs the backend's `forward` and `backward`. Everything around it (dt bias,
softplus and clamp, padding, the cumulative sum, D's broadcast to [h, p]) is ordinary JAX,
so automatic
differentiation carries the core's gradients to dt, A, D, dt_bias: d(cs) turns into dt and A
gradients through cumsum's transpose.

With `segments` K > 1 each row is scanned as K parts at once, rows of their own, joined
inside the custom_vjp: the forward finds the state entering each part from the
parts' zero-state final states (`weighted_state` over x and B; the fold of
context_parallel.py's steps 1-3) and runs the kernels once with those initial states. The
backward runs the kernels' backward once, with each part's final-state cotangent set to the
gradient of the state its last token passes on: that state is the next part's initial
state, whose gradient is the next part's read-out of it (`weighted_state` over dy and C)
plus what its own final state passes back. So the kernels' backward carries the join's
gradients to x, B and dt: no einsum's transpose over x-sized float32 arrays (a visible
share of a long row's forward+backward; docs/performance.md).

A backend is a module with `Config`, `forward(x, dt, cs, B, C, initial_state, doc, *,
config, D, rotation, keep_states, interpret)`, `chunk_states(x, dt, cs, B, initial_state,
doc, *, config, rotation, interpret)`, `backward(x, dt, cs, B, C, doc, states, dy, dfinal,
*, config, D, rotation, interpret)`, `weighted_state(x, B, weights, *, config, rotation,
interpret)`, `turned(B, C, rotation)` and `turned_back(grads, B, C, rotation, *, config,
interpret)` as in `triton.py`. With a `rotation` (Mamba-3's rotary embedding), the forward
turns each head's B and C itself; by `config.turns_in_backward` the backward kernels turn B
and C too, or take the per-head turned copies `turned` makes. Their dB and dC are per head,
of the turned values, and `turned_back` (or `turned`'s vjp) carries them to the group's B
and C, the angles and the biases.

What the backward recomputes rather than the forward keeps: the per-chunk states, with
`chunk_states` (at t = 64 and d_state 128 they are twice x's bytes; kept from the forward
kernel instead with `Config.keep_states`), and, given `inputs`,
x, B and C themselves, from what they are computed of (Mamba2's conv over its projections:
x's bytes again, for an elementwise pass). Kept, the two were 50 of the 145 MB a
mamba2-1.3b layer kept per 2048-token row in training.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.ssd.context_parallel import entering_rows, last_document, part_ends
from pallas_kernels.ssd.reference import document_ids, process_dt
from pallas_kernels.triton_call import off_gpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _core(backend, config, interpret, segments, rank, prepare, dt, cs, initial_state, doc, D,
          skip, eta, ends, rotation, *inputs):
    return _forward(backend, config, interpret, segments, rank, prepare, dt, cs,
                    initial_state, doc, D, skip, eta, ends, rotation, *inputs,
                    keep_states=False)[0]


def _core_fwd(backend, config, interpret, segments, rank, prepare, dt, cs, initial_state, doc,
              D, skip, eta, ends, rotation, *inputs):
    return _forward(backend, config, interpret, segments, rank, prepare, dt, cs,
                    initial_state, doc, D, skip, eta, ends, rotation, *inputs,
                    keep_states=config.keep_states)


def _forward(backend, config, interpret, segments, rank, prepare, dt, cs, initial_state, doc,
             D, skip, eta, ends, rotation, *inputs, keep_states):
    """The kernels' forward over rows x, B, C = prepare(*inputs) ([b * segments, l, h, p]
    etc., chunk-padded), the initial_state [b, h, p, n] float32 entering each row's first
    part (None: zeros, which the backward then makes again rather than keeps), and
    ends [b * segments, 2], each part's first and last seq_idx (context_parallel.part_ends)
    -> ((y, the final state of each row's last part), the backward's residuals, with the
    per-chunk states where keep_states, else None)."""
    x, B, C = prepare(*inputs)
    decays = None
    if segments > 1:  # the state entering each part
        to_end, _, decays = _part_decays(cs, config.chunk)
        if doc is not None:  # as the kernels' final state
            in_last, survives = last_document(doc)
            to_end, decays = to_end * in_last[:, None], decays * survives
        finals = backend.weighted_state(x, B, to_end * dt, config=config, rotation=rotation,
                                        interpret=interpret)
        initial_state = entering_rows(finals, decays, ends, initial_state, segments)
    entering = _zeros_if_none(initial_state, x, B)
    y, final_state, *states = backend.forward(
        x, dt, cs, B, C, entering, doc, config=config, D=D, skip=skip, eta=eta, rank=rank,
        rotation=rotation, keep_states=keep_states, interpret=interpret)
    final_state = final_state[segments - 1::segments]
    # The backward recomputes x, B, C from the inputs, and the per-chunk states from those
    # (backend.chunk_states) unless kept.
    return (y, final_state), (inputs, dt, cs, initial_state, doc, D, skip, eta, decays, ends,
                              rotation, states[0] if keep_states else None)


def _core_bwd(backend, config, interpret, segments, rank, prepare, residuals, cotangents):
    inputs, dt, cs, initial_state, doc, D, skip, eta, decays, ends, rotation, states = residuals
    (x, B, C), prepare_vjp = jax.vjp(prepare, *inputs)
    turning = None  # the rotation the kernels apply as they load B and C
    if rotation is not None:  # the kernels' dB and dC are per head, of the turned B and C
        if config.turns_in_backward(x.shape[0], x.shape[2]):
            turning = rotation
            turned_vjp = functools.partial(backend.turned_back, B=B, C=C, rotation=rotation,
                                           config=config, interpret=interpret)
        else:  # the kernels read per-head turned copies
            (B, C), turned_vjp = jax.vjp(backend.turned, B, C, rotation)
    if states is None:
        states = backend.chunk_states(x, dt, cs, B, _zeros_if_none(initial_state, x, B), doc,
                                      config=config, rotation=turning, interpret=interpret)
    dy, dfinal = cotangents
    dy, dfinal = dy.astype(x.dtype), dfinal.astype(jnp.float32)
    if segments > 1:
        _, from_start, _ = _part_decays(cs, config.chunk)
        if doc is not None:  # the entering state reaches the part's first document only
            from_start = from_start * (doc == 0)[:, None]
        # C as the kernels read it: turned with C's biases (in B's place), or the copies.
        swapped = None if turning is None else (turning[0], turning[2], turning[1])
        read_out = backend.weighted_state(dy, C, from_start, config=config, rotation=swapped,
                                          interpret=interpret)
        dfinal = _passed_state_gradients(read_out, decays, ends, dfinal, segments)
    dx, ddt, dcs, dB, dC, dinit, dD, dskip, deta = backend.backward(
        x, dt, cs, B, C, doc, states, dy, dfinal, config=config, D=D, skip=skip, eta=eta,
        rank=rank, rotation=turning, interpret=interpret)
    dB, dC = dB.astype(B.dtype), dC.astype(C.dtype)
    drotation = None
    if rotation is not None:
        dB, dC, drotation = turned_vjp((dB, dC))
    dinputs = prepare_vjp((dx, dB, dC))
    dinit = None if initial_state is None else dinit[::segments]
    return (ddt, dcs, dinit, None, dD, dskip, deta, None, drotation,
            *(None if d is None or d.dtype == jax.dtypes.float0 else d for d in dinputs))


_core.defvjp(_core_fwd, _core_bwd)


def _zeros_if_none(state, x, B):
    """state, or the zero state [rows, h, p, n] float32 of x [rows, l, h, p], B [.., n]."""
    return jnp.zeros(x.shape[:1] + x.shape[2:] + B.shape[-1:], jnp.float32) if state is None \
        else state


def _part_decays(cs, t):
    """cs [rows, h, l] (the cumulative sums of dt * A restarted every t positions) ->
    (to_end, from_start [rows, h, l]: the decay from after each position to the row's end,
    and from its start through each position; across [rows, h]: the whole row's), float32.
    Each is a sum of chunk totals and one chunk-local difference, as in the kernels: never a
    difference of two long sums."""
    rows, h, l = cs.shape
    cs = cs.reshape(rows, h, l // t, t)
    total = cs[..., -1]  # [rows, h, chunks]
    zero = jnp.zeros_like(total[..., :1])
    before = jnp.concatenate([zero, jnp.cumsum(total, -1)[..., :-1]], -1)
    after = jnp.concatenate([jax.lax.cumsum(total, 2, reverse=True)[..., 1:], zero], -1)
    to_end = jnp.exp(total[..., None] - cs + after[..., None])
    from_start = jnp.exp(cs + before[..., None])
    return (to_end.reshape(rows, h, l), from_start.reshape(rows, h, l),
            jnp.exp(jnp.sum(total, -1)))


def _passed_state_gradients(read_out, decays, ends, dfinal, segments):
    """The cotangent of each part's final state [rows, h, p, n]: the gradient of the state it
    passes to the next part, which is that part's initial state: the gradient of the next
    part's read-out of it (read_out [rows, h, p, n], sum_t from_start_t dy_t C_t^T), plus
    what the next part's own final state passes back through its decay (decays [rows, h]);
    zero where the next part starts a new document (ends [rows, 2], each part's first and
    last seq_idx); dfinal [b, h, p, n] for each row's last part."""
    rows, h, p, n = read_out.shape
    read_out = read_out.reshape(-1, segments, h, p, n)
    decays = decays.reshape(-1, segments, h)[..., None, None]
    ends = ends.reshape(-1, segments, 2)
    passed = [dfinal]
    for k in range(segments - 1, 0, -1):  # the state entering part k is part k-1's final
        continues = (ends[:, k, 0] == ends[:, k - 1, 1])[:, None, None, None]
        passed.append(jnp.where(continues, read_out[:, k] + decays[:, k] * passed[-1], 0.0))
    return jnp.stack(passed[::-1], 1).reshape(rows, h, p, n)


def ssd(x, dt, A, B, C, *, backend, config=None, interpret=None, D=None, dt_bias=None,
        dt_softplus=False, dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None,
        segments=1, inputs=None):
    """The SSD scan on `backend` (shapes and semantics as reference.ssd_chunked; any l).

    interpret=None runs the backend's Pallas interpreter when no GPU is present (CI).
    segments: each row scanned as this many parts at once (module docstring); it must divide
    l (pallas_kernels.ssd.ssd checks it). inputs: (fn, args) with x, B and C None: the scan
    of x, B, C = fn(*args), which the custom_vjp computes itself and recomputes in the
    backward pass from args rather than keeping them (pallas_kernels.ssd.ssd).
    Returns (y [b, l, h, p] in x.dtype, final_state [b, h, p, n] float32).
    """
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit).astype(jnp.float32)
    return ssd_weighted(x, dt, dt * A.astype(jnp.float32), B, C, backend=backend,
                        config=config, interpret=interpret, D=D, initial_state=initial_state,
                        seq_idx=seq_idx, segments=segments, inputs=inputs)


def ssd_weighted(x, weights, log_decay, B, C, *, backend, config=None, interpret=None, D=None,
                 initial_state=None, seq_idx=None, segments=1, inputs=None, rotation=None,
                 skip=None, eta=None, rank=1):
    """The scan h_t = exp(log_decay_t) h_{t-1} + weights_t x_t B_t^T, y_t = h_t C_t + D x_t
    (+ skip_t x_t) on `backend`: the SSD with its decay given per token instead of dt_t * A
    (Mamba-3's data-dependent A, and its trapezoid's weights). weights, log_decay [b, l, h]
    (float32); skip [b, l, h] float32 or None, a per-position skip applied in the kernels
    (Mamba-3 SISO's own-token term); other arguments (inputs too) and the result as `ssd`.
    rank, eta [b, l, h] float32 or None: the positions form tokens of `rank` consecutive
    positions (rank dividing the kernels' chunk and each segment's positions), and y_t reads
    every position s of its own token, those after t too:
        y_t = sum_{token(s) <= token(t)} exp(L_t - L_s) w_ts (C_t . B_s) x_s + D x_t,
    L the cumulative sum of log_decay, w_ts = weights_s, less eta_s where s is in t's token.
    Mamba-3 MIMO's own-token terms: the ranks after t, and for every rank the part of the
    token's weight that belongs to the next token; it puts a token's decay on its first
    position, so L_t = L_s inside a token. Computed in the kernels' intra-chunk products,
    eta's gradient with the others (triton.forward's `eta`). With one position a token the
    term is a per-position skip: as `skip`, computed outside, the SISO scan took less time
    than as rank 1 and eta, whose [t, s] selects cost more than the skip's products in XLA
    (docs/performance.md).
    rotation: None, or (theta [b, l / rank, h, a], C_bias, B_bias [h, q, n]; position s adds
    the biases' row s % q): each head reads B and C with its biases, turned by its angles,
    its token's (Mamba-3's rotary embedding, the same for a token's MIMO ranks: read once a
    token): the forward
    kernel turns them as it loads them (triton.forward's `rotation`), the backward too or
    from per-head copies (Config.backward_turns); with segments, the parts' states are
    joined in the turned values too (`weighted_state`'s rotation). The kernels' cos and sin
    (triton.cos_and_sin) are within about 1e-7 for |theta| up to about 1e4: Mamba-3 passes its
    angles wrapped to [0, 2 pi)."""
    config = backend.Config() if config is None else config
    if interpret is None:
        interpret = off_gpu()
    make, args = inputs or ((lambda *xBC: xBC), (x, B, C))
    b, l_row, h, p = jax.eval_shape(make, *args)[0].shape
    rows = lambda a: a.reshape(b * segments, l_row // segments, *a.shape[2:])
    weights, log_decay = map(rows, (weights, log_decay))
    l = l_row // segments
    t = config.chunk
    pad = (-l) % t
    # Padded steps have weight 0 and decay 1 (log 0): no input, the state kept.
    by_head = lambda a: jnp.pad(a.astype(jnp.float32),
                                ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1)  # [b, h, l]
    dt = by_head(weights)
    cs = jnp.cumsum(by_head(log_decay).reshape(*dt.shape[:2], -1, t), axis=-1).reshape(dt.shape)
    doc = None
    if seq_idx is not None:
        seq_idx = rows(seq_idx)
        doc = jnp.pad(document_ids(seq_idx), ((0, 0), (0, pad)), mode="edge")
    ends = part_ends(seq_idx, b * segments)
    pad_l = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) if pad else a
    prepare = lambda *args: tuple(pad_l(rows(a)) for a in make(*args))
    state = None if initial_state is None else initial_state.astype(jnp.float32)
    if D is not None:  # [h] or [h, p]
        D = jnp.broadcast_to((D[:, None] if D.ndim == 1 else D).astype(jnp.float32), (h, p))
    if t % rank or l % rank:
        raise ValueError(f"ssd: tokens of rank {rank} must divide the kernels' chunk {t} and "
                         f"each segment's {l} positions")
    if rotation is not None:  # a token's angles, padded by whole tokens
        theta, C_bias, B_bias = rotation
        theta = theta.astype(jnp.float32).reshape(b * segments, l // rank, *theta.shape[2:])
        rotation = (jnp.pad(theta, [(0, 0), (0, pad // rank), (0, 0), (0, 0)]), C_bias,
                    B_bias)
    skip, eta = (None if a is None else by_head(rows(a)) for a in (skip, eta))
    y, final_state = _core(backend, config, interpret, segments, rank, prepare, dt, cs, state,
                           doc, D, skip, eta, ends, rotation, *args)
    return y[:, :l].reshape(b, l_row, h, p), final_state
