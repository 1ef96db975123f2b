"""The depthwise conv1d and SiLU of Mamba's short conv behind one dispatch point.

    y = causal_conv1d(x, weight, bias, doc)              # y_t reads x_{t-k+1} .. x_t
    y = causal_conv1d(x, weight, bias, doc, length=l)    # only the last l outputs
    y = causal_conv1d(x, weight, bias, doc, left=1)      # a non-causal (centred) conv
    x_, B, C = causal_conv1d(x, weight, bias, doc, parts=(hp, gn, gn))  # the channels split

x [b, L, ...] (the channel axes "..." any shape), weight [k, ...], bias [...] or None, doc
[b, L] document ids or None (no tap reads across a change of document; zeros stand outside
x). y_t = silu(bias + sum_j weight[j] * x_{t-left+j}), float32 inside, in x.dtype; left = k
- 1 (causal) by default. `length`: return only the last `length` outputs, as a layer does
whose x begins with the k - 1 inputs before its first token (the previous device's under
context parallelism, a continued sequence's window): the kernels write only those.
`parts`: sizes summing to the channels' count: the output's channels (flattened) as a tuple
of arrays [b, length, part], which the kernels write each on its own (Mamba2's x, B, C),
so that neither the split nor its gradient's concatenation is a copy.

`implementation`: "xla" (reference.py, any platform), "triton" (triton.py's kernels; in
Pallas's interpreter off a GPU), "auto" ("triton" on Hopper GPUs for the causal conv of at
least 16 channels, float32 or bfloat16, 2 to 8 taps, parts that a power of two of at least
16 divides; "xla" elsewhere, and a fallback on such a GPU logged once,
pallas_kernels.fallback). The kernels' backward recomputes the conv from x and keeps
nothing else, as the reference's jax.checkpoint does.
"""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp

from pallas_kernels import fallback, hardware
from pallas_kernels.conv import reference, triton
from pallas_kernels.triton_call import off_gpu

IMPLEMENTATIONS = ("auto", "xla", "triton")


def causal_conv1d(x, weight, bias=None, doc=None, *, left=None, length=None, parts=None,
                  implementation="auto"):
    """The conv and SiLU; see the module docstring for shapes and dtypes."""
    k, rows = weight.shape[0], x.shape[1]
    b, channels = x.shape[0], x.shape[2:]
    e = math.prod(channels)
    left = k - 1 if left is None else left
    length = rows if length is None else length
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"causal_conv1d: implementation={implementation!r} is not one of "
                         f"{IMPLEMENTATIONS}")
    if parts is not None and sum(parts) != e:
        raise ValueError(f"causal_conv1d: parts={parts} do not sum to the {e} channels")
    # Shapes that broadcast or slice into another result (a length past the rows gave
    # fewer outputs from XLA and more from the kernels) or fail deep inside
    for name, value, shape in (("weight", weight, (k, *channels)),
                               ("bias", bias, tuple(channels)), ("doc", doc, (b, rows))):
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"causal_conv1d: {name} has shape {tuple(value.shape)}; x "
                             f"{tuple(x.shape)} needs {shape}")
    if not 1 <= length <= rows:
        raise ValueError(f"causal_conv1d: length={length} outputs of x's {rows} rows; give "
                         f"1 to {rows}")
    if implementation == "auto":
        implementation = "triton" if kernels_run(x, weight, left, length, parts) else "xla"
    if implementation == "xla":
        y = reference.conv1d(x, weight, bias, doc, left)[:, rows - length:]
        if parts is None:
            return y
        return tuple(jnp.split(y.reshape(b, length, e), list(itertools.accumulate(parts[:-1])),
                               axis=-1))
    if left != k - 1:
        raise ValueError(f"causal_conv1d: the kernels compute the causal conv (left={k - 1}), "
                         f"not left={left}; use implementation='xla'")
    y = triton.conv1d(x.reshape(b, rows, e), weight.reshape(k, e),
                      None if bias is None else bias.reshape(e),
                      None if doc is None else doc.astype(jnp.int32), length,
                      (e,) if parts is None else tuple(parts), triton.Config(),
                      off_gpu())
    return y[0].reshape(b, length, *channels) if parts is None else y


def kernels_run(x, weight, left, length, parts=None) -> bool:
    """"auto"'s choice (module docstring), a fallback logged once where it is not taken on a
    GPU the kernels were measured on."""
    if not hardware.measured_gpu():
        return False
    k, e = weight.shape[0], math.prod(x.shape[2:])
    if left != k - 1 or not triton.supports(length, e, k, x.dtype, parts):
        fallback.log_once("causal_conv1d", f"left {left} of {k} taps, {e} channels in "
                          f"{x.dtype}, parts {parts} (the kernels take the causal conv of at "
                          "least 16 channels, 2 to 8 taps, float32 or bfloat16, parts that a "
                          "power of two of at least 16 divides)")
        return False
    return True
