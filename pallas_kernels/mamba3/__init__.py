"""The Mamba-3 scan behind one dispatch point.

    y, final_state = mamba3_scan(C, B, x, adt, dt, trap, angles, C_bias, B_bias,
                                 chunk_size=64, D=D, mimo_x=None, rotary="pairwise")

Shapes (legend: b batch, l sequence, h heads, p headdim, r MIMO rank, g B/C groups, n
d_state, a rotary angles): C, B [b, l, r, g, n] (after their RMSNorm, before their biases),
x [b, l, h, p], adt [b, l, h] (A * dt), dt [b, l, h] (after softplus), trap [b, l, h]
(before its sigmoid), angles [b, l, a] (before tanh), C_bias, B_bias [h, r, n], D [h],
mimo_x [h, r, p] (None for SISO, r = 1), initial_state a Mamba3State, seq_idx [b, l] ints
(the state restarts wherever it changes: packed documents). y [b, l, r, h, p] in x's dtype
(before the gate and, for MIMO, the out-projection over ranks); final_state a Mamba3State.
What is computed is reference.py's recurrence.

`implementation`: "xla" (the chunked pure-JAX form, reference.mamba3_chunked), "triton" (the
SSD's Pallas kernels, turning B and C by the angles themselves, with XLA elementwise work
around them, a long row scanned in parts at once, kernels.py; without a GPU they run in
Pallas's interpreter) or "auto" (the default: "triton" where the SSD's own "auto" takes its
kernels, pallas_kernels.ssd.kernels_are_faster, and kernels.kernels_take the rank and
rotary, "xla" elsewhere; measured against each other and mamba_ssm by bench/mamba3.py).

`sequence_axis`: inside `jax.shard_map` with the sequence split over that mesh axis
(context parallelism), each device passes its part and the scan carries the state (angle,
SSM state and the trapezoid's previous k and x) across devices (context_parallel.py).
"""

from __future__ import annotations

from pallas_kernels.mamba3.context_parallel import mamba3_context_parallel
from pallas_kernels.mamba3.kernels import kernels_take, mamba3_kernels
from pallas_kernels.mamba3.reference import (Mamba3State, check_shapes, mamba3_chunked,
                                             mamba3_step)
from pallas_kernels.ssd import kernels_are_faster

__all__ = ["mamba3_scan", "mamba3_step", "Mamba3State", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("auto", "xla", "triton")


def mamba3_scan(C, B, x, adt, dt, trap, angles, C_bias, B_bias, *, chunk_size, D=None,
                mimo_x=None, rotary="pairwise", initial_state=None, seq_idx=None,
                sequence_axis=None, implementation="auto"):
    """The chunked Mamba-3 scan; see the module docstring for shapes and dtypes."""
    check_shapes(C, B, x, adt, dt, trap, angles, C_bias, B_bias, D, mimo_x, rotary,
                 initial_state, seq_idx)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"mamba3_scan: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"mamba3_scan: chunk_size={chunk_size!r} must be a positive int")
    if implementation == "auto":
        implementation = ("triton" if kernels_are_faster(x, C) and kernels_take(C, angles)
                          else "xla")

    def scan(*args, **options):
        if implementation == "triton":  # the kernels' own chunk: the same scan
            return mamba3_kernels(*args, **options)
        return mamba3_chunked(*args, chunk_size=chunk_size, **options)
    options = dict(D=D, mimo_x=mimo_x, rotary=rotary, initial_state=initial_state,
                   seq_idx=seq_idx)
    args = (C, B, x, adt, dt, trap, angles, C_bias, B_bias)
    if sequence_axis is None:
        return scan(*args, **options)
    return mamba3_context_parallel(scan, *args, axis_name=sequence_axis, **options)
