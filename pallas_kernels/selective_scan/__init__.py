"""Mamba-1's selective scan ("S6") behind one dispatch point.

    y = selective_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
    y, final_state = selective_scan(..., return_final_state=True)

Shapes (legend: b batch, l sequence, d channels = d_inner, n d_state): x [b, l, d] (float32
or bfloat16), dt [b, l, d] (before dt_bias and softplus), A [d, n] (= -exp(A_log)), B and C
[b, l, n] (one group, as every Mamba-1 checkpoint), D [d], dt_bias [d], initial_state
[b, d, n], seq_idx [b, l] ints (the state restarts wherever it changes: packed documents).
dt, A, D, dt_bias and the states are used in float32; y has x's dtype; final_state is
float32. The gate y * silu(z) of mamba_ssm's selective_scan_fn is the caller's (an XLA
fusion with the out_proj's input cast).

`implementation`: "xla" (xla.py: the recurrence chunk_size tokens per loop step, the state
the loop's carry, behind a custom_vjp that recomputes each step's states; any platform),
"triton" (the Pallas kernels of triton.py; without a GPU they run in Pallas's interpreter)
or "auto": "triton" on a GPU where the kernels take the shapes, "xla" elsewhere (the CPU).

`sequence_axis`: inside `jax.shard_map` with the sequence split over that mesh axis
(context parallelism): the state is carried across the devices (context_parallel.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.selective_scan import triton
from pallas_kernels.selective_scan.context_parallel import selective_scan_context_parallel
from pallas_kernels.selective_scan.xla import selective_scan_xla
from pallas_kernels.ssd.reference import document_ids, process_dt
from pallas_kernels.triton_call import off_gpu

__all__ = ["selective_scan", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "triton")


def selective_scan(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None,
                   return_final_state=False, sequence_axis=None, implementation="auto",
                   chunk_size=8):
    """The selective scan; see the module docstring for shapes and dtypes. chunk_size: the
    XLA form's tokens per loop step, unrolled (compile time grows with it) and recomputed
    in the backward pass from the state entering the step (saved: [b, l / chunk_size, d,
    n] float32)."""
    _check_shapes(x, dt, A, B, C, D, dt_bias, initial_state, seq_idx)
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"selective_scan: chunk_size must be a positive int, got "
                         f"{chunk_size!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"selective_scan: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if implementation == "auto":
        on_gpu = jax.default_backend() == "gpu"
        implementation = "triton" if on_gpu and triton.supports(*A.shape) else "xla"
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    scan = functools.partial(_scan, implementation=implementation, chunk_size=chunk_size)
    if sequence_axis is None:
        y, final_state = scan(x, dt, A, B, C, D=D, initial_state=initial_state,
                              seq_idx=seq_idx)
    else:
        y, final_state = selective_scan_context_parallel(
            scan, x, dt, A, B, C, D=D, initial_state=initial_state, seq_idx=seq_idx,
            axis_name=sequence_axis)
    return (y, final_state) if return_final_state else y


def _scan(x, dt, A, B, C, *, D, initial_state, seq_idx, implementation, chunk_size):
    """One device's scan of processed dt -> (y, final_state)."""
    if implementation == "xla":
        return selective_scan_xla(x, dt, A, B, C, chunk_size=chunk_size, D=D,
                                  initial_state=initial_state, seq_idx=seq_idx)
    return kernel_scan(x, dt, A, B, C, D=D, initial_state=initial_state, seq_idx=seq_idx)


def kernel_scan(x, dt, A, B, C, *, D=None, initial_state=None, seq_idx=None, config=None,
                interpret=None):
    """The scan of processed dt on the Pallas kernels (triton.py), any l (padded to the
    kernel chunk with dt = 0: no input, decay 1). interpret=None runs Pallas's interpreter
    when no GPU is present."""
    config = triton.Config() if config is None else config
    if interpret is None:
        interpret = off_gpu()
    b, l, d = x.shape
    pad = (-l) % config.chunk
    pad_l = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) if pad else a
    doc = None
    if seq_idx is not None:
        doc = jnp.pad(document_ids(seq_idx), ((0, 0), (0, pad)), mode="edge")
    state = (jnp.zeros((b, d, A.shape[-1]), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    D = jnp.zeros((d,), jnp.float32) if D is None else D.astype(jnp.float32)
    y, final_state = triton.scan(config, interpret, pad_l(x), pad_l(dt.astype(jnp.float32)),
                                 A.astype(jnp.float32), pad_l(B), pad_l(C), D, state, doc)
    return y[:, :l], final_state


def _check_shapes(x, dt, A, B, C, D, dt_bias, initial_state, seq_idx):
    if x.ndim != 3:
        raise ValueError(f"selective_scan: x must be [batch, seqlen, d_inner], got {x.shape}")
    b, l, d = x.shape
    if A.ndim != 2 or A.shape[0] != d:
        raise ValueError(f"selective_scan: A must be [d_inner, d_state] = [{d}, n], got "
                         f"{A.shape}")
    n = A.shape[1]
    expected = {"dt": (dt, (b, l, d)), "B": (B, (b, l, n)), "C": (C, (b, l, n)),
                "D": (D, (d,)), "dt_bias": (dt_bias, (d,)),
                "initial_state": (initial_state, (b, d, n)), "seq_idx": (seq_idx, (b, l))}
    for name, (value, shape) in expected.items():
        if value is not None and value.shape != shape:
            raise ValueError(f"selective_scan: {name} must have shape {shape}, got "
                             f"{value.shape}")
