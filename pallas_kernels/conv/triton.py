"""The causal depthwise conv1d and SiLU as Pallas kernels lowered through Triton, forward and
backward (what mamba_ssm's causal_conv1d extension does for its fused training path).

Legend: b batch, r input rows, l outputs (the last l of the r: output t's own row, its last
tap's, is t + r - l), e channels, k taps, m = k - 1.

Each program walks a run of rows of one block of channels in order, with the last rows it
needs carried in registers: every row of x (and of dy) is read once, where blocks of rows
would read each row once per tap (a first version so built took longer than XLA's fusions,
bound by those re-reads). A step of the walk loads `step_rows` rows before it computes
any of them: one row a step waited out the memory's latency at every row.
- `_forward_kernel`, grid (b, e / be, l / run): at each own row T, y = silu(bias + sum_j
  w[j] x[T - m + j]) from the window of the last k rows (zeros before the first row, and in
  place of another document's rows).
- `parts`: the output's channels as consecutive parts, each its own array (Mamba2's x, B and
  C, which the SSD kernels read as three arrays: split after the kernel, they were copies
  of the conv's whole output, and their gradients a concatenation). A program's channel
  block lies in one part (be divides every part), and the program writes that part's array
  (and in the backward reads that part's dy).
- `_backward_kernel`, grid (b, e / be, r / run): at each row T it recomputes the
  pre-activation of the output whose own row is T and its gradient g (dy times SiLU's
  derivative), keeps the last k of them, and writes dx[T - m] = sum_j w[j] g[T - j] once the
  k outputs that row feeds are known: the walk runs m rows past its run. The outputs whose
  own rows are the run's give the weight's and the bias's gradients, float32 partials [b,
  runs, ...] summed after the kernel (no atomics: the bits do not vary).
- `before` [b, m, e]: the m rows before x's first (the previous device's last inputs under
  context parallelism, a continued sequence's window), read where the first run's window
  reaches before row 0, in place of zeros, with their document ids first in doc; their
  gradient is the first run's walk's dx of rows -m .. -1, which it computes on its way
  (written to dbefore, its own array). Without it those rows would be a copy of the whole
  input with them in front.

Rows are loaded at scalar indices with a mask (a row before the first or past the end reads
zeros), which Pallas's interpreter and the GPU treat alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.triton_call import call, present, split_optional


@dataclasses.dataclass(frozen=True)
class Config:
    """Rows a program walks (run), its channels (block_e, at most; a power of two) and the
    rows a step of its walk loads before it computes any (step_rows, a divisor of run: a
    row's loads wait on nothing of the row before, so several in flight at once hide the
    memory's latency that one row a step waited out at every row). With parts, the block
    divides every part: 128 channels at mamba2-1.3b's x, B, C of 4096, 128, 128. A run of 128
    rows re-reads k - 1 rows at its start. As the Mamba2 mixer calls the kernels (timed as
    bench.tiles times them), these runs beat the earlier runs of 64 rows one row a step
    both ways, and one warp suits the forward but not the backward, so each has its own
    warps (docs/performance.md)."""
    run: int = 128
    block_e: int = 256
    forward_warps: int = 1
    backward_warps: int = 2
    stages: int = 3
    step_rows: int = 8

    def __post_init__(self):
        if self.run % self.step_rows:
            raise ValueError(f"conv Config: step_rows {self.step_rows} must divide run "
                             f"{self.run}")


def supports(l: int, e: int, k: int, dtype, parts=None) -> bool:
    """Whether the kernels take l outputs of e channels through k taps in dtype, written as
    parts of these sizes (None: one), which a power of two of at least 16 must divide."""
    return (l >= 1 and e >= 16 and 2 <= k <= 8
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
            and (parts is None or len(parts) == 1 or _part_block(parts) >= 16))


class _Row:
    """One program's channels: loads and stores of single rows of them, masked outside."""

    def __init__(self, bi, ci, *, be, e, rows_in):
        self.bi, self.rows_in, self.be = bi, rows_in, be
        self.c0 = pl.multiple_of(ci * be, be)
        cols = self.c0 + jax.lax.broadcasted_iota(jnp.int32, (be,), 0)
        self.col_mask = None if e % be == 0 else cols < e

    def _mask(self, inside):
        inside = jnp.broadcast_to(inside, (self.be,))
        return inside if self.col_mask is None else inside & self.col_mask

    def load(self, ref, row, inside, start=0):
        """ref[bi, row, channels] in float32, zeros where not inside; start: the first
        channel ref holds (a part's)."""
        return plgpu.load(ref.at[self.bi, row, pl.ds(self.c0 - start, self.be)],
                          mask=self._mask(inside), other=0).astype(jnp.float32)

    def store(self, ref, row, value, inside, start=0):
        plgpu.store(ref.at[self.bi, row, pl.ds(self.c0 - start, self.be)],
                    value.astype(ref.dtype), mask=self._mask(inside))

    def by_part(self, parts, refs, walk):
        """walk(ref, start) with the array of the part that holds this program's channels and
        that part's first channel."""
        if len(parts) == 1:
            walk(refs[0], 0)
            return
        for ref, start, size in zip(refs, _starts(parts), parts):
            pl.when((self.c0 >= start) & (self.c0 < start + size))(
                functools.partial(walk, ref, start))

    def vector(self, ref, *index):
        """ref[*index, channels] in float32 (a weight's row or the bias)."""
        mask = self.col_mask
        index = tuple(jnp.int32(i) for i in index)  # Python ints: the interpreter's loads
        return plgpu.load(ref.at[(*index, pl.ds(self.c0, self.be))], mask=mask,
                          other=None if mask is None else 0).astype(jnp.float32)


def _starts(parts):
    """Each part's first channel."""
    return [sum(parts[:i]) for i in range(len(parts))]


def _doc(doc_ref, bi, row, rows_in, before):
    """The document of a row, -1 outside the input; doc_ref holds the `before` rows (0, or
    m) before x's first, then x's."""
    inside = (row >= -before) & (row < rows_in)
    return jnp.where(inside, doc_ref[bi, jnp.clip(row + before, 0, rows_in + before - 1)], -1)


def _earlier(row, x_ref, before_ref, T, m, x_start):
    """Row T >= -m of the input, at or before a run's first own row: x's where T >= 0, else
    before's (zeros without it)."""
    value = row.load(x_ref, T, T >= 0, -x_start)
    if before_ref is not None:
        value = value + row.load(before_ref, T + m, T < 0)
    return value


def _pre(w, bias, window, docs, own_doc):
    """bias + sum_j w[j] * window[j] (the k rows ending at the own row, oldest first), the
    rows of another document than the own row's left out."""
    acc = bias
    for j, (wj, xj) in enumerate(zip(w, window)):
        if docs is not None and j < len(w) - 1:
            xj = jnp.where(docs[j] == own_doc, xj, 0.0)
        acc = acc + wj * xj
    return acc


def _forward_kernel(x_ref, w_ref, *rest, k, run, step_rows, be, l, e, rows_in, parts, x_start,
                    has_bias, has_doc, has_before):
    bias_ref, rest = split_optional(rest, has_bias)
    doc_ref, rest = split_optional(rest, has_doc)
    before_ref, y_refs = split_optional(rest, has_before)
    bi = pl.program_id(0)
    row = _Row(bi, pl.program_id(1), be=be, e=e, rows_in=rows_in)
    m, off = k - 1, rows_in - l
    start = off + pl.program_id(2) * run  # the own row of the run's first output
    w = [row.vector(w_ref, j) for j in range(k)]
    bias = row.vector(bias_ref) if has_bias else jnp.zeros((be,), jnp.float32)
    first = start - m
    ahead = m if has_before else 0  # doc's rows before x's first
    window = tuple(_earlier(row, x_ref, before_ref, first + j, m, x_start) for j in range(m))
    docs = None if doc_ref is None else tuple(_doc(doc_ref, bi, first + j, rows_in, ahead)
                                              for j in range(m))

    def walk(y_ref, part_start):
        def step(i, carry):
            window, docs = carry
            Ts = [start + i * step_rows + r for r in range(step_rows)]
            xs = [row.load(x_ref, T, T < rows_in, -x_start) for T in Ts]
            own_docs = [None if docs is None else _doc(doc_ref, bi, T, rows_in, ahead)
                        for T in Ts]
            for T, x, own_doc in zip(Ts, xs, own_docs):
                pre = _pre(w, bias, window + (x,),
                           None if docs is None else docs + (own_doc,), own_doc)
                row.store(y_ref, T - off, jax.nn.silu(pre), T < rows_in, part_start)
                window, docs = window[1:] + (x,), None if docs is None else docs[1:] + (own_doc,)
            return window, docs

        jax.lax.fori_loop(0, run // step_rows, step, (window, docs))

    row.by_part(parts, y_refs, walk)


def _backward_kernel(x_ref, w_ref, *rest, k, run, step_rows, be, l, e, rows_in, parts,
                     x_start, has_bias, has_doc, has_before, dx_into):
    dy_refs, rest = rest[:len(parts)], rest[len(parts):]
    bias_ref, rest = split_optional(rest, has_bias)
    doc_ref, rest = split_optional(rest, has_doc)
    before_ref, rest = split_optional(rest, has_before)
    if dx_into:  # the buffer dx is written into, aliased to the output dx_ref
        rest = rest[1:]
    dx_ref, dw_ref, *rest = rest
    dbias_ref, rest = split_optional(rest, has_bias)
    dbefore_ref = rest[0] if has_before else None
    bi, ri = pl.program_id(0), pl.program_id(2)
    row = _Row(bi, pl.program_id(1), be=be, e=e, rows_in=rows_in)
    m, off = k - 1, rows_in - l
    start = ri * run  # the run's first input row: its dx, and the output owning it
    w = [row.vector(w_ref, j) for j in range(k)]
    bias = row.vector(bias_ref) if has_bias else jnp.zeros((be,), jnp.float32)
    first = start - m
    zeros = jnp.zeros((be,), jnp.float32)
    ahead = m if has_before else 0  # doc's rows before x's first
    window = tuple(_earlier(row, x_ref, before_ref, first + j, m, x_start) for j in range(m))
    docs = None if doc_ref is None else tuple(_doc(doc_ref, bi, first + j, rows_in, ahead)
                                              for j in range(m))
    # g of the m outputs whose own rows precede the run: they feed no row of the run
    gs = (zeros,) * m

    def walk(dy_ref, part_start):
        def step(i0, carry):
            Ts = [start + i0 * step_rows + r for r in range(step_rows)]
            xs = [row.load(x_ref, T, T < rows_in, -x_start) for T in Ts]
            dys = [row.load(dy_ref, T - off, (T >= off) & (T < rows_in), part_start)
                   for T in Ts]
            own_docs = [None if doc_ref is None else _doc(doc_ref, bi, T, rows_in, ahead)
                        for T in Ts]
            for r, (T, x, dy, own_doc) in enumerate(zip(Ts, xs, dys, own_docs)):
                carry = row_step(i0 * step_rows + r, T, x, dy, own_doc, carry)
            return carry

        def row_step(i, T, x, dy, own_doc, carry):
            window, docs, gs, dw, dbias = carry
            rows = window + (x,)
            row_docs = None if docs is None else docs + (own_doc,)
            pre = _pre(w, bias, rows, row_docs, own_doc)
            sig = jax.nn.sigmoid(pre)
            g = dy * sig * (1.0 + pre * (1.0 - sig))  # zero where there is no output
            # the run's own outputs (not the m rows walked past it) give dw and dbias
            g_own = jnp.where(i < run, g, 0.0)
            dw = tuple(dwj + g_own * (xj if row_docs is None or j == m else
                                      jnp.where(row_docs[j] == own_doc, xj, 0.0))
                       for j, (dwj, xj) in enumerate(zip(dw, rows)))
            dbias = dbias + g_own
            gs = gs + (g,)
            # dx of row s = T - m: tap j of the output whose own row is T - j (gs[m - j])
            s = T - m
            dx = zeros
            for j in range(k):
                gj = gs[m - j]
                if row_docs is not None:
                    gj = jnp.where(row_docs[m - j] == row_docs[0], gj, 0.0)
                dx = dx + w[j] * gj
            # rows walked past run + m (in the last step, where step_rows does not divide
            # run + m) are the next run's to write
            row.store(dx_ref, s, dx, (i >= m) & (i < run + m) & (s < rows_in),
                      -x_start if dx_into else 0)
            if dbefore_ref is not None:  # the first run's walk passes before's rows first
                row.store(dbefore_ref, s + m, dx, s < 0)
            return (rows[1:], None if row_docs is None else row_docs[1:], gs[1:], dw, dbias)

        carry = (window, docs, gs, (zeros,) * k, zeros)
        _, _, _, dw, dbias = jax.lax.fori_loop(0, pl.cdiv(run + m, step_rows), step, carry)
        for j in range(k):
            plgpu.store(dw_ref.at[bi, ri, jnp.int32(j), pl.ds(row.c0, be)], dw[j],
                        mask=row.col_mask)
        if has_bias:
            plgpu.store(dbias_ref.at[bi, ri, pl.ds(row.c0, be)], dbias, mask=row.col_mask)

    row.by_part(parts, dy_refs, walk)


def _options(x, w, l, parts, config, x_start):
    rows_in, e = x.shape[1], w.shape[1]
    if len(parts) > 1:  # a block lies in one part
        be = min(config.block_e, _part_block(parts))
    else:
        be = min(config.block_e, e & -e) if e % 16 == 0 else config.block_e
    return dict(k=w.shape[0], run=config.run, step_rows=config.step_rows, be=be, l=l, e=e,
                rows_in=rows_in, parts=parts, x_start=x_start)


def _part_block(parts):
    """The largest power of two that divides every part."""
    g = math.gcd(*parts)
    return g & -g


def forward(x, w, bias, doc, l, parts, *, config, interpret=False, x_start=0, before=None):
    """x [b, r, e], w [k, e], bias [e] or None, doc [b, r] int32 or None -> the last l outputs
    in x.dtype, as a tuple of their parts' arrays [b, l, part] (parts: sizes summing to e).
    x_start: x may be wider, its channels [x_start, x_start + e) the conv's (read in place,
    as from Mamba2's in-projection output). before: None (zeros stand before x), or the k - 1
    rows before x's first [b, k - 1, e] (module docstring); doc is then [b, k - 1 + r], their
    ids first."""
    b, e = x.shape[0], w.shape[1]
    o = _options(x, w, l, parts, config, x_start)
    kernel = functools.partial(_forward_kernel, **o, has_bias=bias is not None,
                               has_doc=doc is not None, has_before=before is not None)
    grid = (b, pl.cdiv(e, o["be"]), pl.cdiv(l, o["run"]))
    out_shape = [jax.ShapeDtypeStruct((b, l, size), x.dtype) for size in parts]
    return tuple(call(kernel, grid, out_shape, config.forward_warps, config.stages, interpret,
                      "conv1d_forward")(x, w, *present(bias, doc, before)))


def backward(x, w, bias, doc, dy, *, config, interpret=False, x_start=0, dx_into=None,
             before=None):
    """forward's inputs and dy (the output's cotangent: its parts [b, l, part]) -> (dx [b, r,
    e] in x.dtype, dw [k, e], dbias [e] or None, float32; dbefore [b, k - 1, e] in before's
    dtype, or None without before). dx_into: None (dx its own array), or a buffer of x's
    shape that dx is written into in place, at x's channels [x_start, x_start + e), the rest
    of it left as it is: Mamba2's in-projection gradient, whose other columns are the gate's
    and dt's."""
    b, rows_in = x.shape[:2]
    k, l, e = w.shape[0], dy[0].shape[1], w.shape[1]
    o = _options(x, w, l, tuple(d.shape[-1] for d in dy), config, x_start)
    runs = pl.cdiv(rows_in, o["run"])
    kernel = functools.partial(_backward_kernel, **o, has_bias=bias is not None,
                               has_doc=doc is not None, has_before=before is not None,
                               dx_into=dx_into is not None)
    out_shape = [jax.ShapeDtypeStruct((b, rows_in, e) if dx_into is None else x.shape,
                                      x.dtype),
                 jax.ShapeDtypeStruct((b, runs, k, e), jnp.float32)]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((b, runs, e), jnp.float32))
    if before is not None:
        out_shape.append(jax.ShapeDtypeStruct(before.shape, before.dtype))
    args = (x, w, *dy, *present(bias, doc, before, dx_into))
    dx, dw, *out = call(kernel, (b, pl.cdiv(e, o["be"]), runs), out_shape,
                        config.backward_warps, config.stages, interpret, "conv1d_backward",
                        None if dx_into is None else {len(args) - 1: 0})(*args)
    dbias = out.pop(0).sum(axis=(0, 1)) if bias is not None else None
    return dx, dw.sum(axis=(0, 1)), dbias, (out[0] if before is not None else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def conv1d(x, w, bias, doc, l, parts, config, interpret):
    """The causal conv and SiLU of x [b, r, e] through w [k, e], bias [e] or None, doc [b, r]
    int32 or None -> its last l outputs in x.dtype (zeros stand before x), a tuple of arrays
    [b, l, part] of the channels' consecutive parts (sizes summing to e)."""
    return forward(x, w, bias, doc, l, parts, config=config, interpret=interpret)


def _conv_fwd(x, w, bias, doc, l, parts, config, interpret):
    return (forward(x, w, bias, doc, l, parts, config=config, interpret=interpret),
            (x, w, bias, doc))


def _conv_bwd(l, parts, config, interpret, residuals, dy):
    x, w, bias, doc = residuals
    dx, dw, dbias, _ = backward(x, w, bias, doc, dy, config=config, interpret=interpret)
    ddoc = None if doc is None else jnp.zeros(doc.shape, jax.dtypes.float0)
    return dx, dw.astype(w.dtype), None if bias is None else dbias.astype(bias.dtype), ddoc


conv1d.defvjp(_conv_fwd, _conv_bwd)
