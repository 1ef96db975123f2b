"""The Mamba2 layer (layer_pattern symbol M): in_proj -> causal conv -> SSD -> gated norm ->
out_proj, as mamba_ssm's Mamba2; its config section (cfg.mamba2), decoding cache and
one-token steps, checkpoint keys and FLOPs.

Legend: b batch, l sequence, d d_model, h nheads, p headdim, g ngroups, n d_state,
k d_conv, e conv_dim = h*p + 2*g*n (x, B, C channels in mamba_ssm's order).

mamba_ssm fuses the projections into one `in_proj` [z, x, B, C, dt]; we keep one parameter
per role, shaped by head or group, so a tensor-parallel shard is a slice of one axis and
conversion is a fixed split/concatenate (checkpoint_keys), and concatenate this rank's
weights into one matmul when projecting.

Tensor parallel (ctx.tp > 1): the projections, conv, SSD and gated norm run on this rank's
heads (and groups, or every group where tp does not divide them: each rank then reads the
groups its heads use), out_proj is row-parallel. Context parallel (ctx.cp > 1): the conv
reads the previous device's last d_conv - 1 inputs, and the scan carries its state across
devices (pallas_kernels.ssd).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.layers.checkpoint_keys import Conv, Flat, Linear
from mamba_jax.layers.common import (Mixer, check_dt_section, check_heads, conv_window,
                                     dense, dt_bias_init, gated_rms_norm,
                                     groups_of_local_heads, local_head_groups, matmul,
                                     number_pair, param, split_last, uniform)
from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels import conv as conv_kernels
from pallas_kernels import norm as norm_kernels
from pallas_kernels import ssd as ssd_kernels
from pallas_kernels.conv import causal_conv1d
from pallas_kernels.decode.norm_matmul import rms_norm_matmul
from pallas_kernels.decode.step_out import mamba_step_out
from pallas_kernels.mamba2_mixer import Shapes as MixerShapes
from pallas_kernels.mamba2_mixer import mamba2_mixer
from pallas_kernels.ssd import document_ids, ssd
from pallas_kernels.ssd.step import Gated, mamba_step, state_in
from pallas_kernels.ssd.step import supports as step_supports


@dataclasses.dataclass(frozen=True)
class Mamba2Section:
    """cfg.mamba2: mamba_ssm's Mamba2 arguments (its ssm_cfg), with its defaults."""

    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, math.inf)
    A_init_range: tuple[float, float] = (1.0, 16.0)
    conv_bias: bool = True
    bias: bool = False
    # The number of heads; None: expand * d_model / headdim (mamba_ssm's). Set, the layer's
    # width h * headdim is independent of expand * d_model, as NemotronH's mamba_num_heads *
    # mamba_head_dim (Nemotron Nano 2's 128 heads of 80 over d_model 4480).
    nheads: int | None = None
    # A trained state [h, p, n] (zeros at init) entering every row's scan where no initial
    # state is given, as mamba_ssm's Mamba2Simple(learnable_init_states=True); parameter
    # init_states, held by our checkpoints, not by the HF, mamba_ssm or NemotronH formats.
    learnable_init_state: bool = False
    # D per head channel [h, p] (mamba_ssm's D_has_hdim: its D of d_inner) instead of one a
    # head [h]: y += D * x channel by channel, in the forward, the kernels and the step.
    D_has_hdim: bool = False

    def __post_init__(self):
        # Lists from JSON become tuples, so configs stay hashable and compare equal.
        for name in ("dt_limit", "A_init_range"):
            object.__setattr__(self, name, number_pair(f"mamba2.{name}", getattr(self, name)))


class Dims(NamedTuple):
    """A Mamba2 layer's sizes (legend above): e = conv_dim, d_inner = h*p."""

    d: int
    d_inner: int
    h: int
    p: int
    g: int
    n: int
    k: int
    e: int


def dims(cfg) -> Dims:
    m = cfg.mamba2
    h = m.expand * cfg.d_model // m.headdim if m.nheads is None else m.nheads
    d_inner = h * m.headdim
    return Dims(cfg.d_model, d_inner, h, m.headdim, m.ngroups, m.d_state, m.d_conv,
                d_inner + 2 * m.ngroups * m.d_state)


class MambaCache(NamedTuple):
    """One Mamba layer's decoding state.

    conv_state [b, e, k]: the last k conv inputs, newest last (mamba_ssm's layout);
    ssm_state [b, h, p, n] float32, or as generate is asked to store it: bfloat16, or int8
    with a float32 scale per headdim channel (an Int8State, pallas_kernels.ssd.step);
    sync: None, or the int32 [1] counter of the cooperative step kernel
    (pallas_kernels.decode.step_out), carried from token to token by a "fused" decode.
    """

    conv_state: jax.Array
    ssm_state: jax.Array
    sync: jax.Array | None = None


class StepWeights(NamedTuple):
    """A Mamba layer's matmul weights as a decoding step reads them.

    in_proj: `Mamba2Mixer.in_proj()` with w in the compute dtype, [d, N] for `step` and
    transposed to [N, d] for `fused_step` (its kernel reads contiguous rows); conv: the conv
    weight [e, k] and bias [e] or None over the fused x, B, C channels, float32; out_proj
    [d, h*p] in the compute dtype, transposed (see out_proj_partial); A [h] = -exp(A_log),
    float32."""

    in_proj: tuple
    conv: tuple
    out_proj: jax.Array
    A: jax.Array


_KEYS = {"in_proj.weight": Linear("z_proj", "x_proj", "B_proj", "C_proj", "dt_proj"),
         "in_proj.bias": Flat("z_bias", "x_bias", "B_bias", "C_bias", "dt_proj_bias"),
         "conv1d.weight": Conv("x_conv", "B_conv", "C_conv"),
         "conv1d.bias": Flat("x_conv_bias", "B_conv_bias", "C_conv_bias"),
         "dt_bias": Flat("dt_bias"), "A_log": Flat("A_log"), "D": Flat("D"),
         "norm.weight": Flat("norm"),
         "out_proj.weight": Linear("out_proj", inputs=2), "out_proj.bias": Flat("out_bias")}


def _conv_x_B_C(xBC, w, bias, doc, *, length, **shapes):
    """The causal conv and SiLU over xBC [b, width + length, e] (what precedes this device's
    first token first: Mamba2Mixer._conv_operands) with w [k, e], bias [e] or None and doc
    [b, width + length] (document ids) or None -> x, B, C of its last `length` outputs
    (`_shaped`, with `shapes` its options), each written by the conv on its own."""
    return _shaped(*causal_conv1d(xBC, w, bias, doc, length=length, parts=_parts(**shapes)),
                   **shapes)


def _parts(*, x_shape, B_shape, **_):
    """The sizes of the conv's channels x, B and C."""
    return math.prod(x_shape), math.prod(B_shape), math.prod(B_shape)


def _shaped(x, B, C, *, x_shape, B_shape, heads, ngroups, ctx):
    """The conv's x [..., h*p], B, C [..., g*n] -> x [..., *x_shape], B, C [..., *B_shape]:
    this rank's heads and the groups they read (every group on every rank where tp does not
    divide them)."""
    x = x.reshape(*x.shape[:-1], *x_shape)
    B, C = (t.reshape(*t.shape[:-1], *B_shape) for t in (B, C))
    if ngroups % ctx.tp:
        B, C = (groups_of_local_heads(t, heads, ngroups, ctx) for t in (B, C))
    return x, B, C


class Mamba2Mixer(Mixer):
    """The Mamba2 mixer. Parameters are float32; `dtype` is the compute dtype of the matmuls,
    the conv and the SSD operands; dt, A, D and the SSM state stay float32."""

    symbol = "M"
    name = "mamba2"
    Config = Mamba2Section
    # HF Mamba2ForCausalLM, mamba_ssm and NemotronH name a Mamba2 layer's tensors alike;
    # Megatron-LM too, under the layer's `mixer.` (its layer norm fused into in_proj:
    # mamba_jax.megatron).
    checkpoint_keys = {"hf": _KEYS, "mamba_ssm": _KEYS, "nemotron_h": _KEYS,
                       "megatron": {"mixer." + key: entry for key, entry in _KEYS.items()}}
    step_kernels = ("kernel", "fused")
    takes_initial_state = True

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, _, h, p, g, n, _, _ = dims(cfg)
        m = cfg.mamba2
        self.cfg = cfg
        self.dtype = dtype
        # nn.Linear's default init, U(+-1/sqrt(fan_in)); biases zero (mamba_ssm _init_weights).
        in_bound = 1.0 / math.sqrt(d)
        self.z_proj = param(uniform(rngs, (d, h, p), in_bound), "embed", "heads", "head_dim")
        self.x_proj = param(uniform(rngs, (d, h, p), in_bound), "embed", "heads", "head_dim")
        self.B_proj = param(uniform(rngs, (d, g, n), in_bound), "embed", "groups", "state")
        self.C_proj = param(uniform(rngs, (d, g, n), in_bound), "embed", "groups", "state")
        self.dt_proj = param(uniform(rngs, (d, h), in_bound), "embed", "heads")
        # Biases, dt, A, D and the norm train without weight decay, as in mamba_ssm.
        undecayed = functools.partial(param, decay=False)
        if m.bias:
            zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
            self.z_bias = undecayed(zeros(h, p), "heads", "head_dim")
            self.x_bias = undecayed(zeros(h, p), "heads", "head_dim")
            self.B_bias = undecayed(zeros(g, n), "groups", "state")
            self.C_bias = undecayed(zeros(g, n), "groups", "state")
            self.dt_proj_bias = undecayed(zeros(h), "heads")
            self.out_bias = undecayed(zeros(d), "embed")
        self._init_conv(rngs)
        self._init_ssm(rngs)
        if m.learnable_init_state:
            self.init_states = undecayed(jnp.zeros((h, p, n), jnp.float32), "heads",
                                         "head_dim", "state")
        self.norm = undecayed(jnp.ones((h, p), jnp.float32), "heads", "head_dim")
        # Rescaled by 1/sqrt(residual layers) (mamba_ssm's rescale_prenorm_residual: n_layer
        # without MLPs, 2*n_layer with them).
        self.out_proj = param(uniform(rngs, (h, p, d), 1.0 / math.sqrt(h * p))
                              / math.sqrt(len(cfg.layers)), "heads", "head_dim", "embed")

    def _init_ssm(self, rngs: nnx.Rngs, suffix: str = ""):
        """dt_bias{suffix}, A_log{suffix} [h] and D{suffix} [h] (or [h, p] with D_has_hdim),
        as mamba_ssm initialises them: dt log-uniform in [dt_min, dt_max], floored, stored
        through the inverse softplus; A uniform in A_init_range; D ones. Trained without
        weight decay."""
        m, (_, _, h, p, *_) = self.cfg.mamba2, dims(self.cfg)
        dt_bias = dt_bias_init(rngs, h, m)
        A = jax.random.uniform(rngs.params(), (h,), jnp.float32, *m.A_init_range)
        for name, value in (("dt_bias", dt_bias), ("A_log", jnp.log(A))):
            setattr(self, name + suffix, param(value, "heads", decay=False))
        D_axes = ("heads", "head_dim") if m.D_has_hdim else ("heads",)
        setattr(self, "D" + suffix, param(jnp.ones((h, p)[:len(D_axes)], jnp.float32), *D_axes,
                                          decay=False))

    def _init_conv(self, rngs: nnx.Rngs, suffix: str = ""):
        """The conv's parameters x_conv{suffix}, B_conv{suffix}, C_conv{suffix} [k, ...] and
        their biases, with nn.Conv1d's default init (fan_in = d_conv for a depthwise conv)."""
        _, _, h, p, g, n, k, _ = dims(self.cfg)
        bound = 1.0 / math.sqrt(k)
        shapes = {"x": ((h, p), ("heads", "head_dim")), "B": ((g, n), ("groups", "state")),
                  "C": ((g, n), ("groups", "state"))}
        for role, (shape, axes) in shapes.items():
            setattr(self, f"{role}_conv{suffix}",
                    param(uniform(rngs, (k, *shape), bound), "conv", *axes))
        if self.cfg.mamba2.conv_bias:
            for role, (shape, axes) in shapes.items():
                setattr(self, f"{role}_conv_bias{suffix}",
                        param(uniform(rngs, shape, bound), *axes, decay=False))

    # ------------------------------------------------------------ the forward

    def __call__(self, u, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None, initial_state: MambaCache | None = None):
        """Mixer.__call__: u [b, l, d] -> (this rank's share of out_proj [b, l, d] float32,
        a MambaCache or None). seq_idx [b, l]: packed documents; the conv and the SSM state
        restart where it changes. initial_state: the MambaCache the sequence continues
        from (its conv window and SSM state, both differentiable; either may be None: zeros,
        or for the SSM state the learned one), entering the row's first document.

        Where its kernels run (`mixer_kernels_run`), the mixer after the in-projection is
        one custom_vjp on them, pallas_kernels.mamba2_mixer; elsewhere the composed form
        below, its reference."""
        before = self.window_before(initial_state)
        entering = self.entering_state(u.shape[0], initial_state)
        shapes = self._mixer_shapes(ctx)
        width = self.cfg.mamba2.d_conv - 1
        if self.mixer_kernels_run(u, shapes):
            zxbcdt = self.project_packed(u, ctx=ctx)
            xBC = zxbcdt[..., shapes.xBC_start:shapes.dt_start]
            # the conv's inputs before the first token, read by its kernel in place of zeros
            halo = ctx.previous_tokens(xBC, width, before)
            seq = self._seq_with_previous(seq_idx, ctx, before)
            out, ssm_state = mamba2_mixer(
                zxbcdt, *self._conv_params(), self.dt_bias[...], self.A_log[...], self.D[...],
                self.norm[...], self.out_proj[...], entering, halo, seq,
                self._head_groups(ctx), shapes)
            # Mixer.__call__'s float32; Block._delta rounds it back to the compute dtype, a
            # pair of converts that XLA removes
            out = out.astype(jnp.float32)
            # the cache's window reads the last inputs, with those before the first token
            xBC = xBC if halo is None else jnp.concatenate([halo, xBC], axis=1)
            doc = None if seq is None else document_ids(seq)
        else:
            z, xBC_in, dt = self.project(u, ctx=ctx)
            operands = self._conv_operands(xBC_in, seq_idx, ctx, before)
            y, ssm_state = self.conv_and_scan(operands, dt, seq_idx, ctx, entering)
            out = self.gated_out_proj(y, z, ctx)
            xBC, _, _, doc = operands
        if cache_len is None:
            return out, None
        return out, MambaCache(self.final_window(xBC, doc, ctx), ctx.from_last_cp(ssm_state))

    def mixer_kernels_run(self, u, shapes: MixerShapes) -> bool:
        """Whether the mixer runs as pallas_kernels.mamba2_mixer: where the conv's and the
        SSD's kernels each run, and the gated norm's where each rank holds whole groups
        ("auto"'s choices, which log a fallback on a GPU they were measured on). On any
        mesh, and continued from a conv window. shapes: this rank's (`_mixer_shapes`)."""
        m = self.cfg.mamba2
        b, l = u.shape[:2]
        s, e = shapes, sum(shapes.parts)
        like = lambda *shape: jax.ShapeDtypeStruct(shape, self.dtype)
        return (ssd_kernels.kernels_are_faster(like(b, l, s.h, s.p), like(b, l, s.g, s.n))
                and conv_kernels.kernels_run(like(b, l, e), like(m.d_conv, e), m.d_conv - 1, l,
                                             s.parts)
                and (s.norm_axis is not None
                     or norm_kernels.kernels_run(like(b, l, s.h, s.p), s.norm_groups)))

    def _head_groups(self, ctx: ParallelContext):
        """The groups this rank's heads read (common.local_head_groups) where tp does not
        divide the groups, else None."""
        m = self.cfg.mamba2
        return None if m.ngroups % ctx.tp == 0 else local_head_groups(dims(self.cfg).h,
                                                                       m.ngroups, ctx)

    def _mixer_shapes(self, ctx: ParallelContext) -> MixerShapes:
        """pallas_kernels.mamba2_mixer's sizes of this rank's heads and groups, and whether
        its out-projection runs in FP8 (ctx.fp8)."""
        m = self.cfg.mamba2
        h, p = self.x_conv.shape[1:]
        g, n = self.B_conv.shape[1:]
        # Where tp splits the norm's groups, they span the ranks (gated_rms_norm)
        spanning = dict(norm_groups=m.ngroups // ctx.tp) if m.ngroups % ctx.tp == 0 else dict(
            norm_groups=m.ngroups, norm_axis=ctx.axis_names.tp, norm_ranks=ctx.tp)
        # The block rounds the output to the compute dtype after the bias (Block._delta):
        # without a bias, the matmul may round it.
        return MixerShapes(h=h, p=p, g=g, n=n, chunk_size=m.chunk_size, dt_limit=m.dt_limit,
                           eps=self.cfg.norm_eps, dtype=jnp.dtype(self.dtype).name,
                           out_dtype="float32" if m.bias else jnp.dtype(self.dtype).name,
                           sequence_axis=ctx.sequence_axis,
                           fp8=ctx.scale_axes() if ctx.fp8 else None, **spanning)

    def window_before(self, initial_state: MambaCache | None):
        """The conv inputs before the first token [b, k - 1, e] from a cache's window (its
        last k - 1 inputs), or None."""
        if initial_state is None or initial_state.conv_state is None:
            return None
        return jnp.swapaxes(initial_state.conv_state, 1, 2)[:, 1:]

    def entering_state(self, batch_size: int, initial_state: MambaCache | None):
        """The SSM state [b, h, p, n] float32 entering the scan: the given one, else the
        learned one (learnable_init_state), else None (zeros)."""
        if initial_state is not None and initial_state.ssm_state is not None:
            return initial_state.ssm_state
        if self.cfg.mamba2.learnable_init_state:
            return jnp.broadcast_to(self.init_states[...], (batch_size, *self.init_states.shape))
        return None

    def final_window(self, xBC_ext, doc, ctx: ParallelContext):
        """The conv window after the last token [b, e, k] (MambaCache.conv_state) from the
        conv's input and document ids (`_conv_operands`: what precedes the first token in
        front): the last k inputs of the whole sequence (on every cp device). Zeros stand
        before the first token and in place of inputs of an earlier document (e.g. left
        padding), which the next token's conv must not read (`conv_window`)."""
        return ctx.from_last_cp(conv_window(xBC_ext, doc, self.cfg.mamba2.d_conv))

    def _seq_with_previous(self, seq_idx, ctx: ParallelContext, before):
        """seq_idx [b, l] with the ids of the conv's inputs before the first token in front
        ([b, d_conv - 1 + l], as ctx.with_previous_tokens puts those inputs): the previous
        cp device's, and a continued window's in the first token's document; seq_idx itself
        where nothing stands before it, None without it."""
        if seq_idx is None:
            return None
        seq_before = None if before is None else jnp.broadcast_to(
            seq_idx[:, :1], (seq_idx.shape[0], before.shape[1]))
        return ctx.with_previous_tokens(seq_idx, self.cfg.mamba2.d_conv - 1, seq_before)

    def output_bias(self):
        return self.out_bias[...] if self.cfg.mamba2.bias else None

    def in_proj(self):
        """The five input projections side by side, in mamba_ssm's in_proj order: w [d, h*p
        (z) + e (x, B, C) + h (dt)] and bias [same] or None, in the weights' dtype."""
        roles = (self.z_proj, self.x_proj, self.B_proj, self.C_proj, self.dt_proj)
        w = jnp.concatenate([r[...].reshape(r.shape[0], -1) for r in roles], axis=1)
        if not self.cfg.mamba2.bias:
            return w, None
        biases = (self.z_bias, self.x_bias, self.B_bias, self.C_bias, self.dt_proj_bias)
        return w, jnp.concatenate([b[...].reshape(-1) for b in biases])

    def project(self, u, in_proj=None, ctx: ParallelContext = SINGLE_DEVICE):
        """u [..., d] -> z [..., h, p] and xBC [..., e] (the conv's channels x, B, C) in the
        compute dtype, dt [..., h] float32 (before dt_bias and softplus): project_packed's
        output split (its gradient one concatenation: split_last)."""
        zxbcdt = self.project_packed(u, in_proj, ctx)
        z_size, dt_size = math.prod(self.z_proj.shape[1:]), self.dt_proj.shape[1]
        z, xBC, dt = split_last(zxbcdt, (z_size, zxbcdt.shape[-1] - z_size - dt_size, dt_size))
        return z.reshape(*z.shape[:-1], *self.z_proj.shape[1:]), xBC, dt.astype(jnp.float32)

    def project_packed(self, u, in_proj=None, ctx: ParallelContext = SINGLE_DEVICE):
        """u [..., d] -> zxbcdt [..., h*p + e + h] in the compute dtype, mamba_ssm's in_proj
        output order z, xBC, dt (the decoding step's kernels read xBC and dt from it in
        place).

        One matmul over `in_proj()` (or the given one, StepWeights.in_proj): u is read once
        and the backward pass runs one matmul for du instead of five and their sum. dt
        leaves it in the compute dtype, as from mamba_ssm's in_proj."""
        w, bias = self.in_proj() if in_proj is None else in_proj
        return dense(u, w, self.dtype, bias, out_dtype=self.dtype, ctx=ctx)

    def _conv_params(self, suffix: str = ""):
        """The conv weight [k, e] and bias [e] (or None) over the fused xBC channels, of the
        parameters x_conv{suffix}, B_conv{suffix}, C_conv{suffix} and their biases."""
        k = self.cfg.mamba2.d_conv
        get = lambda name: getattr(self, name + suffix)[...]
        w = jnp.concatenate([get(c).reshape(k, -1) for c in ("x_conv", "B_conv", "C_conv")],
                            axis=-1)
        if not self.cfg.mamba2.conv_bias:
            return w, None
        return w, jnp.concatenate([get(b).reshape(-1) for b in
                                   ("x_conv_bias", "B_conv_bias", "C_conv_bias")])

    def conv_and_scan(self, operands, dt, seq_idx=None, ctx: ParallelContext = SINGLE_DEVICE,
                      initial_state=None):
        """The causal conv and SiLU over the conv's operands (`_conv_operands`: xBC [b, l,
        e] with what precedes it, the weights, the document ids), then the SSD with D skip
        over its x [b, l, h, p], B, C [b, l, g, n] and dt [b, l, h] (before bias and
        softplus), entered by initial_state [b, h, p, n] (or zeros) -> (y [b, l, h, p],
        final state [b, h, p, n] float32: this device's, under cp).

        The conv runs inside the scan's custom_vjp where the kernels run
        (pallas_kernels.ssd's `inputs`): the backward pass recomputes x, B, C from xBC, which
        out of the three it keeps, as mamba_ssm's fused path does. Under cp the scan carries
        the state across the devices. Under tp, a rank whose heads share groups that tp does
        not divide takes the groups its heads read."""
        m = self.cfg.mamba2
        conv = functools.partial(_conv_x_B_C, length=dt.shape[1], **self._split_options(ctx))
        return ssd(None, dt, -jnp.exp(self.A_log[...]), None, None, chunk_size=m.chunk_size,
                   D=self.D[...], dt_bias=self.dt_bias[...], dt_softplus=True,
                   dt_limit=m.dt_limit, initial_state=initial_state, seq_idx=seq_idx,
                   return_final_state=True, sequence_axis=ctx.sequence_axis,
                   inputs=(conv, operands))

    def _conv_operands(self, xBC, seq_idx, ctx: ParallelContext, before):
        """(the conv's input with what precedes the first token, w [k, e], bias [e] or None,
        its document ids or None). Under cp the first d_conv - 1 outputs read the previous
        device's last inputs, with their seq_idx, so that no tap reads across a document
        start; before [b, d_conv - 1, e]: the inputs before the first token
        (window_before), else zeros."""
        w, bias = self._conv_params()
        seq = self._seq_with_previous(seq_idx, ctx, before)
        doc = None if seq is None else document_ids(seq)
        return ctx.with_previous_tokens(xBC, self.cfg.mamba2.d_conv - 1, before), w, bias, doc

    def split_conv_output(self, out, ctx: ParallelContext = SINGLE_DEVICE):
        """The conv's output [..., e] -> x [..., h, p], B, C [..., g, n] (`_shaped`)."""
        shapes = self._split_options(ctx)
        return _shaped(*split_last(out, _parts(**shapes)), **shapes)

    def _split_options(self, ctx: ParallelContext) -> dict:
        """_shaped's options for this layer's (this rank's) conv weights."""
        return dict(x_shape=self.x_conv.shape[1:], B_shape=self.B_conv.shape[1:],
                    heads=dims(self.cfg).h, ngroups=self.cfg.mamba2.ngroups, ctx=ctx)

    def gated_out_proj(self, y, z, ctx: ParallelContext = SINGLE_DEVICE):
        """The gated norm and out_proj: y, z [b, l, h, p] -> [b, l, d] float32 (this rank's
        share). Checkpointed so that the backward pass recomputes the norm's output from y
        and z, which it keeps anyway, rather than keep it for out_proj's weight gradient:
        16.8 of the 145 MB a mamba2-1.3b layer kept per 2048-token row, as mamba_ssm's fused
        path recomputes it."""
        m = self.cfg.mamba2

        @jax.checkpoint
        def norm_and_project(y, z, norm, out_proj):
            normed = gated_rms_norm(y, z, norm, self.cfg.norm_eps, m.ngroups, ctx)
            return matmul("...hp,hpd->...d", normed, out_proj, self.dtype, ctx=ctx)
        return norm_and_project(y, z, self.norm[...], self.out_proj[...])

    def out_proj_partial(self, y, out_proj):
        """One decoding step's out_proj: y [..., h, p] (normed) -> [..., d] float32, without
        the bias (this rank's share), through out_proj [d, h*p] (StepWeights.out_proj)."""
        # XLA rewrites a matrix-vector product as a product and a sum, which against
        # [h, p, d] it ran as an elementwise product [h*p, d] written out in float32 and
        # summed over columns, several times the weight's bytes (bench/profile_step.py). Against
        # [d, h*p] the sum runs over each contiguous row.
        return matmul("...e,de->...d", y.reshape(*y.shape[:-2], -1), out_proj, self.dtype)

    # ------------------------------------------------------------ decoding

    def init_cache(self, batch_size: int, cache_len: int = 0) -> MambaCache:
        _, _, h, p, _, n, k, e = dims(self.cfg)
        ssm_state = self.entering_state(batch_size, None)
        return MambaCache(jnp.zeros((batch_size, e, k), self.dtype),
                          jnp.zeros((batch_size, h, p, n), jnp.float32) if ssm_state is None
                          else ssm_state)

    def cache_for_decoding(self, cache: MambaCache, how: str, ssm_state_dtype: str):
        """The SSM state stored in ssm_state_dtype ("int8": an Int8State); a "fused" step's
        cooperative kernel gets its counter (zeros)."""
        sync = jnp.zeros((1,), jnp.int32) if how == "fused" else None
        return cache._replace(ssm_state=state_in(cache.ssm_state, ssm_state_dtype), sync=sync)

    def step_weights(self, how: str = "xla") -> StepWeights:
        """The StepWeights of the current parameters (build them outside the decode loop),
        for `fused_step` if how is "fused", else for `step`."""
        w, bias = self.in_proj()
        w = w.T if how == "fused" else w
        out = self.out_proj[...]
        conv_w, conv_b = self._conv_params()
        return StepWeights((w.astype(self.dtype), bias), (conv_w.T, conv_b),
                           out.reshape(-1, out.shape[-1]).T.astype(self.dtype),
                           -jnp.exp(self.A_log[...]))

    def step(self, u, cache: MambaCache, weights: StepWeights, how="xla"):
        """One token: u [b, d] -> (out_proj's output [b, d] float32 before its bias, the
        updated MambaCache).

        weights: `step_weights()`, built before the decode loop. The new SSM state is
        computed in float32 and stored as the cache's is (float32; bfloat16 as mamba_ssm's
        decoding cache of a bf16 model; or int8, quantised afresh). how: the conv and SSM
        update as XLA fusions ("xla") or as one Pallas kernel, pallas_kernels.ssd.step, which
        also gates y for the norm whose rstd then scales out_proj's product ("kernel",
        gated_out_proj_step)."""
        zxbcdt = self.project_packed(u, weights.in_proj)
        m = self.cfg.mamba2
        # The window's shift, the conv and the SSM update, xBC and dt read from zxbcdt
        step = functools.partial(mamba_step, cache.conv_state, zxbcdt, *weights.conv,
                                 weights.A, self.D[...], self.dt_bias[...], cache.ssm_state,
                                 dt_limit=m.dt_limit, y_dtype=self.dtype)
        if how == "kernel":
            # The kernel gates y and multiplies it by the norm's weight; the norm's rstd,
            # from the squares it sums, multiplies out_proj's product: no kernel of its own
            # reduces y and none normalises it.
            gated, conv_state, ssm_state = step(implementation="triton",
                                                norm_weight=self.norm[...].reshape(-1))
            out = self.gated_out_proj_step(gated, weights.out_proj)
        else:
            y, conv_state, ssm_state = step(implementation="xla")
            z = zxbcdt[:, :y.shape[1] * y.shape[2]].reshape(y.shape)  # its first h*p columns
            # XLA fuses the norm with z's slice and the out-projection's input
            y = gated_rms_norm(y, z, self.norm[...], self.cfg.norm_eps, m.ngroups,
                               implementation="xla")
            out = self.out_proj_partial(y, weights.out_proj)
        return out, MambaCache(conv_state, ssm_state, cache.sync)

    def gated_out_proj_step(self, gated: Gated, out_proj):
        """The gated norm's rstd applied after out_proj: gated (mamba_step's Gated: y * silu(z)
        times the norm's weight [b, h*p], its squares summed per head [b, h]) -> [b, d]
        float32, out_proj's output before its bias, as out_proj_partial of the normed y.

        Each of the norm's ngroups groups of heads has one rstd a row, a factor of its
        columns' share of the product: with one group, the product's rows scaled; with more,
        each group's product scaled before they are summed."""
        g = self.cfg.mamba2.ngroups
        b, e = gated.y.shape
        rstd = jax.lax.rsqrt(gated.sum_sq.reshape(b, g, -1).sum(-1) / (e // g)
                             + self.cfg.norm_eps)  # [b, g]
        if g == 1:
            return matmul("be,de->bd", gated.y, out_proj, self.dtype) * rstd
        parts = matmul("bgk,dgk->bgd", gated.y.reshape(b, g, -1),
                       out_proj.reshape(out_proj.shape[0], g, -1), self.dtype)
        return jnp.sum(parts * rstd[..., None], axis=1)

    def fused_step(self, residual, norm_weight, norm_eps, cache: MambaCache,
                   weights: StepWeights):
        """A whole Mamba block for one token in two or three Pallas kernels: residual [b, d]
        -> (residual + mixer(rms_norm(residual)), the updated MambaCache).

        The block's RMSNorm (norm_weight [d], norm_eps) with the input projection, which also
        shifts the conv window in place, as one pallas_kernels.decode.norm_matmul kernel;
        then pallas_kernels.decode.step_out: the conv, the SSM update and the gate, which
        read dt and z from the projection's output in place, then the gated norm with
        out_proj and the residual add. With the cache's sync counter (cache_for_decoding
        gives one) that is one cooperative kernel on a GPU that holds its programs at once,
        else two. The arithmetic of Block.step over `step` (but for where the norms'
        operands are rounded: pallas_kernels.decode.norm_matmul) in a third of its kernels
        or fewer, for a decoding step at small batch, which is bound by its kernel count
        (BENCHMARKS.md). weights: step_weights("fused"). The SSM state float32 or bfloat16:
        the decode plan runs an int8 one's step as "kernel"."""
        w, bias = weights.in_proj
        # [b, h*p (z) + e (xBC) + h (dt)] in the compute dtype, as project's
        zxbcdt, conv_state = rms_norm_matmul(
            residual, norm_weight, w, eps=norm_eps, bias=bias, w_transposed=True,
            window=(cache.conv_state, dims(self.cfg).d_inner), implementation="triton")
        # The step and the gate, then the gated norm, out_proj and the residual add
        m = self.cfg.mamba2
        residual, ssm_state, sync = mamba_step_out(
            conv_state, zxbcdt, *weights.conv, weights.A, self.D[...], self.dt_bias[...],
            cache.ssm_state, residual, self.norm[...].reshape(-1), weights.out_proj,
            eps=self.cfg.norm_eps, ngroups=m.ngroups, bias=self.output_bias(),
            sync=cache.sync, dt_limit=m.dt_limit, y_dtype=self.dtype, implementation="triton")
        return residual, MambaCache(conv_state, ssm_state, sync)

    # ------------------------------------------------------------ the kind

    @classmethod
    def check_fit(cls, cfg):
        check_heads(cfg, "mamba2")

    @classmethod
    def check_section(cls, cfg):
        check_dt_section(cfg, "mamba2", ("d_state", "d_conv", "expand", "headdim", "ngroups",
                                         "chunk_size"))
        m = cfg.mamba2
        if m.nheads is not None and (not isinstance(m.nheads, int)
                                     or isinstance(m.nheads, bool) or m.nheads <= 0):
            raise ValueError(f"Mamba2Config.mamba2.nheads={m.nheads!r} must be a positive "
                             "integer, or None for expand * d_model / headdim")
        if len(m.dt_limit) != 2 or not 0.0 <= m.dt_limit[0] < m.dt_limit[1]:
            raise ValueError(f"Mamba2Config.mamba2.dt_limit={m.dt_limit} must be (lo, hi) "
                             "with 0 <= lo < hi; (0.0, inf) means no limit")
        if len(m.A_init_range) != 2 or not 0.0 < m.A_init_range[0] <= m.A_init_range[1] \
                or not math.isfinite(m.A_init_range[1]):
            raise ValueError(f"Mamba2Config.mamba2.A_init_range={m.A_init_range} must be "
                             "(lo, hi) with 0 < lo <= hi < inf")

    @classmethod
    def kernels_support(cls, cfg) -> bool:
        m = cfg.mamba2
        return step_supports(m.headdim, m.d_state, m.d_conv)

    @classmethod
    def flops_per_token(cls, cfg, seq_len: int) -> float:
        """in_proj (z, x, B, C, dt) and out_proj; the SSD's chunked matmuls at chunk q: C B^T
        per group and its product with x inside each chunk, the chunk states and their
        read-out through C."""
        d, _, h, p, g, n, _, _ = dims(cfg)
        q = min(cfg.mamba2.chunk_size, seq_len)
        return (2 * d * (2 * h * p + 2 * g * n + h) + 2 * h * p * d + 2 * q * (g * n + h * p)
                + 4 * h * p * n)
