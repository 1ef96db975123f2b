"""The SSD scan of Mamba2 behind one dispatch point.

    y = ssd(x, dt, A, B, C, chunk_size=256, D=D, dt_bias=dt_bias, dt_softplus=True)
    y, final_state = ssd(..., return_final_state=True)

Shapes (legend: b batch, l sequence, h heads, p headdim, g groups, n d_state):
x [b, l, h, p] (float32 or bfloat16), dt [b, l, h], A [h], B and C [b, l, g, n] with
h % g == 0, D [h] or [h, p], dt_bias [h], initial_state [b, h, p, n], seq_idx [b, l] ints
(the state restarts wherever it changes: packed documents). dt, A, D, dt_bias and states are
used in float32. y has x's dtype; final_state is float32.

`implementation`: "xla" (the chunked pure-JAX form, any platform), "triton" (Pallas kernels
lowered through Triton, triton.py; on a machine without a GPU they run in Pallas's
interpreter) or "auto" (the fastest implementation that supports the current device: "triton"
on Hopper GPUs, where it was measured faster (BENCHMARKS.md), for a headdim divisible by 16
(80, 96 and 192 in power-of-two blocks), a power-of-two d_state >= 16 and float32/bfloat16
inputs; "xla" elsewhere. On a Hopper GPU a shape or dtype the kernels do not take is logged
once, pallas_kernels.fallback, never a silent slow path).

`sequence_axis`: inside `jax.shard_map` with the sequence split over that mesh axis
(context parallelism), each device passes its part and the scan carries the state across
devices (context_parallel.py): the result is the scan of the whole sequence.

`reverse`: scan each row from its end to its start (a bidirectional layer's backward
direction): the scan of the reversed sequence, its y put back in the forward order; under
`sequence_axis` the state passes from the last device to the first. final_state is then the
state after the row's first token.

`segments`: split each row (each device's part, under `sequence_axis`) into this many equal
parts, scanned as rows of their own and joined by the same state passing: the result is
the same scan. For the kernels, which walk a row's chunks in order, it multiplies the
programs when batch x heads is too few for the GPU (one long sequence). The XLA path joins
the parts with one einsum over x and B for their states (context_parallel.ssd_segmented);
the kernels' custom_vjp joins them with one kernel over x and B in the forward and one over
dy and C in the backward, whose kernels then carry the join's gradients (vjp.py). 1 scans
each row whole. "auto" (the default, `auto_segments`): 8 where the kernels run, batch x
heads x 8 is at most 512 programs and each part keeps at least 8192 tokens, else 1:
at batch 1 x 65536 x 64 heads, 8 parts took less time than the whole row, and at batch 8
(512 rows) more (docs/performance.md).

`inputs=(fn, args)`, with x, B and C None: the scan of `x, B, C = fn(*args)` (Mamba2's conv
over its projections). The kernels compute them inside their custom_vjp and recompute them
in the backward pass from args instead of keeping them for it (vjp.py); the other paths
call fn first. fn must be a function of args alone (no traced values closed over).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import fallback, hardware
from pallas_kernels.ssd import reference, triton, vjp
from pallas_kernels.ssd.context_parallel import ssd_context_parallel, ssd_segmented
from pallas_kernels.ssd.reference import document_ids, process_dt

__all__ = ["ssd", "auto_segments", "document_ids", "process_dt", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "triton")


def ssd(x, dt, A, B, C, *, chunk_size, D=None, dt_bias=None, dt_softplus=False,
        dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None,
        return_final_state=False, sequence_axis=None, segments="auto", implementation="auto",
        inputs=None, reverse=False):
    """The chunked SSD scan; see the module docstring for shapes and dtypes."""
    if inputs is not None:
        if any(a is not None for a in (x, B, C)) or reverse:
            raise ValueError("ssd: with inputs=(fn, args), pass x, B and C as None (and no "
                             "reverse)")
        x, B, C = jax.eval_shape(inputs[0], *inputs[1])
    _check_shapes(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state, seq_idx)
    if reverse:
        flip = lambda a: None if a is None else jnp.flip(a, axis=1)
        x, dt, B, C, seq_idx = map(flip, (x, dt, B, C, seq_idx))
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"ssd: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   initial_state=initial_state, seq_idx=seq_idx)
    if implementation == "auto":
        implementation = "triton" if kernels_are_faster(x, B) else "xla"
    if segments == "auto":
        segments = auto_segments(*x.shape[:3], implementation)
    scan = functools.partial(_scan, chunk_size=chunk_size, implementation=implementation)
    if segments != 1:
        if not isinstance(segments, int) or segments < 1:
            raise ValueError(f"ssd: segments={segments!r} must be a positive int or 'auto'")
        if x.shape[1] % segments:
            raise ValueError(f"ssd: segments={segments} must divide the sequence length "
                             f"{x.shape[1]}")
        if implementation == "triton":
            scan = functools.partial(scan, segments=segments)  # joined in the kernels' vjp
        else:
            scan = functools.partial(ssd_segmented, scan, segments=segments)
    if inputs is not None:
        if implementation == "triton" and sequence_axis is None:
            scan = functools.partial(scan, inputs=inputs)  # computed in the kernels' vjp
            x = B = C = None
        else:
            x, B, C = inputs[0](*inputs[1])
    if sequence_axis is None:
        y, final_state = scan(x, dt, A, B, C, **options)
    else:
        y, final_state = ssd_context_parallel(scan, x, dt, A, B, C, axis_name=sequence_axis,
                                              reverse=reverse, **options)
    if reverse:
        y = jnp.flip(y, axis=1)
    return (y, final_state) if return_final_state else y


def auto_segments(b, l, h, implementation):
    """segments="auto" for rows of l tokens, b x h of them: 8 for the kernels where that
    gives at most 512 (row, head) programs and parts of at least 8192 tokens (the regime
    measured faster; the module docstring), else 1."""
    fits = b * h * 8 <= 512 and l % 8 == 0 and l // 8 >= 8192
    return 8 if implementation == "triton" and fits else 1


def _scan(x, dt, A, B, C, *, chunk_size, implementation, segments=1, inputs=None, **options):
    """One device's scan -> (y, final_state) with the chosen implementation; segments and
    inputs only for the kernels."""
    if implementation == "triton":
        # The kernels use their own chunk (triton.Config): the result is the same scan.
        return vjp.ssd(x, dt, A, B, C, backend=triton, segments=segments, inputs=inputs,
                       **options)
    return reference.ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, **options)


def kernels_are_faster(x, B):
    """"auto"'s choice for x [..., headdim] and B [..., d_state]: whether the kernels run
    (module docstring), a fallback logged once where they would but cannot."""
    if not hardware.measured_gpu():
        return False
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        fallback.log_once("ssd", f"x is {x.dtype} (the kernels take float32 and bfloat16)")
        return False
    if not triton.supports(x, B):
        fallback.log_once("ssd", f"headdim {x.shape[-1]} and d_state {B.shape[-1]} (the "
                          "kernels take a headdim divisible by 16 and a power-of-two "
                          "d_state >= 16)")
        return False
    return True


def _check_shapes(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state, seq_idx):
    if x.ndim != 4:
        raise ValueError(f"ssd: x must be [batch, seqlen, nheads, headdim], got shape {x.shape}")
    b, l, h, p = x.shape
    if B.ndim != 4 or B.shape[:2] != (b, l) or C.shape != B.shape:
        raise ValueError(f"ssd: B and C must both be [batch, seqlen, ngroups, d_state] = "
                         f"[{b}, {l}, g, n]; got B {B.shape}, C {C.shape}")
    g, n = B.shape[2:]
    if h % g:
        raise ValueError(f"ssd: nheads={h} is not divisible by ngroups={g}; "
                         f"use ngroups among {[d for d in range(1, h + 1) if h % d == 0]}")
    expected = {"dt": (dt, (b, l, h)), "A": (A, (h,)), "dt_bias": (dt_bias, (h,)),
                "initial_state": (initial_state, (b, h, p, n)), "seq_idx": (seq_idx, (b, l))}
    for name, (value, shape) in expected.items():
        if value is not None and value.shape != shape:
            raise ValueError(f"ssd: {name} must have shape {shape}, got {value.shape}")
    if D is not None and D.shape not in ((h,), (h, p)):
        raise ValueError(f"ssd: D must have shape ({h},) or ({h}, {p}), got {D.shape}")
    given = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias,
             "initial_state": initial_state}
    for name, value in given.items():  # an integer one was cast without a word
        if value is not None and not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"ssd: {name} of dtype {value.dtype}; give it in a floating-point "
                             "dtype (float32, or bfloat16 for x, B and C)")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"ssd: chunk_size must be a positive int, got {chunk_size!r}")
