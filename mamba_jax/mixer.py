"""Mamba2Mixer: in_proj -> causal conv -> SSD -> gated norm -> out_proj, as mamba_ssm's Mamba2.

Legend: b batch, l sequence, d d_model, h nheads, p headdim, g ngroups, n d_state,
k d_conv, e conv_dim = h*p + 2*g*n (x, B, C channels in mamba_ssm's order).

mamba_ssm fuses the projections into one `in_proj` [z, x, B, C, dt]; we keep one parameter
per role, shaped by head or group, so a tensor-parallel shard is a slice of one axis and
conversion is a fixed split/concatenate (mamba_jax.convert), and concatenate this rank's
weights into one matmul when projecting.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.config import Mamba2Config
from mamba_jax.layers import causal_conv1d, dense, gated_rms_norm, matmul, uniform
from pallas_kernels.norm_matmul import rms_norm_matmul
from pallas_kernels.ssd import document_ids, ssd
from pallas_kernels.ssd.step import mamba_step, mamba_step_out
from pallas_kernels.ssd.step import supports as step_supports

# The largest batch whose decoding step takes `Mamba2Mixer.fused_step` under
# step_implementation="triton" (larger batches take the step kernel alone between XLA's
# projections). Measured on an H200 (BENCHMARKS.md, Generation): at batch 8 an earlier
# fused_step took 2.5x and 4.0x the XLA step's time for mamba2-370m and mamba2-1.3b (its
# norm-matmul kernels unroll the rows: each row's products are reduced apart).
FUSED_STEP_MAX_BATCH = 1
STEP_IMPLEMENTATIONS = ("auto", "xla", "triton")


def uses_fused_step(implementation: str, batch: int) -> bool:
    """Whether a decoding step of `batch` rows runs its blocks as their mixers' fused_step
    (Mamba2Mixer's, and an attention or MLP layer's)."""
    return implementation == "triton" and batch <= FUSED_STEP_MAX_BATCH


def step_implementation_for(implementation: str, cfg: Mamba2Config,
                            backend: str | None = None) -> str:
    """A decode step's implementation, "xla" or "triton", for one of STEP_IMPLEMENTATIONS.

    "auto" is "triton" on a GPU where the step kernel takes the model's shapes, "xla"
    otherwise. Measured on an H200 (BENCHMARKS.md, Generation): at batch 1 fused_step took
    0.44-0.45x the XLA step's time for mamba2-370m and 0.72-0.81x for mamba2-1.3b; the step
    kernel alone took 0.34-0.44x XLA's step at batch 8, 0.40-0.55x at 16 and 0.86-0.88x at
    64 (bf16 states; bench/step.py). backend: default jax.default_backend()."""
    if implementation != "auto":
        return implementation
    on_gpu = (backend or jax.default_backend()) == "gpu"
    return ("triton" if on_gpu and step_supports(cfg.headdim, cfg.d_state, cfg.d_conv)
            else "xla")


class MambaCache(NamedTuple):
    """One Mamba layer's decoding state.

    conv_state [b, e, k]: the last k conv inputs, newest last (mamba_ssm's layout);
    ssm_state [b, h, p, n] float32 (or bfloat16 where generate is asked to store it so);
    sync: None, or the int32 [1] counter of fused_step's cooperative kernel
    (pallas_kernels.ssd.step.mamba_step_out), which generate's decode loop carries from token
    to token.
    """

    conv_state: jax.Array
    ssm_state: jax.Array
    sync: jax.Array | None = None


class StepWeights(NamedTuple):
    """A Mamba layer's matmul weights as a decoding step reads them, built once before the
    decode loop (XLA would rebuild anything derived from the parameters inside a while_loop,
    at every token).

    in_proj: `Mamba2Mixer.in_proj()` with w in the compute dtype, [d, N] for `step` and
    transposed to [N, d] for `fused_step` (its kernel reads contiguous rows); conv: the conv
    weight [e, k] and bias [e] or None over the fused x, B, C channels, float32; out_proj
    [d, h*p] in the compute dtype, transposed (see out_proj_partial); A [h] = -exp(A_log),
    float32."""

    in_proj: tuple
    conv: tuple
    out_proj: jax.Array
    A: jax.Array


class Mamba2Mixer(nnx.Module):
    """The Mamba2 mixer. Parameters are float32; `dtype` is the compute dtype of the matmuls,
    the conv and the SSD operands; dt, A, D and the SSM state stay float32."""

    def __init__(self, cfg: Mamba2Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, h, p, g, n, k = (cfg.d_model, cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state,
                            cfg.d_conv)
        self.cfg = cfg
        self.dtype = dtype
        # nn.Linear's default init, U(+-1/sqrt(fan_in)); biases zero (mamba_ssm _init_weights).
        in_bound = 1.0 / math.sqrt(d)
        self.z_proj = nnx.Param(uniform(rngs, (d, h, p), in_bound))
        self.x_proj = nnx.Param(uniform(rngs, (d, h, p), in_bound))
        self.B_proj = nnx.Param(uniform(rngs, (d, g, n), in_bound))
        self.C_proj = nnx.Param(uniform(rngs, (d, g, n), in_bound))
        self.dt_proj = nnx.Param(uniform(rngs, (d, h), in_bound))
        if cfg.bias:
            self.z_bias = nnx.Param(jnp.zeros((h, p), jnp.float32))
            self.x_bias = nnx.Param(jnp.zeros((h, p), jnp.float32))
            self.B_bias = nnx.Param(jnp.zeros((g, n), jnp.float32))
            self.C_bias = nnx.Param(jnp.zeros((g, n), jnp.float32))
            self.dt_proj_bias = nnx.Param(jnp.zeros((h,), jnp.float32))
            self.out_bias = nnx.Param(jnp.zeros((d,), jnp.float32))
        # nn.Conv1d's default init: fan_in = d_conv for a depthwise conv.
        conv_bound = 1.0 / math.sqrt(k)
        self.x_conv = nnx.Param(uniform(rngs, (k, h, p), conv_bound))
        self.B_conv = nnx.Param(uniform(rngs, (k, g, n), conv_bound))
        self.C_conv = nnx.Param(uniform(rngs, (k, g, n), conv_bound))
        if cfg.conv_bias:
            self.x_conv_bias = nnx.Param(uniform(rngs, (h, p), conv_bound))
            self.B_conv_bias = nnx.Param(uniform(rngs, (g, n), conv_bound))
            self.C_conv_bias = nnx.Param(uniform(rngs, (g, n), conv_bound))
        # dt log-uniform in [dt_min, dt_max], floored, stored through the inverse softplus.
        log_dt = jax.random.uniform(rngs.params(), (h,), jnp.float32,
                                    math.log(cfg.dt_min), math.log(cfg.dt_max))
        dt = jnp.maximum(jnp.exp(log_dt), cfg.dt_init_floor)
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (h,), jnp.float32, *cfg.A_init_range)))
        self.D = nnx.Param(jnp.ones((h,), jnp.float32))
        self.norm = nnx.Param(jnp.ones((h, p), jnp.float32))
        # Rescaled by 1/sqrt(residual layers) (mamba_ssm's rescale_prenorm_residual: n_layer
        # without MLPs, 2*n_layer with them).
        self.out_proj = nnx.Param(uniform(rngs, (h, p, d), 1.0 / math.sqrt(cfg.d_inner))
                                  / math.sqrt(len(cfg.layers)))

    def _bias(self, name):
        return getattr(self, name)[...] if self.cfg.bias else None

    def in_proj(self):
        """The five input projections side by side, in mamba_ssm's in_proj order: w [d, h*p
        (z) + e (x, B, C) + h (dt)] and bias [same] or None, in the weights' dtype."""
        roles = (self.z_proj, self.x_proj, self.B_proj, self.C_proj, self.dt_proj)
        w = jnp.concatenate([r[...].reshape(r.shape[0], -1) for r in roles], axis=1)
        if not self.cfg.bias:
            return w, None
        return w, jnp.concatenate([self._bias(name).reshape(-1) for name in
                                   ("z_bias", "x_bias", "B_bias", "C_bias", "dt_proj_bias")])

    def project(self, u, in_proj=None):
        """u [..., d] -> z [..., h, p] and xBC [..., e] (the conv's channels x, B, C) in the
        compute dtype, dt [..., h] float32 (before dt_bias and softplus): project_packed's
        output split."""
        zxbcdt = self.project_packed(u, in_proj)
        z_size, dt_size = math.prod(self.z_proj.shape[1:]), self.dt_proj.shape[1]
        z, xBC, dt = jnp.split(zxbcdt, [z_size, zxbcdt.shape[-1] - dt_size], axis=-1)
        return z.reshape(*z.shape[:-1], *self.z_proj.shape[1:]), xBC, dt.astype(jnp.float32)

    def project_packed(self, u, in_proj=None):
        """u [..., d] -> zxbcdt [..., h*p + e + h] in the compute dtype, mamba_ssm's in_proj
        output order z, xBC, dt (the decoding step's kernels read xBC and dt from it in
        place).

        One matmul over `in_proj()` (or the given one, StepWeights.in_proj): u is read once
        and the backward pass runs one matmul for du instead of five and their sum. dt
        leaves it in the compute dtype, as from mamba_ssm's in_proj."""
        w, bias = self.in_proj() if in_proj is None else in_proj
        return dense(u, w, self.dtype, bias, out_dtype=self.dtype)

    def _conv_params(self):
        """The conv weight [k, e] and bias [e] (or None) over the fused xBC channels."""
        k = self.cfg.d_conv
        w = jnp.concatenate([self.x_conv[...].reshape(k, -1), self.B_conv[...].reshape(k, -1),
                             self.C_conv[...].reshape(k, -1)], axis=-1)
        if not self.cfg.conv_bias:
            return w, None
        bias = jnp.concatenate([self.x_conv_bias[...].reshape(-1),
                                self.B_conv_bias[...].reshape(-1),
                                self.C_conv_bias[...].reshape(-1)])
        return w, bias

    def _split_xBC(self, xBC):
        """[..., e] -> x [..., h, p], B [..., g, n], C [..., g, n].

        Sizes come from the conv weights, so a tensor-parallel shard (local heads, and local
        or all groups) splits its own channels."""
        (_, h, p), (_, g, n) = self.x_conv.shape, self.B_conv.shape
        x, B, C = jnp.split(xBC, [h * p, h * p + g * n], axis=-1)
        lead = xBC.shape[:-1]
        return x.reshape(*lead, h, p), B.reshape(*lead, g, n), C.reshape(*lead, g, n)

    def conv(self, xBC, seq_idx=None):
        """The causal conv and SiLU over xBC [b, l, e] -> x [b, l, h, p], B, C [b, l, g, n]."""
        w, bias = self._conv_params()
        doc = None if seq_idx is None else document_ids(seq_idx)
        return self._split_xBC(causal_conv1d(xBC, w, bias, doc))

    def scan(self, x, dt, B, C, seq_idx=None, sequence_axis=None):
        """The SSD with D skip: x [b, l, h, p], dt [b, l, h] (before bias and softplus),
        B, C [b, l, g, n] -> (y [b, l, h, p], final state [b, h, p, n] float32).

        sequence_axis: inside shard_map, the mesh axis the sequence is split over (context
        parallelism); the state is carried across its devices (pallas_kernels.ssd)."""
        return ssd(x, dt, -jnp.exp(self.A_log[...]), B, C, chunk_size=self.cfg.chunk_size,
                   D=self.D[...], dt_bias=self.dt_bias[...], dt_softplus=True,
                   dt_limit=self.cfg.dt_limit, seq_idx=seq_idx, return_final_state=True,
                   sequence_axis=sequence_axis)

    def out_proj_partial(self, y, out_proj=None):
        """y [..., h, p] (normed) -> [..., d] float32, without the bias: over a shard of the
        heads this is one tensor-parallel rank's share of the sum. out_proj: [d, h*p]
        (StepWeights.out_proj); None reads the parameter."""
        if out_proj is None:
            return matmul("...hp,hpd->...d", y, self.out_proj[...], self.dtype)
        # A one-token step: XLA rewrites a matrix-vector product as a product and a sum,
        # which against [h, p, d] it ran as an elementwise product [h*p, d] written out in
        # float32 and summed over columns, 3x the weight's bytes (bench/profile_step.py).
        # Against [d, h*p] the sum runs over each contiguous row.
        return matmul("...e,de->...d", y.reshape(*y.shape[:-2], -1), out_proj, self.dtype)

    def _output(self, y, z, out_proj=None):
        """y, z [..., h, p] -> gated norm -> out_proj -> [..., d] compute dtype."""
        y = gated_rms_norm(y, z, self.norm[...], self.cfg.norm_eps, self.cfg.ngroups)
        out = self.out_proj_partial(y, out_proj)
        bias = self._bias("out_bias")
        return (out if bias is None else out + bias).astype(self.dtype)

    def __call__(self, u, seq_idx=None, return_cache=False):
        """u [b, l, d] -> [b, l, d] in the compute dtype (and a MambaCache if asked).

        seq_idx [b, l]: packed documents; the conv and the SSM state restart where it changes.
        """
        c = self.cfg
        z, xBC_in, dt = self.project(u)
        x, B, C = self.conv(xBC_in, seq_idx)
        y, ssm_state = self.scan(x, dt, B, C, seq_idx)
        out = self._output(y, z)
        if not return_cache:
            return out
        # The conv's window holds the last k inputs; zeros stand before the first token and
        # in place of inputs of an earlier document (e.g. left padding), which the next
        # token's conv must not read.
        if seq_idx is not None:
            doc = document_ids(seq_idx)
            xBC_in = jnp.where((doc == doc[:, -1:])[..., None], xBC_in, 0)
        l = u.shape[1]
        window = jnp.pad(xBC_in, ((0, 0), (max(c.d_conv - l, 0), 0), (0, 0)))[:, -c.d_conv:]
        return out, MambaCache(jnp.swapaxes(window, 1, 2), ssm_state)

    def init_cache(self, batch_size: int) -> MambaCache:
        c = self.cfg
        return MambaCache(jnp.zeros((batch_size, c.conv_dim, c.d_conv), self.dtype),
                          jnp.zeros((batch_size, c.nheads, c.headdim, c.d_state), jnp.float32))

    def step_weights(self, fused: bool = False) -> StepWeights:
        """The StepWeights of the current parameters (build them outside the decode loop),
        for `fused_step` if fused, else for `step`."""
        w, bias = self.in_proj()
        w = w.T if fused else w
        out = self.out_proj[...]
        conv_w, conv_b = self._conv_params()
        return StepWeights((w.astype(self.dtype), bias), (conv_w.T, conv_b),
                           out.reshape(-1, out.shape[-1]).T.astype(self.dtype),
                           -jnp.exp(self.A_log[...]))

    def step(self, u, cache: MambaCache, weights: StepWeights | None = None,
             implementation="xla"):
        """One token: u [b, d] -> ([b, d], the updated MambaCache).

        weights: `step_weights()`, built before the decode loop; None builds them here. The
        new SSM state is computed in float32 and stored in the cache's dtype (float32, or
        bfloat16 as mamba_ssm's decoding cache of a bf16 model). implementation: of the
        conv and SSM update, pallas_kernels.ssd.step ("xla" or "triton")."""
        weights = self.step_weights() if weights is None else weights
        zxbcdt = self.project_packed(u, weights.in_proj)
        # The window's shift, the conv and the SSM update, xBC and dt read from zxbcdt
        y, conv_state, ssm_state = mamba_step(
            cache.conv_state, zxbcdt, *weights.conv, weights.A, self.D[...], self.dt_bias[...],
            cache.ssm_state, dt_limit=self.cfg.dt_limit, y_dtype=self.dtype,
            implementation=implementation)
        z = zxbcdt[:, :y.shape[1] * y.shape[2]].reshape(y.shape)  # its first h*p columns
        return self._output(y, z, weights.out_proj), MambaCache(conv_state, ssm_state)

    def fused_step(self, residual, norm_weight, norm_eps, cache: MambaCache,
                   weights: StepWeights | None = None):
        """A whole Mamba block for one token in two or three Pallas kernels: residual [b, d]
        -> (residual + mixer(rms_norm(residual)), the updated MambaCache).

        The block's RMSNorm (norm_weight [d], norm_eps) with the input projection, which also
        shifts the conv window in place, as one pallas_kernels.norm_matmul kernel; then
        pallas_kernels.ssd.step.mamba_step_out: the conv, the SSM update and the gate, which
        read dt and z from the projection's output in place, then the gated norm with
        out_proj and the residual add. With the cache's sync counter (generate's decode loop
        gives one) that is one cooperative kernel on a GPU that holds its programs at once,
        else two. The arithmetic of Block.step over `step` (but for where the norms'
        operands are rounded: pallas_kernels.norm_matmul) in a third of its kernels or
        fewer, for a decoding step at small batch (up to FUSED_STEP_MAX_BATCH rows), which is
        bound by its kernel count (BENCHMARKS.md, Generation). weights:
        step_weights(fused=True); None builds them here."""
        weights = self.step_weights(fused=True) if weights is None else weights
        w, bias = weights.in_proj
        # [b, h*p (z) + e (xBC) + h (dt)] in the compute dtype, as project's
        zxbcdt, conv_state = rms_norm_matmul(residual, norm_weight, w, eps=norm_eps, bias=bias,
                                             w_transposed=True,
                                             window=(cache.conv_state, self.cfg.d_inner),
                                             implementation="triton")
        # The step and the gate, then the gated norm, out_proj and the residual add
        residual, ssm_state, sync = mamba_step_out(
            conv_state, zxbcdt, *weights.conv, weights.A, self.D[...], self.dt_bias[...],
            cache.ssm_state, residual, self.norm[...].reshape(-1), weights.out_proj,
            eps=self.cfg.norm_eps, ngroups=self.cfg.ngroups, bias=self._bias("out_bias"),
            sync=cache.sync, dt_limit=self.cfg.dt_limit, y_dtype=self.dtype,
            implementation="triton")
        return residual, MambaCache(conv_state, ssm_state, sync)
