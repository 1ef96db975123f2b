"""The depthwise conv1d and SiLU of Mamba's short conv behind one dispatch point.

    y = causal_conv1d(x, weight, bias, doc)              # y_t reads x_{t-k+1} .. x_t
    y = causal_conv1d(x, weight, bias, doc, length=l)    # only the last l outputs
    y = causal_conv1d(x, weight, bias, doc, left=1)      # a non-causal (centred) conv

x [b, L, ...] (the channel axes "..." any shape), weight [k, ...], bias [...] or None, doc
[b, L] document ids or None (no tap reads across a change of document; zeros stand outside
x). y_t = silu(bias + sum_j weight[j] * x_{t-left+j}), float32 inside, in x.dtype; left = k
- 1 (causal) by default. `length`: return only the last `length` outputs, as a layer does
whose x begins with the k - 1 inputs before its first token (the previous device's under
context parallelism, a continued sequence's window): the kernels write only those.

`implementation`: "xla" (reference.py, any platform), "triton" (triton.py's kernels; in
Pallas's interpreter off a GPU), "auto" ("triton" on Hopper GPUs for the causal conv of
at least 16 channels, float32 or bfloat16, 2 to 8 taps; "xla" elsewhere, and a
fallback on such a GPU logged once, pallas_kernels.fallback). The kernels' backward
recomputes the conv from x and keeps nothing else, as the reference's jax.checkpoint does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import fallback, hardware
from pallas_kernels.conv import reference, triton

IMPLEMENTATIONS = ("auto", "xla", "triton")


def causal_conv1d(x, weight, bias=None, doc=None, *, left=None, length=None,
                  implementation="auto"):
    """The conv and SiLU; see the module docstring for shapes and dtypes."""
    k, rows = weight.shape[0], x.shape[1]
    left = k - 1 if left is None else left
    length = rows if length is None else length
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"causal_conv1d: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if implementation == "auto":
        implementation = "triton" if _kernels_run(x, weight, left, length) else "xla"
    if implementation == "xla":
        return reference.conv1d(x, weight, bias, doc, left)[:, rows - length:]
    if left != k - 1:
        raise ValueError(f"causal_conv1d: the kernels compute the causal conv (left={k - 1}), "
                         f"not left={left}; use implementation='xla'")
    b, channels = x.shape[0], x.shape[2:]
    e = math.prod(channels)
    y = triton.conv1d(x.reshape(b, rows, e), weight.reshape(k, e),
                      None if bias is None else bias.reshape(e),
                      None if doc is None else doc.astype(jnp.int32), length, triton.Config(),
                      jax.default_backend() != "gpu")
    return y.reshape(b, length, *channels)


def _kernels_run(x, weight, left, length) -> bool:
    """"auto"'s choice (module docstring), a fallback logged once where it is not taken on a
    GPU the kernels were measured on."""
    if not hardware.measured_gpu():
        return False
    k, e = weight.shape[0], math.prod(x.shape[2:])
    if left != k - 1 or not triton.supports(length, e, k, x.dtype):
        fallback.log_once("causal_conv1d", f"left {left} of {k} taps, {e} channels in "
                          f"{x.dtype} (the kernels take the causal conv of at least 16 "
                          "channels, 2 to 8 taps, float32 or bfloat16)")
        return False
    return True
