"""Building blocks the layer kinds share: the compute-dtype matmul, parameters with logical
axes, RMSNorm, the gated per-group RMSNorm, the conv's decoding window, and `Mixer`, the
interface every layer kind implements (the short conv itself: pallas_kernels.conv).

Legend: b batch, l sequence, d model width, k conv width, h heads, p head dim, g groups,
"..." channel axes (e.g. h p).
Norms compute in float32 and return the input's dtype, as mamba_ssm's Triton norms do.
The norms are rematerialised (jax.checkpoint; the gated norm's kernels keep only their
inputs, as do the conv's): the backward pass recomputes their cheap elementwise float32
intermediates from the inputs instead of keeping them, as mamba_ssm's fused kernels do
(kept, they were about 250 KB per token per 1.3b layer).
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_jax.sharding import SINGLE_DEVICE, ParallelContext
from pallas_kernels import fp8
from pallas_kernels import norm as norm_kernels
from pallas_kernels.ssd.reference import take_groups


def matmul(spec, a, b, dtype, out_dtype=jnp.float32, ctx: ParallelContext = SINGLE_DEVICE):
    """jnp.einsum(spec, a, b) with both operands cast to the compute dtype, float32
    accumulation and an out_dtype result, for every weight matmul of the model (b the
    weight). A result that is cast to the compute dtype anyway is asked for in it
    (out_dtype=dtype): the matmul writes half the bytes, as torch's autocast Linear does.
    spec: two operands, e.g. "...d,df->...f".

    Its derivative runs in the compute dtype, as torch's autocast backward does
    (`_compute_matmul`). Where ctx.fp8 (a training layer's projections under --fp8), an
    FP8 matmul instead (pallas_kernels.fp8: E4M3 operands, the backward's gradient E5M2,
    per-tensor current scales reduced over ctx.scale_axes()), its backward in dtype too."""
    if ctx.fp8:
        return fp8.matmul(spec, a, b, dtype, out_dtype, ctx.scale_axes())
    return _compute_matmul(spec, a, b, dtype, out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 3, 4))
def _compute_matmul(spec, a, b, dtype, out_dtype):
    """matmul in the compute dtype. Its custom JVP takes the tangent matmuls in dtype, so the
    transposed (backward) matmuls take the cotangent in dtype. Differentiated as is, each
    backward matmul would mix a float32 cotangent with a bf16 operand, which XLA runs as a
    float32 (TF32) matmul, much slower (a large share of the 1.3b train step's time,
    bench/profile_step.py). The weight's gradient is rounded to dtype before it is widened
    to b's dtype, as before the cast. A JVP rather than a VJP keeps the matmuls visible to
    jax.checkpoint policies (a custom_vjp's residuals are saved whatever the policy)."""
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)


@_compute_matmul.defjvp
def _compute_matmul_jvp(spec, dtype, out_dtype, primals, tangents):
    (a, b), (ta, tb) = primals, tangents
    a_c, b_c = a.astype(dtype), b.astype(dtype)
    y = jnp.einsum(spec, a_c, b_c, preferred_element_type=out_dtype)
    t = (jnp.einsum(spec, ta.astype(dtype), b_c, preferred_element_type=dtype)
         + jnp.einsum(spec, a_c, tb.astype(dtype), preferred_element_type=dtype))
    return y, t.astype(out_dtype)


def dense(u, w, dtype, bias=None, out_dtype=jnp.float32, ctx: ParallelContext = SINGLE_DEVICE):
    """u [..., d] times w [d, ...] -> [..., ...] out_dtype (plus bias [...]): the
    projections' matmul (see matmul; ctx.fp8: as FP8). Over a tensor-parallel shard of w's
    output axes, this rank's outputs; over a shard of d (a row-parallel input), this rank's
    share of the sum."""
    y = matmul("...d,df->...f", u, w.reshape(w.shape[0], -1), dtype, out_dtype, ctx)
    y = y.reshape(*u.shape[:-1], *w.shape[1:])
    return y if bias is None else y + bias.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_last(a, sizes):
    """a [..., sum(sizes)] -> its consecutive parts [..., size] along the last axis, as
    jnp.split, with the parts' cotangents concatenated once. Left to XLA, that concatenation
    was made once for each backward matmul of the in-projection that reads it: two copies of
    the projection's width a layer (a few percent of a mamba2-1.3b training step,
    bench/profile_step.py). An optimization barrier keeps one."""
    return tuple(jnp.split(a, list(itertools.accumulate(sizes[:-1])), axis=-1))


def _split_last_fwd(a, sizes):
    return split_last(a, sizes), None


def _split_last_bwd(sizes, _, cotangents):
    return (jax.lax.optimization_barrier(jnp.concatenate(cotangents, axis=-1)),)


split_last.defvjp(_split_last_fwd, _split_last_bwd)


def uniform(rngs: nnx.Rngs, shape, bound):
    """A float32 value drawn from U(-bound, bound): torch nn.Linear's and nn.Conv1d's default
    init with bound 1/sqrt(fan_in)."""
    return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound)


def dt_bias_init(rngs: nnx.Rngs, size: int, section) -> jax.Array:
    """mamba_ssm's dt bias [size] float32: dt log-uniform in [section.dt_min,
    section.dt_max], floored at section.dt_init_floor, stored through the inverse softplus
    (so that softplus(bias) is dt)."""
    log_dt = jax.random.uniform(rngs.params(), (size,), jnp.float32,
                                math.log(section.dt_min), math.log(section.dt_max))
    dt = jnp.maximum(jnp.exp(log_dt), section.dt_init_floor)
    return dt + jnp.log(-jnp.expm1(-dt))


def param(value, *axes: str, decay: bool = True) -> nnx.Param:
    """A parameter with one logical axis name per axis of value, which
    mamba_jax.sharding.RULES places on the mesh (e.g. param(w, "embed", "heads", "head_dim")).
    decay=False: trained without weight decay (mamba_jax.optim), as mamba_ssm trains A_log,
    D, dt_bias, norms and biases."""
    if len(axes) != value.ndim:
        raise ValueError(f"param: {len(axes)} axis names {axes} for a value of shape "
                         f"{value.shape}")
    return nnx.Param(value, axes=axes, decay=decay)


# x [..., d], weight [d] -> x / rms(x) * weight, in float32, cast back to x.dtype.
rms_norm = norm_kernels.rms_norm_reference


def gated_rms_norm(y, z, weight, eps, ngroups, ctx: ParallelContext = SINGLE_DEVICE,
                   implementation="auto"):
    """mamba_ssm's RMSNormGated(norm_before_gate=False, group_size=d_inner/ngroups): y *
    silu(z) normalised over each of the layer's ngroups groups of heads, times weight.

    y, z [..., h, p] (this tp rank's heads, h of the layer's h*tp), weight [h, p]. Where this
    rank holds whole groups, pallas_kernels.norm with this implementation ("auto": its
    kernels on a Hopper GPU). Where tp splits a group over ranks (ngroups % tp != 0), each
    rank sums the squares of its part of every group and one psum over tp completes them:
    [..., ngroups] floats, not activations.
    """
    tp = ctx.tp
    if ngroups % tp == 0:
        return norm_kernels.gated_rms_norm(y, z, weight, eps, ngroups // tp,
                                           implementation=implementation)
    return norm_kernels.gated_rms_norm_spanning(y, z, weight, eps, ngroups, ctx.axis_names.tp,
                                                tp)


def local_head_groups(heads: int, groups: int, ctx: ParallelContext):
    """The groups this tp rank's heads read, of `groups` kept whole on each rank (tp does not
    divide them), int32: [1] when they all read one, else one per head [heads/tp]. heads:
    the layer's, over all ranks."""
    local, per_group = heads // ctx.tp, heads // groups
    first = ctx.tp_index() * local
    if per_group % local == 0:
        return jnp.full((1,), first // per_group, jnp.int32)
    return ((first + jnp.arange(local)) // per_group).astype(jnp.int32)


def groups_of_local_heads(x, heads: int, groups: int, ctx: ParallelContext):
    """x [b, l, groups, n], every group (kept whole on each tp rank: tp does not divide them)
    -> the groups this rank's heads read (local_head_groups): [b, l, 1, n] when they all read
    one, else one per head, [b, l, heads/tp, n]. Mamba's B and C by group, or attention's
    keys and values by KV head; heads: the layer's, over all ranks."""
    return take_groups(x, local_head_groups(heads, groups, ctx))


def conv_window(inputs, doc, k: int):
    """The causal conv's window after the last token [b, e, k] (a decoding cache's
    conv_state, newest last) from its inputs [b, l, e] and their document ids [b, l] or
    None: the last k inputs, zeros before the first and in place of an earlier document's
    (e.g. left padding), which the next token's conv must not read."""
    if doc is not None:
        inputs = jnp.where((doc == doc[:, -1:])[..., None], inputs, 0)
    window = jnp.pad(inputs, ((0, 0), (max(k - inputs.shape[1], 0), 0), (0, 0)))[:, -k:]
    return jnp.swapaxes(window, 1, 2)


def check_dt_section(cfg, name: str, integers,
                     positive=("dt_min", "dt_max", "dt_init_floor")) -> None:
    """The checks every Mamba section (cfg.<name>) shares, each a ValueError naming the
    field, its value and the fix: `integers` are positive integers, `positive` (the dt
    init's fields) > 0, and dt_min <= dt_max."""
    m = getattr(cfg, name)
    for field in integers:
        value = getattr(m, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"Mamba2Config.{name}.{field}={value!r} must be a positive "
                             "integer")
    for field in positive:
        if not getattr(m, field) > 0:
            raise ValueError(f"Mamba2Config.{name}.{field}={getattr(m, field)!r} must be > 0")
    if m.dt_min > m.dt_max:
        raise ValueError(f"Mamba2Config.{name}.dt_min={m.dt_min} > dt_max={m.dt_max}: "
                         "swap them")


def check_heads(cfg, name: str) -> None:
    """For a section of heads (cfg.<name>: mamba2's or mamba3's): headdim divides d_model *
    expand (unless the section sets nheads) and ngroups the heads."""
    m = getattr(cfg, name)
    nheads = getattr(m, "nheads", None)  # set: the width is nheads * headdim on its own
    d_inner = m.expand * cfg.d_model
    if nheads is None and d_inner % m.headdim:
        divisors = [v for v in range(1, d_inner + 1) if d_inner % v == 0]
        nearby = [v for v in divisors if m.headdim // 2 <= v <= m.headdim * 2]
        raise ValueError(
            f"Mamba2Config: d_model*{name}.expand = {cfg.d_model}*{m.expand} = {d_inner} "
            f"is not divisible by {name}.headdim={m.headdim}; choose headdim among "
            f"{nearby} or change d_model/expand")
    heads = d_inner // m.headdim if nheads is None else nheads
    if heads % m.ngroups:
        divisors = [v for v in range(1, heads + 1) if heads % v == 0]
        raise ValueError(
            f"Mamba2Config: nheads = "
            f"{'d_inner/headdim' if nheads is None else name + '.nheads'} = {heads} is not "
            f"divisible by {name}.ngroups={m.ngroups}; choose ngroups among {divisors}")


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; weight [d] float32, initialised to ones."""

    def __init__(self, d: int, eps: float):
        self.weight = param(jnp.ones((d,), jnp.float32), "embed", decay=False)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)

    def add(self, residual, delta):
        """The residual stream's add and this norm in one pass (mamba_ssm's fused_add_norm):
        residual, delta [..., d] -> (residual + delta in residual's dtype, its norm in
        delta's dtype); pallas_kernels.norm.add_rms_norm."""
        return norm_kernels.add_rms_norm(residual, delta, self.weight[...], self.eps)


class Mixer(nnx.Module):
    """The interface of a layer kind: the mixer of a pre-norm residual layer (model.Block
    adds its output to the residual stream). mamba_jax.layers.registry maps each
    layer_pattern symbol to one subclass.

    A subclass declares, as class attributes: `symbol` (its layer_pattern symbol), `name`
    (its config section, cfg.<name>), `Config` (that section's frozen dataclass), `reads`
    (the other sections it reads: none, or a kind's whose sizes it shares),
    `checkpoint_keys` (per checkpoint format, its torch tensors as
    mamba_jax.layers.checkpoint_keys entries over its parameters), `step_kernels` (the
    decode step implementations it has beside "xla": "kernel", a kernel between XLA's
    projections, and "fused", the whole layer as fused kernels), `step_kernel_max_batch`
    (the largest batch whose step runs "kernel", XLA's step being faster above it; None:
    any batch), `cache_grows` (its
    cache holds a slot per token, sized by cache_len), `takes_initial_state` (its
    __call__ takes `initial_state=`, a cache the sequence continues from, differentiably:
    the recurrent kinds) and `causal` (False: a token's output reads later tokens, so the
    kind has no cache or step; for encoders). Its parameters declare their
    logical axes (`param`). Parameters are float32; `dtype` is the compute dtype.

    Legend: b batch, l sequence (this device's part under cp), d d_model. Every kind
    implements:

    - `__call__(u, seq_idx=None, *, ctx=SINGLE_DEVICE, cache_len=None)`: u [b, l, d] in the
      compute dtype (every token of this device's part) -> (this tp rank's share of the
      output [b, l, d] float32, before output_bias; the decoding cache after the last token,
      or None when cache_len is None). seq_idx [b, l] or None: packed documents, each mixed
      as if alone. cache_len: slots of a cache that grows with the tokens, at least l. ctx:
      the parallel context (mamba_jax.sharding), whose collectives are the identity on one
      device: the same code runs there and inside the trainer's shard_map.
    - `step_weights(how)`: what the one-token step reads that derives from the parameters,
      in the compute dtype, built once before the decode loop (XLA would rebuild it inside
      the loop at every token).
    - `step(u, cache, weights, how)`: one token, u [b, d] in the compute dtype -> (the output
      [b, d] float32 before output_bias, the updated cache); how: "xla", or "kernel" where
      step_kernels has it.
    - `fused_step(residual, norm_weight, norm_eps, cache, weights)`, where step_kernels has
      "fused": the whole layer for one token as fused kernels, residual [b, d] -> (residual +
      the layer's output for rms_norm(residual) * norm_weight, the updated cache).
    - `flops_per_token(cfg, seq_len)` (a classmethod): forward matmul FLOPs per token, 2 a
      multiply-add, for MFU.
    - `check_section(cfg)` and `check_fit(cfg)` (classmethods): its section's own values
      refused, and how they fit the shared fields; `completed(cfg)` (by default the section
      as given): its section with the fields that default from the shared ones filled in,
      for a config with layers of this kind (Mamba2Config stores it so, before
      check_config).
    """

    symbol: ClassVar[str]
    name: ClassVar[str]
    Config: ClassVar[type]
    reads: ClassVar[tuple[str, ...]] = ()
    checkpoint_keys: ClassVar[dict[str, dict[str, Any]]]
    step_kernels: ClassVar[tuple[str, ...]] = ()
    step_kernel_max_batch: ClassVar[int | None] = None
    cache_grows: ClassVar[bool] = False
    takes_initial_state: ClassVar[bool] = False
    causal: ClassVar[bool] = True
    dtype: Any

    def output_bias(self):
        """[d] or None: added once after the tp ranks' shares are summed."""
        return None

    def init_cache(self, batch_size: int, cache_len: int):
        """An empty decoding cache (None: the layer keeps nothing between tokens)."""
        return None

    @classmethod
    def completed(cls, cfg):
        """cfg's section of this kind with its defaults that depend on the shared fields
        filled in (the class docstring)."""
        return getattr(cfg, cls.name)

    def cache_for_decoding(self, cache, how: str, ssm_state_dtype: str):
        """The prefill's cache as the decode loop carries it: its states stored in
        ssm_state_dtype, and what a step implementation `how` needs added."""
        return cache

    @classmethod
    def check_section(cls, cfg) -> None:
        """Raise a ValueError naming the field, its value and the fix where this kind's
        section is invalid in itself (its fields' values, not how they fit cfg's shared
        fields); Mamba2Config runs it for each section no layer reads (a value set there
        changes nothing, but a wrong one is still refused), check_config for the others."""

    @classmethod
    def check_fit(cls, cfg) -> None:
        """Raise a ValueError naming the fields where this kind's section does not fit
        cfg's shared fields (a width its heads do not divide)."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """check_section and check_fit: Mamba2Config runs it for each kind its layers use."""
        cls.check_section(cfg)
        cls.check_fit(cfg)

    @classmethod
    def kernels_support(cls, cfg) -> bool:
        """Whether this kind's step kernels take cfg's shapes."""
        return True


FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)  # what the parameters are made in


def number_pair(name: str, value) -> tuple[float, float]:
    """A config's (low, high) as a tuple of floats; a ValueError naming it where it is not a
    list or tuple of two numbers (a string of two characters read as two numbers), or a
    finite one lies beyond float32's range (the parameters made from it were inf)."""
    if not (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"Mamba2Config.{name}={value!r} must be two numbers, [low, high]")
    if any(math.isfinite(v) and abs(v) > FLOAT32_MAX for v in value):
        raise ValueError(f"Mamba2Config.{name}={value!r} lies beyond float32's range (at most "
                         f"{FLOAT32_MAX:.4g}), in which the layer's parameters are made")
    return tuple(float(v) for v in value)
