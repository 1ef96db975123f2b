"""The MLP layer (layer_pattern symbol -): SwiGLU, `down(up(u) * silu(gate(u)))` (mamba_ssm's
GatedMLP, whose fc1 is [up | gate]; Megatron's --swiglu), squared ReLU, `down(relu(up(u))**2)`
(NemotronH, Megatron's --squared-relu), or GeLU, `down(gelu(up(u)))`: "gelu" the exact
x * Phi(x) (Megatron's default, torch's F.gelu) and "gelu_tanh" its tanh approximation
(Megatron's --openai-gelu); its config section (cfg.mlp), one-token steps, checkpoint keys
and FLOPs. No biases (neither source uses them).

Legend: b batch, l sequence, d d_model, f the MLP width (mlp.d_intermediate).
Tensor parallel: up and gate column-parallel on f/tp columns, down row-parallel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.layers.checkpoint_keys import Linear
from mamba_jax.layers.common import Mixer, dense, param, uniform
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels.decode.norm_matmul import rms_norm_matmul

ACTIVATIONS = ("swiglu", "relu2", "gelu", "gelu_tanh")
# mamba_ssm's GatedMLP rounds its hidden width up to a multiple of this (multiple_of=128).
GATED_MLP_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class MLPSection:
    """cfg.mlp: the MLP's hidden width and activation ("swiglu": mamba_ssm's GatedMLP,
    "relu2": NemotronH's, "gelu" / "gelu_tanh": Megatron's default / --openai-gelu). In
    mamba_ssm's layer form (no layer_pattern) d_intermediate > 0 gives every block an MLP
    layer. A model with MLP layers and d_intermediate 0 gets default_width's."""

    d_intermediate: int = 0
    activation: str = "swiglu"


def default_width(d_model: int, activation: str) -> int:
    """The MLP width where none is given: mamba_ssm's GatedMLP's for SwiGLU (8/3 d_model,
    rounded up to a multiple of 128), Megatron's ffn_hidden_size (4 d_model) for the
    ungated activations."""
    if activation == "swiglu":
        return -(-int(8 * d_model / 3) // GATED_MLP_MULTIPLE) * GATED_MLP_MULTIPLE
    return 4 * d_model


class MLPWeights(NamedTuple):
    """An MLP layer's weights as a decoding step reads them, in the compute dtype, built once
    before the decode loop. For the XLA step: up, gate [d, f] (gate None for relu2), down [f,
    d]. For the fused step: up [f, d], or [2f, d] for swiglu (gate_proj's rows, then
    up_proj's: the gate, which the down-projection's kernel reads as its z, first), gate
    None, down [d, f]; transposed, as the kernels read contiguous rows."""

    up: jax.Array
    gate: jax.Array | None
    down: jax.Array


class MLP(Mixer):
    """The MLP mixer. up_proj, gate_proj [d, f] and down_proj [f, d] are float32 parameters;
    `dtype` is the matmuls' compute dtype."""

    symbol = "-"
    name = "mlp"
    Config = MLPSection
    checkpoint_keys = {"mamba_ssm": {"fc1.weight": Linear("up_proj", "gate_proj"),
                                     "fc2.weight": Linear("down_proj")},
                       "nemotron_h": {"up_proj.weight": Linear("up_proj"),
                                      "down_proj.weight": Linear("down_proj")},
                       # Megatron-LM's MLP: linear_fc1 [gate | up] for SwiGLU (its
                       # gated_linear_unit: act(first half) * second half), up alone else.
                       "megatron": {"mlp.linear_fc1.weight": Linear(
                                        "gate_proj", "up_proj", optional=("gate_proj",)),
                                    "mlp.linear_fc2.weight": Linear("down_proj")}}
    step_kernels = ("fused",)

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, f = cfg.d_model, cfg.mlp.d_intermediate
        self.activation = cfg.mlp.activation
        self.dtype = dtype
        # nn.Linear's default init; the output projection rescaled by 1/sqrt(residual
        # layers) as mamba_ssm's _init_weights does for fc2.
        self.up_proj = param(uniform(rngs, (d, f), 1.0 / math.sqrt(d)), "embed", "mlp")
        if self.activation == "swiglu":
            self.gate_proj = param(uniform(rngs, (d, f), 1.0 / math.sqrt(d)), "embed", "mlp")
        self.down_proj = param(uniform(rngs, (f, d), 1.0 / math.sqrt(f))
                               / math.sqrt(len(cfg.layers)), "mlp", "embed")

    def __call__(self, u, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None):
        """Mixer.__call__: u [b, l, d] -> (this rank's share of down_proj [b, l, d] float32,
        None: an MLP keeps nothing between tokens). Each token alone: seq_idx and ctx's
        sequence axes do not matter to it."""
        gate = self.gate_proj[...] if self.activation == "swiglu" else None
        return self._mlp(u, MLPWeights(self.up_proj[...], gate, self.down_proj[...]), ctx), None

    def _mlp(self, u, weights: MLPWeights, ctx: ParallelContext = SINGLE_DEVICE):
        """u [..., d] -> [..., d] float32 through weights (the parameters' layout)."""
        up = dense(u, weights.up, self.dtype, ctx=ctx)
        if self.activation == "swiglu":
            hidden = up * jax.nn.silu(dense(u, weights.gate, self.dtype, ctx=ctx))
        elif self.activation == "relu2":
            hidden = jnp.square(jax.nn.relu(up))
        else:
            hidden = jax.nn.gelu(up, approximate=self.activation == "gelu_tanh")
        return dense(hidden.astype(self.dtype), weights.down, self.dtype, ctx=ctx)

    def step_weights(self, how: str = "xla") -> MLPWeights:
        """MLPWeights for the XLA step, or with how "fused" for fused_step."""
        cast = lambda w: w[...].astype(self.dtype)
        if how != "fused":
            gate = cast(self.gate_proj) if self.activation == "swiglu" else None
            return MLPWeights(cast(self.up_proj), gate, cast(self.down_proj))
        w_in = self.up_proj[...]
        if self.activation == "swiglu":
            w_in = jnp.concatenate([self.gate_proj[...], w_in], axis=1)
        return MLPWeights(w_in.T.astype(self.dtype), None,
                          self.down_proj[...].T.astype(self.dtype))

    def step(self, u, cache, weights: MLPWeights, how="xla"):
        """One token: u [b, d] -> (down_proj's output [b, d] float32, None)."""
        return self._mlp(u, weights), None

    def fused_step(self, residual, norm_weight, norm_eps, cache, weights: MLPWeights):
        """residual [b, d] -> (residual + MLP(rms_norm(residual)) in residual's dtype, None),
        as two pallas_kernels.decode.norm_matmul kernels: the layer's RMSNorm (norm_weight
        [d], norm_eps) with the input projections, then the activation with down_proj and
        the residual add, where XLA runs a norm fusion, two matrix-vector products and the
        elementwise work between them. The arithmetic of Block.step (the input projections'
        float32 results unrounded, the norm's operand rounded where
        pallas_kernels.decode.norm_matmul says); for a decoding step of a few rows.
        weights: step_weights("fused")."""
        f = weights.down.shape[1]
        projected = rms_norm_matmul(residual, norm_weight, weights.up, eps=norm_eps,
                                    w_transposed=True, out_dtype=jnp.float32,
                                    implementation="triton")  # [b, f or 2f] float32
        if self.activation == "swiglu":  # up times silu(gate): the kernel's gate (z)
            x, z, activation = projected[:, f:], projected, None
        else:
            x, z, activation = projected, None, self.activation
        return rms_norm_matmul(x, None, weights.down, eps=None, z=z, activation=activation,
                               residual=residual, w_transposed=True,
                               implementation="triton"), cache

    @classmethod
    def completed(cls, cfg):
        """cfg.mlp with d_intermediate 0 (not given) set to default_width."""
        m = cfg.mlp
        if m.d_intermediate != 0 or m.activation not in ACTIVATIONS:
            return m  # given, or refused by check_config
        return dataclasses.replace(m, d_intermediate=default_width(cfg.d_model, m.activation))

    @classmethod
    def check_section(cls, cfg):
        m = cfg.mlp
        if m.activation not in ACTIVATIONS:
            raise ValueError(f"Mamba2Config.mlp.activation={m.activation!r}; use one of "
                             f"{ACTIVATIONS}")
        if cfg.mlp.d_intermediate < 0:
            raise ValueError(f"Mamba2Config.mlp.d_intermediate={cfg.mlp.d_intermediate} must "
                             "be > 0 (the MLP width; 0 for the default, "
                             f"{default_width(cfg.d_model, m.activation)} here)")

    @classmethod
    def flops_per_token(cls, cfg, seq_len: int) -> float:
        """fc1 (gate and up for SwiGLU) and fc2."""
        m = cfg.mlp
        return 2 * cfg.d_model * m.d_intermediate * (3 if m.activation == "swiglu" else 2)
