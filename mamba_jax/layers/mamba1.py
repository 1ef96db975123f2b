"""The Mamba-1 layer (layer_pattern symbol 1): in_proj -> causal conv -> x_proj (dt, B, C)
-> dt_proj -> selective scan -> gate -> out_proj, as mamba_ssm's Mamba (mamba_simple.py) and
transformers' MambaMixer compute it; Falcon-Mamba's RMSNorms on dt, B and C as an option;
its config section (cfg.mamba1), decoding cache and one-token step, checkpoint keys and
FLOPs.

Legend: b batch, l sequence, d d_model, i d_inner = expand * d, r dt_rank, n d_state,
k d_conv. Each of the i channels is its own SSM with a state of n entries (the scan's
"heads" of one channel: they take the "heads" logical axis).

mamba_ssm fuses in_proj [x | z] and x_proj [dt | B | C]; we keep one parameter per role,
so that a tensor-parallel shard is a slice of one axis and conversion is a fixed
split/concatenate (checkpoint_keys).

Tensor parallel (ctx.tp > 1), which neither mamba_ssm nor Megatron-LM offers for Mamba-1:
in_proj and dt_proj column-parallel over the channels, the conv and the scan local to this
rank's channels, x_proj row-parallel (each rank's channels give a share of dt, B, C, which
one psum of r + 2n floats per token completes: every rank then holds the whole dt, B, C),
out_proj row-parallel. Context parallel (ctx.cp > 1): the conv reads the previous device's
last d_conv - 1 inputs, and the scan carries its state across devices
(pallas_kernels.selective_scan).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.layers.checkpoint_keys import AsIs, Conv, Flat, Linear
from mamba_jax.layers.common import (Mixer, check_dt_section, conv_window, dense,
                                     dt_bias_init, matmul, param, rms_norm, split_last,
                                     uniform)
from mamba_jax.layers.mamba2 import MambaCache
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels.conv import causal_conv1d
from pallas_kernels.selective_scan import selective_scan
from pallas_kernels.selective_scan.reference import selective_state_update
from pallas_kernels.ssd import document_ids
from pallas_kernels.ssd.step import load_state, state_in, store_state

DT_INITS = ("random", "constant")


@dataclasses.dataclass(frozen=True)
class Mamba1Section:
    """cfg.mamba1: mamba_ssm's Mamba arguments (its ssm_cfg), with its defaults.
    bc_dt_rms: Falcon-Mamba's weightless RMSNorms on dt (before dt_proj), B and C, with
    bc_dt_rms_eps (transformers' FalconMambaConfig.mixer_rms_eps). chunk_size: the XLA
    scan's tokens per loop step (pallas_kernels.selective_scan; 8 measured fastest on a
    CPU, and its compile grows with it)."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str = "auto"
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init: str = "random"
    dt_scale: float = 1.0
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False
    bc_dt_rms: bool = False
    bc_dt_rms_eps: float = 1e-6
    chunk_size: int = 8


class Dims(NamedTuple):
    d: int
    i: int
    r: int
    n: int
    k: int


def dims(cfg) -> Dims:
    m = cfg.mamba1
    r = math.ceil(cfg.d_model / 16) if m.dt_rank == "auto" else m.dt_rank
    return Dims(cfg.d_model, m.expand * cfg.d_model, r, m.d_state, m.d_conv)


class StepWeights(NamedTuple):
    """A Mamba-1 layer's weights as the decoding step reads them, built once before the
    decode loop: in_proj (w [d, 2i] in the compute dtype, bias [2i] or None), conv (w
    [i, k], bias [i] or None, float32), x_proj [i, r + 2n] and dt_proj [r, i] in the
    compute dtype, out_proj [i, d] in the compute dtype, A [i, n] = -exp(A_log) float32."""

    in_proj: tuple
    conv: tuple
    x_proj: jax.Array
    dt_proj: jax.Array
    out_proj: jax.Array
    A: jax.Array


# HF MambaForCausalLM, FalconMambaForCausalLM and mamba_ssm name a Mamba layer's tensors
# alike (Falcon-Mamba's norms are weightless).
_KEYS = {"in_proj.weight": Linear("in_proj_x", "in_proj_z"),
         "in_proj.bias": Flat("in_proj_x_bias", "in_proj_z_bias"),
         "conv1d.weight": Conv("conv"), "conv1d.bias": Flat("conv_bias"),
         "x_proj.weight": Linear("x_proj_dt", "x_proj_B", "x_proj_C"),
         "dt_proj.weight": Linear("dt_proj"), "dt_proj.bias": Flat("dt_proj_bias"),
         "A_log": AsIs("A_log"), "D": Flat("D"),
         "out_proj.weight": Linear("out_proj"), "out_proj.bias": Flat("out_bias")}


class Mamba1Mixer(Mixer):
    """The Mamba-1 mixer. Parameters are float32; `dtype` is the compute dtype of the
    matmuls, the conv and the scan's x, B, C; dt, A, D and the SSM state stay float32."""

    symbol = "1"
    name = "mamba1"
    Config = Mamba1Section
    checkpoint_keys = {"hf": _KEYS, "mamba_ssm": _KEYS}

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, i, r, n, k = dims(cfg)
        m = cfg.mamba1
        self.cfg = cfg
        self.dtype = dtype
        undecayed = functools.partial(param, decay=False)
        # nn.Linear's and nn.Conv1d's default init; Linear biases zero (mamba_ssm's
        # _init_weights), the conv's bias drawn like its weight.
        self.in_proj_x = param(uniform(rngs, (d, i), 1 / math.sqrt(d)), "embed", "heads")
        self.in_proj_z = param(uniform(rngs, (d, i), 1 / math.sqrt(d)), "embed", "heads")
        if m.bias:
            self.in_proj_x_bias = undecayed(jnp.zeros((i,), jnp.float32), "heads")
            self.in_proj_z_bias = undecayed(jnp.zeros((i,), jnp.float32), "heads")
            self.out_bias = undecayed(jnp.zeros((d,), jnp.float32), "embed")
        self.conv = param(uniform(rngs, (k, i), 1 / math.sqrt(k)), "conv", "heads")
        if m.conv_bias:
            self.conv_bias = undecayed(uniform(rngs, (i,), 1 / math.sqrt(k)), "heads")
        self.x_proj_dt = param(uniform(rngs, (i, r), 1 / math.sqrt(i)), "heads", "dt_rank")
        self.x_proj_B = param(uniform(rngs, (i, n), 1 / math.sqrt(i)), "heads", "state")
        self.x_proj_C = param(uniform(rngs, (i, n), 1 / math.sqrt(i)), "heads", "state")
        # dt_proj keeps dt's variance at init: U(+-std) or std with std = dt_scale / sqrt(r).
        std = m.dt_scale / math.sqrt(r)
        self.dt_proj = param(uniform(rngs, (r, i), std) if m.dt_init == "random"
                             else jnp.full((r, i), std, jnp.float32), "dt_rank", "heads")
        self.dt_proj_bias = undecayed(dt_bias_init(rngs, i, m), "heads")
        # S4D-real: A[:, j] = -(j + 1).
        self.A_log = undecayed(jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32),
                                                        (i, n))), "heads", "state")
        self.D = undecayed(jnp.ones((i,), jnp.float32), "heads")
        # Rescaled by 1/sqrt(residual layers), as mamba_ssm's rescale_prenorm_residual.
        self.out_proj = param(uniform(rngs, (i, d), 1 / math.sqrt(i)) / math.sqrt(len(cfg.layers)),
                              "heads", "embed")

    # ------------------------------------------------------------ the forward

    def __call__(self, u, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None):
        """Mixer.__call__: u [b, l, d] -> (this rank's share of out_proj [b, l, d] float32,
        a MambaCache or None). seq_idx [b, l]: packed documents; the conv and the state
        restart where it changes."""
        x_in, z = self.project(u, ctx=ctx)
        x = self.conv_silu(x_in, seq_idx, ctx)
        dt, B, C = self.select(x, ctx)
        y, ssm_state = selective_scan(
            x, dt, self.A(), B, C, D=self.D[...], dt_bias=self.dt_proj_bias[...],
            dt_softplus=True, initial_state=None, seq_idx=seq_idx, return_final_state=True,
            sequence_axis=ctx.sequence_axis, chunk_size=self.cfg.mamba1.chunk_size)
        out = self.out_proj_partial(self.gate(y, z), ctx=ctx)
        if cache_len is None:
            return out, None
        doc = None if seq_idx is None else document_ids(seq_idx)
        # Under cp, the state after the whole sequence: the last part's, on every device
        return out, MambaCache(ctx.from_last_cp(conv_window(x_in, doc, self.cfg.mamba1.d_conv)),
                               ctx.from_last_cp(ssm_state))

    def output_bias(self):
        return self.out_bias[...] if self.cfg.mamba1.bias else None

    def A(self):
        """A = -exp(A_log) [i, n] float32."""
        return -jnp.exp(self.A_log[...])

    def in_proj(self):
        """in_proj [x | z]: w [d, 2i] and bias [2i] or None, in the weights' dtype."""
        w = jnp.concatenate([self.in_proj_x[...], self.in_proj_z[...]], axis=1)
        if not self.cfg.mamba1.bias:
            return w, None
        return w, jnp.concatenate([self.in_proj_x_bias[...], self.in_proj_z_bias[...]])

    def project(self, u, in_proj=None, ctx: ParallelContext = SINGLE_DEVICE):
        """u [..., d] -> x, z [..., i] in the compute dtype: one matmul over in_proj() (or
        StepWeights.in_proj), its output split (its gradient one concatenation:
        split_last)."""
        w, bias = self.in_proj() if in_proj is None else in_proj
        xz = dense(u, w, self.dtype, bias, out_dtype=self.dtype, ctx=ctx)
        return split_last(xz, (xz.shape[-1] // 2,) * 2)

    def _conv_params(self):
        return self.conv[...], self.conv_bias[...] if self.cfg.mamba1.conv_bias else None

    def conv_silu(self, x, seq_idx=None, ctx: ParallelContext = SINGLE_DEVICE):
        """The causal depthwise conv and SiLU over x [b, l, i]; under cp the first d_conv - 1
        outputs read the previous device's last inputs, and no tap crosses a document."""
        width, l = self.cfg.mamba1.d_conv - 1, x.shape[1]
        doc = None
        if seq_idx is not None:
            doc = document_ids(ctx.with_previous_tokens(seq_idx, width))
        return causal_conv1d(ctx.with_previous_tokens(x, width), *self._conv_params(), doc,
                             length=l)

    def x_proj(self):
        """x_proj [dt | B | C]: [i, r + 2n], in the weights' dtype."""
        return jnp.concatenate([self.x_proj_dt[...], self.x_proj_B[...], self.x_proj_C[...]],
                               axis=1)

    def select(self, x, ctx: ParallelContext = SINGLE_DEVICE, weights=None):
        """The selection: x [..., i] -> dt [..., i] float32 (before dt_proj_bias and
        softplus), B, C [..., n] in the compute dtype. x_proj is row-parallel: this rank's
        channels give a share of [dt_low | B | C], which one psum of r + 2n floats per
        token completes; dt_proj is column-parallel from there. weights: (x_proj, dt_proj)
        of StepWeights, else the parameters."""
        x_proj, dt_proj = (self.x_proj(), self.dt_proj[...]) if weights is None else weights
        r, n = self.dt_proj.shape[0], self.cfg.mamba1.d_state
        dbc = ctx.psum_tp(dense(x, x_proj, self.dtype))  # float32 [..., r + 2n]
        dt_low, B, C = jnp.split(dbc, [r, r + n], axis=-1)
        m = self.cfg.mamba1
        if m.bc_dt_rms:  # Falcon-Mamba: weightless RMSNorms in float32
            norm = lambda v: rms_norm(v, jnp.ones(v.shape[-1], jnp.float32), m.bc_dt_rms_eps)
            dt_low, B, C = norm(dt_low), norm(B), norm(C)
        dt = dense(dt_low.astype(self.dtype), dt_proj, self.dtype)
        return dt, B.astype(self.dtype), C.astype(self.dtype)

    def gate(self, y, z):
        """y * silu(z) in float32, rounded to the compute dtype (out_proj's input).
        Checkpointed: the backward pass recomputes its float32 intermediates from y and z,
        which it keeps anyway (kept, they were five [b, l, i] float32 arrays a layer)."""
        dtype = self.dtype
        return jax.checkpoint(lambda y, z: (y.astype(jnp.float32) * jax.nn.silu(
            z.astype(jnp.float32))).astype(dtype))(y, z)

    def out_proj_partial(self, y, out_proj=None, ctx: ParallelContext = SINGLE_DEVICE):
        """y [..., i] -> [..., d] float32 without the bias: over a shard of the channels one
        tensor-parallel rank's share of the sum."""
        return matmul("...i,id->...d", y, self.out_proj[...] if out_proj is None else out_proj,
                      self.dtype, ctx=ctx)

    # ------------------------------------------------------------ decoding

    def init_cache(self, batch_size: int, cache_len: int = 0) -> MambaCache:
        _, i, _, n, k = dims(self.cfg)
        return MambaCache(jnp.zeros((batch_size, i, k), self.dtype),
                          jnp.zeros((batch_size, i, n), jnp.float32))

    def cache_for_decoding(self, cache: MambaCache, how: str, ssm_state_dtype: str):
        """The SSM state stored in ssm_state_dtype ("int8": an Int8State, a scale per
        channel)."""
        return cache._replace(ssm_state=state_in(cache.ssm_state, ssm_state_dtype))

    def step_weights(self, how: str = "xla") -> StepWeights:
        cast = lambda w: w.astype(self.dtype)
        w, bias = self.in_proj()
        conv_w, conv_b = self._conv_params()
        return StepWeights((cast(w), bias), (conv_w.T, conv_b), cast(self.x_proj()),
                           cast(self.dt_proj[...]), cast(self.out_proj[...]), self.A())

    def step(self, u, cache: MambaCache, weights: StepWeights, how="xla"):
        """One token: u [b, d] -> (out_proj's output [b, d] float32 before its bias, the
        updated MambaCache: conv_state [b, i, k], ssm_state [b, i, n] stored as the cache's
        is (its dtype, or an Int8State), computed in float32). The arithmetic of the forward
        for one token, as XLA fusions; there is no step kernel (bench.selective_scan times
        this SSM update against mamba_ssm's Triton selective_state_update)."""
        x, z = self.project(u, weights.in_proj)
        window = jnp.concatenate([cache.conv_state[..., 1:], x[..., None]], axis=-1)
        conv_w, conv_b = weights.conv
        pre = jnp.einsum("bik,ik->bi", window.astype(jnp.float32), conv_w)
        x = jax.nn.silu(pre if conv_b is None else pre + conv_b).astype(self.dtype)
        dt, B, C = self.select(x, weights=(weights.x_proj, weights.dt_proj))
        dt = jax.nn.softplus(dt + self.dt_proj_bias[...])
        y, state = selective_state_update(load_state(cache.ssm_state), x, dt, weights.A, B, C,
                                          self.D[...])
        return (self.out_proj_partial(self.gate(y, z), weights.out_proj),
                MambaCache(window, store_state(state, cache.ssm_state)))

    # ------------------------------------------------------------ the kind

    @classmethod
    def check_section(cls, cfg):
        check_dt_section(cfg, "mamba1", ("d_state", "d_conv", "expand", "chunk_size"),
                         ("dt_min", "dt_max", "dt_init_floor", "dt_scale", "bc_dt_rms_eps"))
        m = cfg.mamba1
        if m.dt_rank != "auto" and not (isinstance(m.dt_rank, int)
                                        and not isinstance(m.dt_rank, bool) and m.dt_rank > 0):
            raise ValueError(f"Mamba2Config.mamba1.dt_rank={m.dt_rank!r} must be 'auto' "
                             "(ceil(d_model / 16)) or a positive integer")
        if m.dt_init not in DT_INITS:
            raise ValueError(f"Mamba2Config.mamba1.dt_init={m.dt_init!r}; use one of "
                             f"{DT_INITS}")

    @classmethod
    def flops_per_token(cls, cfg, seq_len: int) -> float:
        """in_proj (x, z), x_proj (dt, B, C), dt_proj and out_proj; the scan is elementwise
        (about 3 multiply-adds per channel and state entry, not counted as matmul work)."""
        d, i, r, n, _ = dims(cfg)
        return 2 * d * 2 * i + 2 * i * (r + 2 * n) + 2 * r * i + 2 * i * d
