"""The SSD scan on a kernel backend: XLA preprocessing around a `jax.custom_vjp` core.

Legend: b batch, l sequence, h heads, p headdim, g groups, n d_state, t the backend's
kernel chunk.

The core takes what the kernels need, all chunk-padded: x, dt [b, h, l] after softplus, cs
[b, h, l] (the chunk-local cumulative sum of dt * A), B, C, initial_state, doc [b, l]. Its
custom_vjp pairs the backend's `forward` and `backward`. Everything around it (dt bias,
softplus and clamp, padding, the cumulative sum, the D skip) is ordinary JAX, so automatic
differentiation carries the core's gradients to dt, A, D, dt_bias: d(cs) turns into dt and A
gradients through cumsum's transpose.

A backend is a module with `Config`, `forward(x, dt, cs, B, C, initial_state, doc, *,
config, save_states, interpret)` and `backward(x, dt, cs, B, C, doc, states, dy, dfinal, *,
config, interpret)` as in `triton.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.ssd.reference import d_skip, document_ids, process_dt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _core(backend, config, interpret, x, dt, cs, B, C, initial_state, doc):
    y, final_state = backend.forward(x, dt, cs, B, C, initial_state, doc, config=config,
                                     save_states=False, interpret=interpret)
    return y, final_state


def _core_fwd(backend, config, interpret, x, dt, cs, B, C, initial_state, doc):
    y, final_state, states = backend.forward(x, dt, cs, B, C, initial_state, doc,
                                             config=config, save_states=True,
                                             interpret=interpret)
    return (y, final_state), (x, dt, cs, B, C, doc, states)


def _core_bwd(backend, config, interpret, residuals, cotangents):
    x, dt, cs, B, C, doc, states = residuals
    dy, dfinal = cotangents
    dx, ddt, dcs, dB, dC, dinit = backend.backward(
        x, dt, cs, B, C, doc, states, dy.astype(x.dtype), dfinal.astype(jnp.float32),
        config=config, interpret=interpret)
    return dx, ddt, dcs, dB.astype(B.dtype), dC.astype(C.dtype), dinit, None


_core.defvjp(_core_fwd, _core_bwd)


def ssd(x, dt, A, B, C, *, backend, config=None, interpret=None, D=None, dt_bias=None,
        dt_softplus=False, dt_limit=(0.0, math.inf), initial_state=None, seq_idx=None):
    """The SSD scan on `backend` (shapes and semantics as reference.ssd_chunked; any l).

    interpret=None runs the backend's Pallas interpreter when no GPU is present (CI).
    Returns (y [b, l, h, p] in x.dtype, final_state [b, h, p, n] float32).
    """
    config = backend.Config() if config is None else config
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, l, h, p = x.shape
    n = B.shape[-1]
    t = config.chunk
    pad = (-l) % t
    # Padded steps have dt = 0 after softplus: no input, decay 1, as in the XLA path.
    dt = jnp.pad(process_dt(dt, dt_bias, dt_softplus, dt_limit).astype(jnp.float32),
                 ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1)  # [b, h, l]
    dt_A = (dt * A.astype(jnp.float32)[:, None]).reshape(b, h, -1, t)
    cs = jnp.cumsum(dt_A, axis=-1).reshape(b, h, -1)
    doc = None
    if seq_idx is not None:
        doc = jnp.pad(document_ids(seq_idx), ((0, 0), (0, pad)), mode="edge")
    pad_l = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) if pad else a
    state = (jnp.zeros((b, h, p, n), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    y, final_state = _core(backend, config, interpret, pad_l(x), dt, cs, pad_l(B), pad_l(C),
                           state, doc)
    y = y[:, :l]
    if D is not None:
        y = (y.astype(jnp.float32) + d_skip(D, x, jnp.float32)).astype(x.dtype)
    return y, final_state
