"""Small building blocks: RMSNorm, gated per-group RMSNorm, causal depthwise conv1d, the MLP.

Legend: b batch, l sequence, d model width, k conv width, f MLP width, "..." channel axes
(e.g. h p).
Norms compute in float32 and return the input's dtype, as mamba_ssm's Triton norms do.
The norms and the conv are rematerialised (jax.checkpoint): the backward pass recomputes
their cheap elementwise float32 intermediates from the inputs instead of keeping them, as
mamba_ssm's fused kernels do (kept, they were about 250 KB per token per 1.3b layer).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.norm_matmul import rms_norm_matmul


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3, 4))
def matmul(spec, a, b, dtype, out_dtype=jnp.float32):
    """jnp.einsum(spec, a, b) with both operands cast to the compute dtype, float32
    accumulation and an out_dtype result, for every weight matmul of the model (b the
    weight). A result that is cast to the compute dtype anyway is asked for in it
    (out_dtype=dtype): the matmul writes half the bytes, as torch's autocast Linear does.

    Its derivative runs in the compute dtype, as torch's autocast backward does: the custom
    JVP takes the tangent matmuls in dtype, so the transposed (backward) matmuls take the
    cotangent in dtype. Differentiated as is, each backward matmul would mix a float32
    cotangent with a bf16 operand, which XLA runs as a float32 (TF32) matmul, about 2x
    slower (a third of the 1.3b train step's time, bench/profile_step.py). The weight's
    gradient is rounded to dtype before it is widened to b's dtype, as before the cast.
    A JVP rather than a VJP keeps the matmuls visible to jax.checkpoint policies (a
    custom_vjp's residuals are saved whatever the policy). spec: two operands, e.g.
    "...d,df->...f"."""
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)


@matmul.defjvp
def _matmul_jvp(spec, dtype, out_dtype, primals, tangents):
    (a, b), (ta, tb) = primals, tangents
    a_c, b_c = a.astype(dtype), b.astype(dtype)
    y = jnp.einsum(spec, a_c, b_c, preferred_element_type=out_dtype)
    t = (jnp.einsum(spec, ta.astype(dtype), b_c, preferred_element_type=dtype)
         + jnp.einsum(spec, a_c, tb.astype(dtype), preferred_element_type=dtype))
    return y, t.astype(out_dtype)


def dense(u, w, dtype, bias=None, out_dtype=jnp.float32):
    """u [..., d] times w [d, ...] -> [..., ...] out_dtype (plus bias [...]): the
    projections' matmul (see matmul). Over a tensor-parallel shard of w's output axes, this
    rank's outputs; over a shard of d (a row-parallel input), this rank's share of the sum."""
    y = matmul("...d,df->...f", u, w.reshape(w.shape[0], -1), dtype, out_dtype)
    y = y.reshape(*u.shape[:-1], *w.shape[1:])
    return y if bias is None else y + bias.astype(out_dtype)


def uniform(rngs: nnx.Rngs, shape, bound):
    """A float32 parameter drawn from U(-bound, bound): torch nn.Linear's and nn.Conv1d's
    default init with bound 1/sqrt(fan_in)."""
    return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)


def rms_norm(x, weight, eps):
    """x [..., d], weight [d] -> x / rms(x) * weight, in float32, cast back to x.dtype."""
    @jax.checkpoint
    def norm(x, weight):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * weight.astype(jnp.float32)).astype(x.dtype)
    return norm(x, weight)


def gated_rms_norm(y, z, weight, eps, ngroups):
    """mamba_ssm's RMSNormGated(norm_before_gate=False, group_size=d_inner/ngroups).

    y, z [..., h, p], weight [h, p]: normalise y * silu(z) over each group of h/ngroups heads.
    """
    @jax.checkpoint
    def norm(y, z, weight):
        *lead, h, p = y.shape
        gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        grouped = gated.reshape(*lead, ngroups, (h // ngroups) * p)
        normed = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True)
                                         + eps)
        return (normed.reshape(*lead, h, p) * weight.astype(jnp.float32)).astype(y.dtype)
    return norm(y, z, weight)


@jax.checkpoint
def causal_conv1d(x, weight, bias=None, doc=None):
    """Depthwise causal conv along l followed by SiLU, as mamba_ssm's causal_conv1d.

    x [b, l, ...], weight [k, ...], bias [...] or None, doc [b, l] document ids or None
    (no tap reads across a document start). Float32 accumulation; returns x.dtype.
    y_t = silu(bias + sum_j weight[j] * x_{t-k+1+j}).
    """
    k = weight.shape[0]
    l = x.shape[1]
    pad = [(0, 0), (k - 1, 0)] + [(0, 0)] * (x.ndim - 2)
    xp = jnp.pad(x.astype(jnp.float32), pad)
    w = weight.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32) if bias is None else jnp.broadcast_to(
        bias.astype(jnp.float32), x.shape)
    if doc is not None:
        docp = jnp.pad(doc, ((0, 0), (k - 1, 0)), constant_values=-1)
    for j in range(k):
        tap = xp[:, j:j + l] * w[j]
        if doc is not None:
            same = docp[:, j:j + l] == doc
            tap = jnp.where(same.reshape(same.shape + (1,) * (x.ndim - 2)), tap, 0.0)
        y = y + tap
    return jax.nn.silu(y).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; weight [d] float32, initialised to ones."""

    def __init__(self, d: int, eps: float):
        self.weight = nnx.Param(jnp.ones((d,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """The MLP layer: SwiGLU, `down(up(u) * silu(gate(u)))` (mamba_ssm's GatedMLP, whose fc1
    is [up | gate]), or squared ReLU, `down(relu(up(u))**2)` (NemotronH, Megatron's
    squared-relu). No biases (neither source uses them). up_proj, gate_proj [d, f] and
    down_proj [f, d] are float32 parameters; `dtype` is the matmuls' compute dtype."""

    def __init__(self, d: int, f: int, activation: str, *, rngs: nnx.Rngs, n_residuals: int,
                 dtype=jnp.float32):
        self.activation = activation
        self.dtype = dtype
        # nn.Linear's default init; the output projection rescaled by 1/sqrt(residual
        # layers) as mamba_ssm's _init_weights does for fc2.
        self.up_proj = nnx.Param(uniform(rngs, (d, f), 1.0 / math.sqrt(d)))
        if activation == "swiglu":
            self.gate_proj = nnx.Param(uniform(rngs, (d, f), 1.0 / math.sqrt(d)))
        self.down_proj = nnx.Param(uniform(rngs, (f, d), 1.0 / math.sqrt(f))
                                   / math.sqrt(n_residuals))

    def hidden(self, u):
        """u [..., d] -> the activation [..., f] in the compute dtype (over a tensor-parallel
        shard of f, this rank's columns)."""
        up = dense(u, self.up_proj[...], self.dtype)
        if self.activation == "swiglu":
            gate = dense(u, self.gate_proj[...], self.dtype)
            return (up * jax.nn.silu(gate)).astype(self.dtype)
        return jnp.square(jax.nn.relu(up)).astype(self.dtype)

    def step_weights(self):
        """(w_in, down): the weights a fused decoding step reads (fused_step), built once
        before the decode loop, in the compute dtype and transposed (the kernels read
        contiguous rows). w_in [f, d] (up_proj), or [2f, d] for swiglu (gate_proj's rows,
        then up_proj's: the gate, which the down-projection's kernel reads as its z, first);
        down [d, f] (down_proj)."""
        w_in = self.up_proj[...]
        if self.activation == "swiglu":
            w_in = jnp.concatenate([self.gate_proj[...], w_in], axis=1)
        return w_in.T.astype(self.dtype), self.down_proj[...].T.astype(self.dtype)

    def fused_step(self, residual, norm_weight, norm_eps, weights=None):
        """residual [b, d] -> residual + MLP(rms_norm(residual)), in residual's dtype, as two
        pallas_kernels.norm_matmul kernels: the layer's RMSNorm (norm_weight [d], norm_eps)
        with the input projections, then the activation with down_proj and the residual add,
        where XLA runs a norm fusion, two matrix-vector products and the elementwise work
        between them. The arithmetic of Block.step (the input projections' float32 results
        unrounded, the norm's operand rounded where pallas_kernels.norm_matmul says); for a
        decoding step of a few rows. weights: step_weights(); None builds them here."""
        w_in, down = self.step_weights() if weights is None else weights
        f = down.shape[1]
        projected = rms_norm_matmul(residual, norm_weight, w_in, eps=norm_eps,
                                    w_transposed=True, out_dtype=jnp.float32,
                                    implementation="triton")  # [b, f or 2f] float32
        if self.activation == "swiglu":  # up times silu(gate): the kernel's gate (z)
            x, z, activation = projected[:, f:], projected, None
        else:
            x, z, activation = projected, None, self.activation
        return rms_norm_matmul(x, None, down, eps=None, z=z, activation=activation,
                               residual=residual, w_transposed=True, implementation="triton")

    def out_proj_partial(self, a):
        """a [..., f] -> [..., d] float32: over a shard of f, one rank's share of the sum."""
        return dense(a, self.down_proj[...], self.dtype)

    def __call__(self, u):
        """u [..., d] -> [..., d] in the compute dtype."""
        return self.out_proj_partial(self.hidden(u)).astype(self.dtype)
