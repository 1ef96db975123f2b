"""One decoding step of a Mamba2 layer between its projections: the conv window's shift, the
causal conv over it, dt, the SSM state update and its read-out (mamba_ssm's
causal_conv1d_update and selective_state_update), in plain JAX and as one Pallas kernel.

    y, conv_state, state = mamba_step(conv_state, zxbcdt, conv_w, conv_b, A, D, dt_bias,
                                      state, dt_limit=(0.0, inf), y_dtype=jnp.float32,
                                      implementation="xla")
    y, state = mamba_step_shifted(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state,
                                  ...)
    residual, state, sync = mamba_step_out(window, zxbcdt, conv_w, conv_b, A, D, dt_bias,
                                           state, residual, norm_weight, w_out, eps=1e-5,
                                           ngroups=g, sync=sync, ...)

Legend: b batch, h heads, p headdim, g groups, r = h // g heads per group, n d_state,
k d_conv, e = h*p + 2*g*n conv channels (x, then B, then C: mamba_ssm's xBC order).

conv_state [b, e, k]: the last k conv inputs before this token, newest last (the cache's
window), in the compute dtype. zxbcdt [b, h*p + e + h]: the input projection's output in
mamba_ssm's in_proj order z, xBC, dt, read in place (no slicing kernel runs between the
projection and the step), any float dtype. Its xBC [b, e] is this token's conv input (kept
rounded to conv_state's dtype, as the cache stores it): the conv sees conv_state shifted by
one with it appended, which is also the conv_state returned. Its dt [b, h] is used before
dt_bias, softplus (Mamba2's, always) and the dt_limit clamp, in float32. conv_w [e, k] and
conv_b [e] (or None): the depthwise conv. A [h] (negative), D [h], dt_bias [h] float32.
state [b, h, p, n], float32 or bfloat16. `mamba_step_shifted` takes the window already
shifted, with this token's input its last column (the batch-1 decoding step's in-projection
kernel, norm_matmul's `window=`, shifts it in place): no window copy after it.

Returns y [b, h, p] (C . h_new + D x, before the gated norm; computed in float32, returned
in y_dtype), the new conv_state (not from mamba_step_shifted), and the new state in state's
dtype, computed in float32. x, B and C leave the conv rounded to the window's dtype, as from
mamba_ssm's causal_conv1d_update.

`implementation`: "xla" (`reference`: XLA fuses it into about six kernels per layer) or
"triton" (`_step_kernel`, grid (b, h, p / bp), one kernel: each program convolves bp of its
head's x channels and its group's B and C channels (mamba_step: shifting their window too,
into a new buffer, since a group's programs read its old B and C columns while one of them
stores the shifted ones), reads its [bp, n] of the state once and writes it in place; bp < p
only where b * h is small, or as `blocks` (Blocks) sets; on a machine without a GPU it runs
in Pallas's interpreter). A decode step at batch 1 is bound by its kernel count, not its
bytes (BENCHMARKS.md, Generation): the window's shift and the projection's split are in
kernels rather than XLA fusions of their own. `mamba_step_out` goes on through the
out-projection, at batch 1 in the same kernel where it can (a cooperative launch, its
docstring).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import norm_matmul
from pallas_kernels.norm_matmul import shift_window
from pallas_kernels.ssd.reference import process_dt

IMPLEMENTATIONS = ("xla", "triton")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernel's tiles: headdim rows per program (block_p, a power of two dividing p) and
    warps per program. None: chosen from the shapes (`_triton`: the whole headdim unless
    batch x heads is small; 2 warps for a [block_p, n] tile of 8192 elements or more, else
    4)."""
    block_p: int | None = None
    num_warps: int | None = None


def mamba_step(conv_state, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, *,
               dt_limit=(0.0, math.inf), y_dtype=jnp.float32, implementation="xla",
               blocks=Blocks()):
    """See the module docstring for shapes and dtypes."""
    _check(conv_state, state, implementation)
    e, (h, p) = conv_state.shape[1], state.shape[1:3]
    xbc_at, dt_at = h * p, zxbcdt.shape[1] - h
    if implementation == "triton":
        return _triton(conv_state, (zxbcdt, xbc_at), conv_w, conv_b, (zxbcdt, dt_at), A, D,
                       dt_bias, state, dt_limit=dt_limit, y_dtype=y_dtype, blocks=blocks)
    y, window, state = reference(conv_state, zxbcdt[:, xbc_at:xbc_at + e], conv_w, conv_b,
                                 zxbcdt[:, dt_at:], A, D, dt_bias, state, dt_limit=dt_limit)
    return y.astype(y_dtype), window, state


def mamba_step_shifted(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, *,
                       dt_limit=(0.0, math.inf), y_dtype=jnp.float32, gate=False,
                       implementation="xla", blocks=Blocks()):
    """mamba_step after the window's shift: window [b, e, k] already ends with this token's
    conv input (as norm_matmul.rms_norm_matmul(window=...) leaves it), dt is the last h
    columns of zxbcdt [b, N], read in place. Returns (y, the new state).

    gate: y, rounded to y_dtype, times silu(z) in float32, with z the first h*p columns of
    zxbcdt (its in_proj order): the gated RMSNorm's input (mamba_ssm's RMSNormGated,
    norm_before_gate=False), the values norm_matmul's `z=` computes, so that the
    out-projection's kernel, whose every program reads the whole row, need not gate it."""
    _check(window, state, implementation)
    b, h, p = state.shape[:3]
    dt_at = zxbcdt.shape[1] - h
    if implementation == "triton":
        return _triton(window, None, conv_w, conv_b, (zxbcdt, dt_at), A, D, dt_bias, state,
                       dt_limit=dt_limit, y_dtype=y_dtype, gate=gate, blocks=blocks)
    y, state = reference_shifted(window, conv_w, conv_b, zxbcdt[:, dt_at:], A, D, dt_bias,
                                 state, dt_limit=dt_limit)
    y = y.astype(y_dtype)
    if gate:
        z = zxbcdt[:, :h * p].reshape(b, h, p).astype(jnp.float32)
        y = y.astype(jnp.float32) * jax.nn.silu(z)
    return y, state


def _check(conv_state, state, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"mamba_step: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if implementation == "triton" and not supports(state.shape[2], state.shape[3],
                                                   conv_state.shape[2]):
        raise ValueError(f"mamba_step: implementation='triton' needs headdim, d_state and "
                         f"d_conv powers of two (headdim, d_state >= 16); got state "
                         f"{state.shape}, conv_state {conv_state.shape}: use 'xla'")


def supports(p, n, k):
    """Whether the kernel takes headdim p, d_state n and d_conv k (its loads are power-of-two
    blocks)."""
    return all(v & (v - 1) == 0 for v in (p, n, k)) and min(p, n) >= 16


def reference(conv_state, xBC_in, conv_w, conv_b, dt, A, D, dt_bias, state, *,
              dt_limit=(0.0, math.inf)):
    """mamba_step in plain JAX over zxbcdt's xBC_in [b, e] and dt [b, h], y in float32."""
    window = shift_window(conv_state, xBC_in)
    y, state = reference_shifted(window, conv_w, conv_b, dt, A, D, dt_bias, state,
                                 dt_limit=dt_limit)
    return y, window, state


def reference_shifted(window, conv_w, conv_b, dt, A, D, dt_bias, state, *,
                      dt_limit=(0.0, math.inf)):
    """The step after the window's shift, in plain JAX: -> (y in float32, new state)."""
    b, h, p, n = state.shape
    # HIGHEST: float32 products, as the kernel's, whatever XLA picks for these small dots
    # (its default precision allows TF32 for a float32 dot on a GPU).
    conv = jnp.einsum("bek,ek->be", window.astype(jnp.float32), conv_w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    if conv_b is not None:
        conv = conv + conv_b.astype(jnp.float32)
    xBC = jax.nn.silu(conv).astype(window.dtype).astype(jnp.float32)
    g = (xBC.shape[1] - h * p) // (2 * n)
    x = xBC[:, :h * p].reshape(b, h, p)
    B, C = (part.reshape(b, g, n) for part in jnp.split(xBC[:, h * p:], 2, axis=1))
    dt = process_dt(dt, dt_bias, True, dt_limit)  # [b, h] float32
    decay = jnp.exp(dt * A)
    B_h = jnp.repeat(B, h // g, axis=1)  # [b, h, n]
    C_h = jnp.repeat(C, h // g, axis=1)
    dtx = dt[:, :, None] * x  # [b, h, p]
    old = state.astype(jnp.float32)
    # y = C.h_new = decay * C.h_old + dtx * (C.B): both terms read the old state, so XLA
    # fuses the state update and the read-out into one pass over the state (read once,
    # written once) instead of writing h_new and reading it back.
    new = old * decay[:, :, None, None] + dtx[..., None] * B_h[:, :, None, :]
    y = (decay[:, :, None] * jnp.einsum("bhpn,bhn->bhp", old, C_h,
                                        precision=jax.lax.Precision.HIGHEST)
         + dtx * jnp.sum(B_h * C_h, axis=-1)[:, :, None] + D[:, None] * x)
    return y, new.astype(state.dtype)


def _softplus(v):
    # jax.nn.softplus's values (log(1 + e^v), v itself past 20 where they agree in float32),
    # in operations the Triton lowering has.
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def _step_kernel(conv_ref, *refs, **kw):
    _step_program(conv_ref, *refs, ids=(pl.program_id(0), pl.program_id(1), pl.program_id(2)),
                  **kw)


def _step_program(conv_ref, *refs, p, bp, n, r, g, k, xbc_at, dt_at, has_bias, dt_limit,
                  y_dtype, gate, ids, flat_y=False):
    """The kernel's work for program ids (bi, hi, pi); flat_y: y_ref is [b, h*p]."""
    shifts = xbc_at is not None  # else the window already ends with this token's input
    if shifts:
        xbc_ref, *refs = refs
    w_ref, *refs = refs
    if has_bias:
        bias_ref, *refs = refs
    dt_ref, A_ref, D_ref, dt_bias_ref, state_ref, y_ref, *refs = refs
    window_ref, new_ref = refs if shifts else (None, refs[0])
    bi, hi, pi = ids
    gi = hi // r
    h_p = conv_ref.shape[1] - 2 * g * n  # the x channels, h * p
    rows = pl.ds(pl.multiple_of(pi * bp, bp), bp)  # this program's bp of the head's p
    # The state first: its load, the largest, is then in flight during the conv.
    old = state_ref[bi, hi, rows, :].astype(jnp.float32)  # [bp, n]

    def conv(start, size, write):
        """silu(conv) of channels [start, start + size) -> [size] float32, rounded to the
        window's dtype; where the kernel shifts, stores those channels' shifted window where
        `write` (True, or a traced bool) holds. The window's columns are loaded and stored one
        at a time: k - 1 of them is no block size Triton takes."""
        channels = pl.ds(start, size)
        if shifts:
            columns = [conv_ref[bi, channels, j] for j in range(1, k)]
            columns.append(xbc_ref[bi, pl.ds(xbc_at + start, size)].astype(conv_ref.dtype))
        else:
            columns = [conv_ref[bi, channels, j] for j in range(k)]
        out = sum(column.astype(jnp.float32) * w_ref[channels, j].astype(jnp.float32)
                  for j, column in enumerate(columns))
        if has_bias:
            out = out + bias_ref[channels].astype(jnp.float32)

        def store():
            for j, column in enumerate(columns):
                window_ref[bi, channels, j] = column
        if shifts and write is True:
            store()
        elif shifts:
            pl.when(write)(store)
        return jax.nn.silu(out).astype(conv_ref.dtype).astype(jnp.float32)

    x = conv(hi * p + pi * bp, bp, True)
    # A group's B and C channels serve its r heads: its first head's first program stores
    # their window (the others read the old one, a separate buffer, so nothing races).
    first = (hi % r == 0) & (pi == 0)
    B = conv(h_p + gi * n, n, first)
    C = conv(h_p + g * n + gi * n, n, first)
    dt = _softplus(dt_ref[bi, dt_at + hi].astype(jnp.float32) + dt_bias_ref[hi])
    lo, hi_limit = dt_limit
    if lo > 0.0 or hi_limit < math.inf:
        dt = jnp.clip(dt, lo, hi_limit)
    decay = jnp.exp(dt * A_ref[hi])
    dtx = dt * x
    y = (decay * jnp.sum(old * C[None, :], axis=1) + dtx * jnp.sum(B * C)
         + D_ref[hi] * x).astype(y_dtype)
    if gate:  # z: dt_ref's (zxbcdt's) first h*p columns
        z = dt_ref[bi, pl.ds(hi * p + pi * bp, bp)].astype(jnp.float32)
        y = y.astype(jnp.float32) * jax.nn.silu(z)
    if flat_y:
        y_ref[bi, pl.ds(pl.multiple_of(hi * p + pi * bp, bp), bp)] = y
    else:
        y_ref[bi, hi, rows] = y
    new_ref[bi, hi, rows, :] = (old * decay + dtx[:, None] * B[None, :]).astype(new_ref.dtype)


def _filled_blocks(blocks, b, h, p, n):
    """(block_p, warps) of the step kernel: Blocks with its Nones filled."""
    # Heads' headdim split over programs until there are about two waves of them on an
    # H200's 132 SMs (a batch-1 step has only h programs otherwise), down to 16 rows each.
    bp = blocks.block_p or p // min(p // 16, 1 << max(0, math.ceil(math.log2(264 / (b * h)))))
    if bp & (bp - 1) or p % bp:
        raise ValueError(f"mamba_step: Blocks(block_p={bp}) must be a power of two dividing "
                         f"headdim {p}")
    # At batch 64 (bp = p = 64, n = 128) 2 warps took 0.87-0.88x the time of 4, and 8
    # warps 4.2-4.8x; at bp = 32, 4 warps beat 2 (bench/step.py, BENCHMARKS.md, Generation).
    return bp, blocks.num_warps or (2 if bp * n >= 8192 else 4)


def _step_call(conv_state, xbc, conv_w, conv_b, dt, A, D, dt_bias, state, *, bp, dt_limit,
               y_dtype, gate):
    """(the static options of `_step_program`, its operands in order) for _triton's
    arguments."""
    h, p, n = state.shape[1:]
    g = (conv_state.shape[1] - h * p) // (2 * n)
    (xbc, xbc_at), (dt, dt_at) = xbc or (None, None), dt
    options = dict(p=p, bp=bp, n=n, r=h // g, g=g, k=conv_state.shape[2], xbc_at=xbc_at,
                   dt_at=dt_at, has_bias=conv_b is not None, dt_limit=tuple(dt_limit),
                   y_dtype=jnp.dtype(y_dtype), gate=gate)
    args = (conv_state,) + (() if xbc is None else (xbc,)) + (conv_w,) + (
        () if conv_b is None else (conv_b,)) + (
        dt, A.astype(jnp.float32), D.astype(jnp.float32), dt_bias.astype(jnp.float32), state)
    return options, args


def _triton(conv_state, xbc, conv_w, conv_b, dt, A, D, dt_bias, state, *, dt_limit, y_dtype,
            gate=False, blocks=Blocks()):
    """The kernel; xbc and dt are (array, the column where xBC_in / dt starts in it), xbc
    None for a window already shifted (then no window is returned)."""
    b, h, p, n = state.shape
    bp, warps = _filled_blocks(blocks, b, h, p, n)
    options, args = _step_call(conv_state, xbc, conv_w, conv_b, dt, A, D, dt_bias, state,
                               bp=bp, dt_limit=dt_limit, y_dtype=y_dtype, gate=gate)
    # The state is updated in place; a shifted window is a new buffer (module docstring).
    window = [] if xbc is None else [jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)]
    out_shape = [jax.ShapeDtypeStruct((b, h, p), jnp.float32 if gate else y_dtype), *window,
                 jax.ShapeDtypeStruct(state.shape, state.dtype)]
    return pl.pallas_call(
        functools.partial(_step_kernel, **options), grid=(b, h, p // bp),
        interpret=jax.default_backend() != "gpu", name="mamba_step", out_shape=out_shape,
        input_output_aliases={len(args) - 1: len(out_shape) - 1},
        compiler_params=plgpu.CompilerParams(num_warps=warps),
    )(*args)


def mamba_step_out(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, residual,
                   norm_weight, w_out, *, eps, ngroups, bias=None, sync=None,
                   dt_limit=(0.0, math.inf), y_dtype=jnp.float32, implementation="xla"):
    """The rest of a Mamba block's one-token step after its in-projection:
    mamba_step_shifted(gate=True), then the gated RMSNorm (norm_weight [h*p], eps, ngroups
    groups), out_proj (w_out [d, h*p], nn.Linear's layout, bias [d] or None) and the
    residual add (residual [b, d]) as norm_matmul.rms_norm_matmul computes them. Returns
    (residual [b, d], the new state, sync).

    sync: None, or an int32 [1] counter that only this function updates (zeros at first;
    carry it from one call to the next). On a GPU at batch 1 with it, "triton" runs both as
    one cooperative kernel: program j runs the step's program j and then out_proj's columns
    [j * bn, (j + 1) * bn); it issues the loads of its out_proj weights first, so that they
    are in flight through the latency-bound step, and between the two it waits at a grid-wide
    barrier (an atomic counter in sync) until every program's y is written. Its programs
    must all be resident at once, so it runs only where there are no more of them than the
    GPU holds (cooperative_programs); elsewhere, and in Pallas's interpreter (which runs
    programs one at a time), "triton" runs the step kernel and the norm-matmul kernel, one
    after the other, the same code per program."""
    b = state.shape[0]
    planned = _cooperative_plan(state, w_out, sync) if implementation == "triton" else None
    if planned is None:
        y, state = mamba_step_shifted(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state,
                                      dt_limit=dt_limit, y_dtype=y_dtype, gate=True,
                                      implementation=implementation)
        out = norm_matmul.rms_norm_matmul(
            y.reshape(b, -1), norm_weight, w_out, eps=eps, ngroups=ngroups, bias=bias,
            residual=residual, w_transposed=True, implementation=implementation)
        return out, state, sync
    return _cooperative(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, residual,
                        norm_weight, w_out, eps=eps, ngroups=ngroups, bias=bias, sync=sync,
                        dt_limit=dt_limit, y_dtype=y_dtype, plan=planned)


def cooperative_programs():
    """How many programs of 4 warps the GPU holds at once, at least: two an SM (a thread has
    at most 255 registers, so two programs take at most 2 x 128 x 255 of an SM's 65536; the
    kernel keeps nothing in shared memory but Triton's scratch for its reductions, and on an
    H200 256 programs of mamba2-1.3b's shapes, 1.94 an SM, ran 500 launches without a stall:
    BENCHMARKS.md, Generation); 0 off a GPU."""
    devices = jax.local_devices(backend="gpu") if jax.default_backend() == "gpu" else []
    return 2 * devices[0].core_count if devices else 0


def _cooperative_plan(state, w_out, sync):
    """(block_p, block_n, programs) of the cooperative kernel, or None where it does not
    run (mamba_step_out): the step kernel's tiles at 4 warps, out_proj's columns split
    evenly over its programs in a power of two of at most norm_matmul.SLAB_ELEMENTS
    weights each, and no more programs than cooperative_programs()."""
    b, h, p, n = state.shape
    if sync is None or b != 1:
        return None
    bp, warps = _filled_blocks(Blocks(), b, h, p, n)
    programs = h * (p // bp)
    d, k = w_out.shape
    bn = d // programs
    if (warps != 4 or d % programs or bn & (bn - 1) or bn * k > norm_matmul.SLAB_ELEMENTS
            or programs > cooperative_programs()):
        return None
    return bp, bn, programs


def _arrive_and_wait(sync_ref, programs, threads):
    """A grid-wide barrier on an int32 counter that only grows. Each program adds one once its
    threads' stores are done (a barrier of its threads, then the atomic: acquire-release at
    GPU scope, CUTLASS's semaphore pattern), then reads the counter with the same atomic
    (adding 0) until every program of the launch has arrived. A launch starts with the
    counter at a multiple of `programs`, and at most programs - 1 arrive before a program's
    own add, so the value it finds there says which multiple ends the launch. threads: off
    in Pallas's interpreter, which has none to hold at a barrier."""
    if threads:
        plgpu.debug_barrier()
    zero = jnp.zeros((), jnp.int32)  # the counter's index, and what a read adds
    arrived = plgpu.atomic_add(sync_ref, zero, zero + 1)
    target = (arrived // programs + 1) * programs
    # Polled by the atomic, not by plain (volatile) loads and an acquire after them: that
    # took about 30 us a token more in mamba2-1.3b (BENCHMARKS.md, Generation). carry[1] * 0
    # is a zero made in the loop: Pallas's interpreter takes no constant array there.
    jax.lax.while_loop(lambda carry: carry[0] < carry[1],
                       lambda carry: (plgpu.atomic_add(sync_ref, carry[1] * 0, carry[1] * 0),
                                      carry[1]),
                       (arrived + 1, target))
    if threads:
        plgpu.debug_barrier()


def _step_out_kernel(*refs, n_step, n_out, step_options, out_options, blocks_per_head,
                     programs):
    step_in, out_in = refs[:n_step], refs[n_step:n_step + n_out]
    # after the inputs' counter (the same buffer as the output's)
    y_ref, state_ref, out_ref, sync_ref = refs[n_step + n_out + 1:]
    j = pl.program_id(0)

    def step():
        _step_program(*step_in, y_ref, state_ref,
                      ids=(0, j // blocks_per_head, j % blocks_per_head), flat_y=True,
                      **step_options)
        _arrive_and_wait(sync_ref, programs, jax.default_backend() == "gpu")

    bn = out_options["bn"]
    norm_matmul._columns(y_ref, *out_in, out_ref, start=pl.multiple_of(j * bn, bn),
                         after_load=step, **out_options)


def _cooperative(window, zxbcdt, conv_w, conv_b, A, D, dt_bias, state, residual, norm_weight,
                 w_out, *, eps, ngroups, bias, sync, dt_limit, y_dtype, plan):
    """The cooperative kernel of mamba_step_out for plan (_cooperative_plan)."""
    b, h, p, n = state.shape
    bp, bn, programs = plan
    step_options, step_args = _step_call(window, None, conv_w, conv_b,
                                         (zxbcdt, zxbcdt.shape[1] - h), A, D, dt_bias, state,
                                         bp=bp, dt_limit=dt_limit, y_dtype=y_dtype, gate=True)
    out_options, out_args, _ = norm_matmul.kernel_call(
        norm_weight, w_out, eps=eps, z=None, ngroups=ngroups, bias=bias, residual=residual,
        w_transposed=True, window=None, out_dtype=w_out.dtype, activation=None,
        blocks=norm_matmul.Blocks(block_n=bn))
    kernel = functools.partial(_step_out_kernel, n_step=len(step_args), n_out=len(out_args),
                               step_options=step_options, out_options=out_options,
                               blocks_per_head=p // bp, programs=programs)
    args = (*step_args, *out_args, sync)
    # y (gated, float32) goes through global memory from each program to all of them
    _, state, out, sync = pl.pallas_call(
        kernel, grid=(programs,), name="mamba_step_out",
        interpret=jax.default_backend() != "gpu",
        out_shape=[jax.ShapeDtypeStruct((b, h * p), jnp.float32),
                   jax.ShapeDtypeStruct(state.shape, state.dtype),
                   jax.ShapeDtypeStruct(residual.shape, residual.dtype),
                   jax.ShapeDtypeStruct(sync.shape, sync.dtype)],
        input_output_aliases={len(step_args) - 1: 1, len(args) - 1: 3},  # state, counter
        compiler_params=plgpu.CompilerParams(num_warps=4),
    )(*args)
    return out, state, sync
