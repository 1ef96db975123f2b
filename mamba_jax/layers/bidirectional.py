"""The bidirectional Mamba2 layer (layer_pattern symbol B): a non-causal mixer for encoders and
vision or speech backbones (the idea of Vim and Hydra). Every output reads the whole
sequence (of its document): the SSD runs forward and on the reversed sequence, and the two
are summed before the gated norm and out_proj.

Legend as in mamba2.py: b batch, l sequence, d d_model, h nheads, p headdim, g ngroups,
n d_state, k d_conv, e conv_dim.

Its sizes are cfg.mamba2's; its section cfg.bidirectional chooses the conv. The layer has
a Mamba2 layer's parameters (one in_proj, conv, norm and out_proj, shared by both
directions, and the forward direction's dt_bias, A_log, D) and the backward direction's own
dt_bias_b, A_log_b, D_b:

    z, xBC, dt = in_proj(u)
    x, B, C = conv(xBC)                        (centred_conv: one conv over both sides)
    y = SSD(x, dt + dt_bias, A, B, C) + D x                           (forward)
      + flip(SSD(flip(x), flip(dt) + dt_bias_b, A_b, flip(B), flip(C))) + D_b x (backward)
    out = out_proj(rmsnorm_per_group(y * silu(z)))

With centred_conv=False the forward direction reads the causal conv (x_conv, ...) and the
backward direction an anti-causal one of its own (x_conv_b, ...: each output reads itself
and the k - 1 inputs after it). The two directions are combined by a sum; Hydra's
quasiseparable form (a shifted sum with a separate diagonal) is not implemented.

seq_idx (packed documents) holds both ways: neither the scans nor the conv read across a
document boundary. Under cp the backward scan passes its state from the last device to the
first (pallas_kernels.ssd, reverse=True) and a centred conv reads halos from both
neighbours; under tp each rank runs both directions on its heads, as the Mamba2 layer does.
The layer has no decoding cache and no one-token step (a token's output depends on the
tokens after it); use it in mamba_jax.encoder.Mamba2Encoder.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from mamba_jax.layers.mamba2 import Mamba2Mixer, dims
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels.conv import causal_conv1d
from pallas_kernels.ssd import document_ids, ssd


@dataclasses.dataclass(frozen=True)
class BidirectionalSection:
    """cfg.bidirectional. centred_conv: one conv shared by both directions, whose output t
    reads inputs t - (k - 1) // 2 .. t + k // 2; False: a causal conv for the forward
    direction and an anti-causal one for the backward (twice the conv parameters)."""

    centred_conv: bool = True


class BidirectionalMamba2(Mamba2Mixer):
    """The bidirectional Mamba2 mixer (module docstring). Parameters float32; `dtype` the
    compute dtype."""

    symbol = "B"
    name = "bidirectional"
    Config = BidirectionalSection
    reads = ("mamba2",)  # its sizes
    checkpoint_keys = {}  # no published format has this layer
    step_kernels = ()
    takes_initial_state = False
    causal = False

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs=rngs, dtype=dtype)
        # The backward direction's own decay, step size and skip, initialised as the forward
        # direction's.
        self._init_ssm(rngs, suffix="_b")
        if not cfg.bidirectional.centred_conv:
            self._init_conv(rngs, suffix="_b")

    def __call__(self, u, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None):
        """Mixer.__call__: u [b, l, d] -> (this rank's share of out_proj [b, l, d] float32,
        None: the layer keeps no cache). seq_idx [b, l]: packed documents, each mixed as if
        alone, both ways."""
        z, xBC, dt = self.project(u, ctx=ctx)
        k = self.cfg.mamba2.d_conv
        if self.cfg.bidirectional.centred_conv:
            forward = backward = self.window_conv(xBC, seq_idx, ctx, "", (k - 1) // 2)
        else:  # causal one way, anti-causal the other
            forward = self.window_conv(xBC, seq_idx, ctx, "", k - 1)
            backward = self.window_conv(xBC, seq_idx, ctx, "_b", 0)
        m = self.cfg.mamba2
        ys = []
        for (x, B, C), suffix in ((forward, ""), (backward, "_b")):
            y = ssd(x, dt, -jnp.exp(getattr(self, "A_log" + suffix)[...]), B, C,
                    chunk_size=m.chunk_size, D=getattr(self, "D" + suffix)[...],
                    dt_bias=getattr(self, "dt_bias" + suffix)[...], dt_softplus=True,
                    dt_limit=m.dt_limit, seq_idx=seq_idx, sequence_axis=ctx.sequence_axis,
                    reverse=suffix == "_b")
            ys.append(y.astype(jnp.float32))
        return self.gated_out_proj(ys[0] + ys[1], z, ctx), None

    def window_conv(self, xBC, seq_idx, ctx: ParallelContext, suffix: str, left: int):
        """The conv of weights x_conv{suffix}, ... and SiLU over xBC [b, l, e], output t
        reading inputs t - left .. t + k - 1 - left (under cp, the neighbours' tokens
        across the cuts; no tap across a document boundary) -> x, B, C (this rank's heads
        and the groups they read)."""
        w, bias = self._conv_params(suffix)
        l, right = xBC.shape[1], w.shape[0] - 1 - left

        def extend(a):
            """a [b, l, ...] with the tokens before and after this device's; where a starts."""
            before = ctx.with_previous_tokens(a, left)
            after = ctx.with_next_tokens(a, right)[:, l:]
            return jnp.concatenate([before, after], axis=1), before.shape[1] - l
        doc = None if seq_idx is None else document_ids(extend(seq_idx)[0])
        extended, start = extend(xBC)
        out = causal_conv1d(extended, w, bias, doc, left=left)[:, start:start + l]
        return self.split_conv_output(out, ctx)

    # ------------------------------------------------------------ no decoding

    def init_cache(self, batch_size: int, cache_len: int = 0):
        raise ValueError(f"layer kind {self.symbol} ({self.name}) is non-causal: it has no "
                         "decoding cache; generate with causal layers only")

    def step_weights(self, how: str = "xla"):
        self.init_cache(0)

    def step(self, u, cache, weights, how="xla"):
        self.init_cache(0)

    # ------------------------------------------------------------ the kind

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.mamba2.learnable_init_state:
            raise ValueError("Mamba2Config.mamba2.learnable_init_state=True is for causal "
                             "layers (M); a bidirectional layer (B) starts both scans from "
                             "zeros: set it False or use no B layers")

    @classmethod
    def flops_per_token(cls, cfg, seq_len: int) -> float:
        """The Mamba2 layer's, plus the backward direction's SSD (its chunked matmuls)."""
        _, _, h, p, g, n, _, _ = dims(cfg)
        q = min(cfg.mamba2.chunk_size, seq_len)
        return (super().flops_per_token(cfg, seq_len)
                + 2 * q * (g * n + h * p) + 4 * h * p * n)
