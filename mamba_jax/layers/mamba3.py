"""The Mamba-3 layer (layer_pattern symbol 3): in_proj -> data-dependent dt, A, trapezoid
weight and rotary angles -> B/C RMSNorm -> the Mamba-3 scan -> gate (or gated norm) ->
out_proj, as mamba_ssm's Mamba3 (Lahoti, Gu, Dao et al., 2026); its config section
(cfg.mamba3), decoding cache and one-token step, checkpoint keys and FLOPs.

Legend: b batch, l sequence, d d_model, h nheads, p headdim, g ngroups, r mimo_rank (1 for
SISO), n d_state, a rotary angles (d_state * rope_fraction / 2).

The projections follow mamba_ssm's in_proj order [z, x, B, C, dd_dt, dd_A, trap, angle]
(B and C laid out (r g n)), kept as one parameter per role shaped by head or group, so that a
tensor-parallel shard is a slice of one axis and conversion is a fixed split/concatenate.
Per token and head: dt = softplus(dd_dt + dt_bias); A = min(-f(dd_A), -A_floor) with f
mamba_ssm's heavy-tail activation (1 + x for x >= 0, 1 / (1 - x) below: positive, and
heavier-tailed than softplus; mamba_ssm applies it always, with no switch); B and C
RMSNormed over d_state; the scan (pallas_kernels.mamba3) adds the B/C biases, rotates B and
C by the data-dependent angles and runs the trapezoidal recurrence. SISO gates y * silu(z);
MIMO (mamba3.is_mimo) expands x and z to r ranks (mimo_x, mimo_z), gates each rank and sums
them through mimo_o. mamba3.is_outproj_norm: the gate is RMSNorm(y) per head times its
weight times silu(z) instead. There is no short convolution.

Tensor parallel (ctx.tp > 1): heads split over tp, B/C groups too where tp divides them,
else every rank keeps every group and reads the ones its heads use; the angle projection
is replicated (angles are shared by the heads); out_proj is row-parallel. Context parallel:
the scan carries its state (angle, SSM state, and the trapezoid's previous k and x) across
devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.layers.checkpoint_keys import AsIs, Flat, Linear
from mamba_jax.layers.common import (Mixer, check_dt_section, check_heads, dense,
                                     dt_bias_init, groups_of_local_heads, matmul, param,
                                     split_last, uniform)
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels.decode.norm_matmul import rms_norm_matmul
from pallas_kernels.mamba3 import Mamba3State, mamba3_scan
from pallas_kernels.mamba3.reference import gate, projected
from pallas_kernels.mamba3.step import StepParams, decode_step
from pallas_kernels.mamba3.step import supports as step_supports
from pallas_kernels.ssd.step import state_in



@dataclasses.dataclass(frozen=True)
class Mamba3Section:
    """cfg.mamba3: mamba_ssm's Mamba3 arguments (its ssm_cfg with layer "Mamba3"), with its
    defaults. rope_fraction: the share of d_state rotated (0.5 or 1.0); is_mimo with
    mimo_rank: MIMO; is_outproj_norm: the per-head RMSNorm before out_proj."""

    d_state: int = 128
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    rope_fraction: float = 0.5
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    is_mimo: bool = False
    mimo_rank: int = 4
    chunk_size: int = 64


class Dims(NamedTuple):
    """A Mamba-3 layer's sizes (legend above); r is 1 unless is_mimo."""

    d: int
    h: int
    p: int
    g: int
    r: int
    n: int
    a: int


def dims(cfg) -> Dims:
    m = cfg.mamba3
    d_inner = m.expand * cfg.d_model
    # mamba_ssm: the rotated entries, rounded down to even, make the angle pairs.
    rotated = int(m.d_state * m.rope_fraction)
    return Dims(cfg.d_model, d_inner // m.headdim, m.headdim, m.ngroups,
                m.mimo_rank if m.is_mimo else 1, m.d_state, (rotated - rotated % 2) // 2)


def rotary_layout(cfg) -> str:
    """mamba_ssm's pairing of the rotated state entries: adjacent pairs in its SISO
    kernels, halves (i, i + n/2) in its MIMO ones."""
    return "halves" if cfg.mamba3.is_mimo else "pairwise"


class Mamba3Weights(NamedTuple):
    """What the one-token step reads that derives from the parameters: in_proj [d, N] in
    the compute dtype (this rank's projections side by side, mamba_ssm's order) and out_proj
    [d, h*p] in the compute dtype, transposed (see Mamba2Mixer.out_proj_partial)."""

    in_proj: jax.Array
    out_proj: jax.Array


_KEYS = {"in_proj.weight": Linear("z_proj", "x_proj", "B_proj", "C_proj", "dt_proj",
                                  "A_proj", "trap_proj", "angle_proj"),
         "dt_bias": Flat("dt_bias"), "B_bias": AsIs("B_bias"), "C_bias": AsIs("C_bias"),
         "B_norm.weight": Flat("B_norm"), "C_norm.weight": Flat("C_norm"),
         "mimo_x": AsIs("mimo_x"), "mimo_z": AsIs("mimo_z"), "mimo_o": AsIs("mimo_o"),
         "D": Flat("D"), "norm.weight": Flat("norm"),
         "out_proj.weight": Linear("out_proj", inputs=2)}


class Mamba3Mixer(Mixer):
    """The Mamba-3 mixer. Parameters are float32; `dtype` is the compute dtype of the
    matmuls and the scan's operands; dt, A, the angles and the SSM state stay float32."""

    symbol = "3"
    name = "mamba3"
    Config = Mamba3Section
    checkpoint_keys = {"mamba_ssm": _KEYS}
    step_kernels = ("kernel", "fused")
    # Measured with bench.generate (mamba3-1.3b, float32 states; BENCHMARKS.md, row E5): the
    # step kernel between XLA's projections is on par with XLA's step at batch 8 and slower
    # above it, where its per-head programs move the state more slowly than XLA's fusions.
    step_kernel_max_batch = 8

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, h, p, g, r, n, a = dims(cfg)
        m = cfg.mamba3
        self.cfg = cfg
        self.dtype = dtype
        # nn.Linear's default init, U(+-1/sqrt(fan_in)), for in_proj.
        bound = 1.0 / math.sqrt(d)
        proj = lambda shape, *axes: param(uniform(rngs, (d, *shape), bound), "embed", *axes)
        self.z_proj = proj((h, p), "heads", "head_dim")
        self.x_proj = proj((h, p), "heads", "head_dim")
        self.B_proj = proj((r, g, n), "mimo_rank", "groups", "state")
        self.C_proj = proj((r, g, n), "mimo_rank", "groups", "state")
        self.dt_proj = proj((h,), "heads")
        self.A_proj = proj((h,), "heads")
        self.trap_proj = proj((h,), "heads")
        self.angle_proj = proj((a,), "angles")
        undecayed = functools.partial(param, decay=False)
        self.dt_bias = undecayed(dt_bias_init(rngs, h, m), "heads")
        ones = lambda *shape: jnp.ones(shape, jnp.float32)
        self.B_bias = undecayed(ones(h, r, n), "heads", "mimo_rank", "state")
        self.C_bias = undecayed(ones(h, r, n), "heads", "mimo_rank", "state")
        self.B_norm = undecayed(ones(n), "state")
        self.C_norm = undecayed(ones(n), "state")
        if m.is_mimo:
            self.mimo_x = param(ones(h, r, p) / r, "heads", "mimo_rank", "head_dim")
            self.mimo_z = param(ones(h, r, p), "heads", "mimo_rank", "head_dim")
            self.mimo_o = param(ones(h, r, p) / r, "heads", "mimo_rank", "head_dim")
        self.D = undecayed(ones(h), "heads")
        if m.is_outproj_norm:
            self.norm = undecayed(ones(h, p), "heads", "head_dim")
        # Re-initialised as mamba_ssm's _init_weights does out_proj: kaiming_uniform(a=sqrt 5)
        # = U(+-1/sqrt(fan_in)), divided by sqrt(residual layers).
        self.out_proj = param(uniform(rngs, (h, p, d), 1.0 / math.sqrt(h * p))
                              / math.sqrt(len(cfg.layers)), "heads", "head_dim", "embed")

    # ------------------------------------------------------------ the forward

    def __call__(self, u, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None):
        """Mixer.__call__: u [b, l, d] -> (this rank's share of out_proj [b, l, d] float32,
        the Mamba3State after the last token or None)."""
        z, x, B, C, dt, adt, trap, angles = self.project(u, ctx)
        y, state = mamba3_scan(C, B, x, adt, dt, trap, angles, self.C_bias[...],
                               self.B_bias[...], chunk_size=self.cfg.mamba3.chunk_size,
                               D=self.D[...], mimo_x=self._mimo("mimo_x"),
                               rotary=self.rotary, seq_idx=seq_idx,
                               sequence_axis=ctx.sequence_axis)
        # Checkpointed: the backward pass recomputes the gate's float32 terms from y and z,
        # which it keeps anyway (160 of the 297 MB a mamba3-1.3b layer on the kernels kept
        # per 2048-token row without it).
        out = jax.checkpoint(lambda y, z: self.out_proj_partial(self.gate(y, z), ctx=ctx))(y, z)
        # Under cp, the state after the whole sequence: the last part's, on every device
        return out, (None if cache_len is None else jax.tree.map(ctx.from_last_cp, state))

    @property
    def rotary(self) -> str:
        return rotary_layout(self.cfg)

    def _mimo(self, name):
        return getattr(self, name)[...] if self.cfg.mamba3.is_mimo else None

    def in_proj(self):
        """The input projections side by side in mamba_ssm's in_proj order: [d, N] in the
        weights' dtype (this rank's heads and groups)."""
        roles = (self.z_proj, self.x_proj, self.B_proj, self.C_proj, self.dt_proj,
                 self.A_proj, self.trap_proj, self.angle_proj)
        return jnp.concatenate([w[...].reshape(w.shape[0], -1) for w in roles], axis=1)

    def project(self, u, ctx: ParallelContext = SINGLE_DEVICE, in_proj=None):
        """u [..., d] -> the scan's inputs: z, x [..., h, p] and B, C [..., r, g', n] (normed;
        g' the groups this rank's heads read) in the compute dtype; dt, adt = A * dt, trap
        [..., h] and angles [..., a] float32. One matmul over in_proj() (or the given
        Mamba3Weights.in_proj), its output split (its gradient one concatenation:
        split_last)."""
        h, p = self.z_proj.shape[1:]
        r, g, n = self.B_proj.shape[1:]
        a = self.angle_proj.shape[1]
        w = self.in_proj() if in_proj is None else in_proj
        out = dense(u, w, self.dtype, out_dtype=self.dtype, ctx=ctx)
        sizes = (h * p, h * p, r * g * n, r * g * n, h, h, h, a)
        z, x, B, C, dd_dt, dd_A, trap, angles = split_last(out, sizes)
        lead = out.shape[:-1]
        z, x = z.reshape(*lead, h, p), x.reshape(*lead, h, p)
        B, C, dt, adt = projected(B.reshape(*lead, r, g, n), C.reshape(*lead, r, g, n), dd_dt,
                                  dd_A, self.B_norm[...], self.C_norm[...], self.dt_bias[...],
                                  self.cfg.mamba3.A_floor)
        if self.cfg.mamba3.ngroups % ctx.tp:  # every group on every rank: take our heads'
            B, C = (self._local_groups(t, ctx) for t in (B, C))
        return z, x, B, C, dt, adt, trap.astype(jnp.float32), angles.astype(jnp.float32)

    def _local_groups(self, t, ctx):
        """t [..., r, g, n], every group -> [..., r, g', n], the groups this rank's heads
        read (common.groups_of_local_heads, over the rank axis folded away)."""
        *lead, r, g, n = t.shape
        flat = jnp.moveaxis(t, -3, -2).reshape(-1, 1, g, r * n)
        local = groups_of_local_heads(flat, dims(self.cfg).h, g, ctx)
        local = local.reshape(*lead, local.shape[2], r, n)
        return jnp.moveaxis(local, -2, -3)

    def gate(self, y, z):
        """The scan's y [..., r, h, p] and z [..., h, p] -> [..., h, p] in the compute dtype
        (reference.gate over this layer's mimo_z, mimo_o and out-projection norm), computed
        in float32."""
        norm = self.norm[...] if self.cfg.mamba3.is_outproj_norm else None
        return gate(y, z, self._mimo("mimo_z"), self._mimo("mimo_o"), norm).astype(self.dtype)

    def out_proj_partial(self, y, out_proj=None, ctx: ParallelContext = SINGLE_DEVICE):
        """y [..., h, p] -> [..., d] float32: over a shard of the heads, this tp rank's
        share of the sum. out_proj: Mamba3Weights.out_proj [d, h*p]; None reads the
        parameter."""
        if out_proj is None:
            return matmul("...hp,hpd->...d", y, self.out_proj[...], self.dtype, ctx=ctx)
        return matmul("...e,de->...d", y.reshape(*y.shape[:-2], -1), out_proj, self.dtype)

    # ------------------------------------------------------------ decoding

    def init_cache(self, batch_size: int, cache_len: int = 0) -> Mamba3State:
        _, h, p, _, r, n, a = dims(self.cfg)
        f32 = jnp.float32
        return Mamba3State(jnp.zeros((batch_size, h, a), f32),
                           jnp.zeros((batch_size, h, p, n), f32),
                           jnp.zeros((batch_size, r, h, n), f32),
                           jnp.zeros((batch_size, h, p), f32))

    def cache_for_decoding(self, cache: Mamba3State, how: str, ssm_state_dtype: str):
        """The SSM state stored in ssm_state_dtype ("int8": an Int8State, a scale per
        headdim channel); the angle, k and x stay float32."""
        return Mamba3State(cache.angle.astype(jnp.float32), state_in(cache.ssm, ssm_state_dtype),
                           cache.k.astype(jnp.float32), cache.x.astype(jnp.float32))

    def step_weights(self, how: str = "xla") -> Mamba3Weights:
        """The Mamba3Weights of the current parameters (build them outside the decode loop),
        the in-projection transposed for `fused_step` if how is "fused"."""
        w, out = self.in_proj(), self.out_proj[...]
        return Mamba3Weights((w.T if how == "fused" else w).astype(self.dtype),
                             out.reshape(-1, out.shape[-1]).T.astype(self.dtype))

    def step(self, u, cache: Mamba3State, weights: Mamba3Weights, how="xla"):
        """One token: u [b, d] -> (out_proj's output [b, d] float32, the updated
        Mamba3State): the recurrence's step in float32, the SSM state stored back as the
        cache's is (its dtype, or an Int8State). how: what comes between the projections
        (the norms of B and C, dt, A, the step and the gate) as XLA fusions ("xla") or as
        one Pallas kernel that reads the in-projection's output in place ("kernel";
        pallas_kernels.mamba3.step)."""
        zxbcdt = dense(u, weights.in_proj, self.dtype, out_dtype=self.dtype)
        y, new = self._decode_step(cache, zxbcdt, "triton" if how == "kernel" else "xla")
        return self.out_proj_partial(y, weights.out_proj), new

    def fused_step(self, residual, norm_weight, norm_eps, cache: Mamba3State,
                   weights: Mamba3Weights):
        """A whole Mamba-3 block for one token in three Pallas kernels: residual [b, d] ->
        (residual + mixer(rms_norm(residual)), the updated Mamba3State). The block's RMSNorm
        (norm_weight [d], norm_eps) with the in-projection, one
        pallas_kernels.decode.norm_matmul kernel; the step kernel, which reads that row in
        place; out_proj with the residual add, a norm_matmul without a norm. The arithmetic
        of Block.step over `step` but for where the norm's operand is rounded
        (pallas_kernels.decode.norm_matmul), for a decoding step at small batch, which is
        bound by its kernel count. weights: step_weights("fused")."""
        zxbcdt = rms_norm_matmul(residual, norm_weight, weights.in_proj, eps=norm_eps,
                                 w_transposed=True, implementation="triton")
        y, new = self._decode_step(cache, zxbcdt, "triton")
        return rms_norm_matmul(y.reshape(y.shape[0], -1), None, weights.out_proj, eps=None,
                               bias=self.output_bias(), residual=residual, w_transposed=True,
                               implementation="triton"), new

    def _decode_step(self, cache: Mamba3State, zxbcdt, implementation):
        """pallas_kernels.mamba3.step.decode_step over this layer's parameters: zxbcdt [b, N]
        -> (the gated y [b, h, p] in the compute dtype, the new Mamba3State)."""
        m = self.cfg.mamba3
        params = StepParams(self.dt_bias[...], self.B_norm[...], self.C_norm[...],
                            self.C_bias[...], self.B_bias[...], self.D[...],
                            self._mimo("mimo_x"), self._mimo("mimo_z"), self._mimo("mimo_o"),
                            self.norm[...] if m.is_outproj_norm else None)
        return decode_step(cache, zxbcdt, params, A_floor=m.A_floor, rotary=self.rotary,
                           implementation=implementation)

    # ------------------------------------------------------------ the kind

    @classmethod
    def check_section(cls, cfg):
        check_dt_section(cfg, "mamba3", ("d_state", "expand", "headdim", "ngroups", "mimo_rank",
                                         "chunk_size"))
        m = cfg.mamba3
        if not m.A_floor > 0:
            raise ValueError(f"Mamba2Config.mamba3.A_floor={m.A_floor!r} must be > 0")
        if m.rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba2Config.mamba3.rope_fraction={m.rope_fraction!r}: "
                             "mamba_ssm's Mamba3 rotates 0.5 or 1.0 of d_state")
        if m.d_state % 2 or dims(cfg).a == 0:
            raise ValueError(f"Mamba2Config.mamba3.d_state={m.d_state} must be even and "
                             "leave at least one rotary pair (d_state * rope_fraction >= 2)")

    @classmethod
    def check_fit(cls, cfg):
        check_heads(cfg, "mamba3")

    @classmethod
    def kernels_support(cls, cfg) -> bool:
        _, _, p, _, _, n, a = dims(cfg)
        return step_supports(p, n, a, cfg.mamba3.is_outproj_norm)

    @classmethod
    def flops_per_token(cls, cfg, seq_len: int) -> float:
        """in_proj and out_proj; the scan's chunked matmuls at chunk q over r ranks: q . k
        and its product with v inside each chunk, the chunk states and their read-out."""
        d, h, p, g, r, n, a = dims(cfg)
        q = min(cfg.mamba3.chunk_size, seq_len)
        in_proj = 2 * d * (2 * h * p + 2 * r * g * n + 3 * h + a)
        return (in_proj + 2 * h * p * d + 2 * q * r * r * h * (n + p)
                + 4 * r * h * p * n)

