"""Mamba2LM: embedding, pre-norm residual layers, final norm, LM head; its loss, prefill and
one-token step.

Legend: b batch, l sequence, d d_model, v padded vocabulary.

The residual stream follows mamba_ssm's Block(fused_add_norm, prenorm): r = embedding;
r = r + mixer(norm(r)) per layer; logits = lm_head(norm_f(r)); r is float32 when
`residual_in_fp32`, else the compute dtype. As in mamba_ssm, a layer's output is added to
the stream by the next norm (`Stream`, pallas_kernels.norm.add_rms_norm: one pass that reads
both and writes the sum and its norm), not by the layer. A layer's mixer is the registered
kind of its symbol in `cfg.layers` (mamba_jax.layers.registry); every layer keeps the names
`layers.{i}.norm` and `layers.{i}.mixer`, as Megatron and NemotronH name them. mamba_ssm's
Block of mixer + MLP (r += mixer(norm(r)); r += mlp(norm2(r))) is two such layers.

One forward for every mesh: the trainer runs `loss` (or `__call__`) inside `jax.shard_map`
with a ParallelContext (mamba_jax.sharding), where each device holds its shard of the
parameters and of the tokens; on one device the context is SINGLE_DEVICE and every
collective is the identity. Under tensor parallelism the vocabulary is split over tp (the
embedding, the LM head and the cross-entropy: no device holds [b, l, v] logits); under
sequence parallelism the residual stream between layers is [b, l/tp, d].
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from mamba_jax import adapters, layer_scan
from mamba_jax.layers.common import RMSNorm, matmul, param, uniform
from mamba_jax.layers.registry import KINDS
from mamba_jax.sharding import SINGLE_DEVICE, GATHERED, ParallelContext

REMAT = ("none", "block", "full")


def remat_policy(remat: str, fsdp: bool, tokens=None):
    """The jax.checkpoint policy around each layer, or None for no checkpoint.

    "block" keeps the layer's matmul outputs and recomputes the rest (norms, conv, scan)
    in the backward pass; "full" keeps only the layer's input (its Stream: the residual and
    the previous layer's output, 6 bytes an entry with a float32 residual and bf16 compute).
    Gathered FSDP weights are never kept: the backward pass gathers them again, so that a
    device holds one layer's full weights at a time.

    tokens: for a layer that runs on weights derived from its parameters (adapters' merged
    weights, a bfloat16 base widened: mamba_jax.adapters.adapted), the (b, l) leading shapes
    of its token arrays (the residual stream's, and the gathered sequence's under sequence
    parallel). Then only what is computed from an operand of those leading shapes (of ndim
    3 or more) is kept, and what derives from the weights alone is recomputed: kept, each
    layer's merged weights (or their casts, transposes, a kernel's saved copy) would be held
    through the step, a copy of the model. A name (checkpoint_name) does not do it: the
    policy sees each operation, and the named value's producer is kept in its place."""
    if remat not in REMAT:
        raise ValueError(f"--remat {remat!r}: use one of {REMAT}")
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if tokens is not None:
        from_tokens = lambda avals: any(getattr(a, "ndim", 0) >= 3 and a.shape[:2] in tokens
                                        for a in avals)
        if remat == "block":
            return lambda prim, *avals, **params: from_tokens(avals) and \
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)
        return lambda prim, *avals, **params: from_tokens(avals)
    if remat == "block":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.save_anything_except_these_names(GATHERED) if fsdp else None


def cross_entropy(logits, targets, ctx: ParallelContext = SINGLE_DEVICE):
    """logits [..., v] float32 (this tp rank's slice of the vocabulary, [..., v/tp], under
    tp), targets [...] -> per-token -log softmax(logits)[target] [...], from three
    [...]-sized reductions over tp."""
    v_loc = logits.shape[-1]
    # The max only steadies exp; its gradient cancels, so it stays out of the graph.
    top = ctx.pmax_tp(lax.stop_gradient(logits.max(-1)))
    sum_exp = ctx.psum_tp(jnp.exp(logits - top[..., None]).sum(-1))
    local = targets - ctx.tp_index() * v_loc  # outside [0, v_loc): another rank's
    # The target's logit as a masked sum over this rank's vocabulary, not a gather: its
    # gradient is then a select that XLA can fuse with the softmax's, where a gather's is a
    # scatter into a float32 buffer of its own, converted to bf16 in another pass.
    hit = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == local[..., None]
    target_logit = ctx.psum_tp(jnp.where(hit, logits, 0.0).sum(-1))
    return jnp.log(sum_exp) + top - target_logit


def check_tokens(where: str, input_ids, rows: int | None = None, **per_token):
    """Refuse input_ids that are not [b, l] integer ids, and per-token inputs (seq_idx,
    targets, mask; None where not given) not of their shape: shapes are static, so this
    holds under jit too, where the mismatch was a broadcasting error deep in a layer. With
    `rows` (the embedding's), ids outside [0, rows) too, where they are values (check_ids)."""
    if not hasattr(input_ids, "dtype"):  # a list: jnp.result_type's TypeError on it
        raise ValueError(f"{where}: input_ids is a {type(input_ids).__name__}; give an array "
                         "of [batch, seqlen] integer token ids (jnp.asarray(ids, jnp.int32))")
    if jnp.ndim(input_ids) != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"{where}: input_ids of shape {jnp.shape(input_ids)} and dtype "
                         f"{input_ids.dtype}; give [batch, seqlen] integer token ids")
    if jnp.shape(input_ids)[1] == 0:
        raise ValueError(f"{where}: input_ids of shape {jnp.shape(input_ids)} hold no token; "
                         "give at least one a row")
    check_per_token(where, jnp.shape(input_ids), **per_token)
    seq_idx = per_token.get("seq_idx")
    if seq_idx is not None and not jnp.issubdtype(jnp.result_type(seq_idx), jnp.integer):
        raise ValueError(f"{where}: seq_idx of dtype {jnp.result_type(seq_idx)}; give integer "
                         "document ids, one a token")
    if rows is not None:
        check_ids(where, "input_ids", input_ids, rows)


def check_ids(where: str, name: str, ids, rows: int) -> None:
    """Refuse token ids outside [0, rows) where they are values on this host (not under jit):
    the embedding's gather wraps a negative id to another token and makes a row past the
    last NaN, and the loss of a target outside is the logsumexp alone."""
    if isinstance(ids, jax.core.Tracer) or not getattr(ids, "is_fully_addressable", True):
        return
    values = np.asarray(ids)
    outside = values[(values < 0) | (values >= rows)]
    if outside.size:
        raise ValueError(f"{where}: {name} hold {np.unique(outside)[:8].tolist()}, outside the "
                         f"model's token ids [0, {rows})"
                         + ("; there is no ignore index: the loss is per position, so weight "
                            "or drop positions in it" if name == "targets" else ""))


def check_per_token(where: str, shape: tuple, **per_token):
    """Refuse per-token inputs (None where not given) whose shape is not the tokens' [b, l]
    (`shape`)."""
    for name, value in per_token.items():
        if value is not None and jnp.shape(value) != tuple(shape):
            raise ValueError(f"{where}: {name} has shape {jnp.shape(value)}; it takes one value "
                             f"per token, the inputs' [batch, seqlen] = {tuple(shape)}")


def _row_shapes(state, expected) -> tuple[list, list]:
    """The shapes a row of a layer's state holds, and of `expected` (init_cache's, as
    shapes), field by field where both have the field (a MambaCache's may be None: zeros;
    a decoding cache's step counter is not init_cache's): an array's, or an Int8State's
    values' (the state it stores), or a nested field's arrays'."""
    got, want = [], []
    for value, like in zip(state, expected):
        if value is None or like is None:
            continue
        for side, out in ((value, got), (like, want)):
            arrays = [side] if hasattr(side, "shape") else jax.tree.leaves(side)
            out.extend(tuple(a.shape[1:]) for a in arrays)
    return got, want


def _runs(layers):
    """(first, end) of each run of consecutive equal entries of layers: a layer's kind, or
    its (kind, precision)."""
    starts = [i for i in range(len(layers)) if i == 0 or layers[i] != layers[i - 1]]
    return list(zip(starts, starts[1:] + [len(layers)]))


@dataclasses.dataclass(frozen=True)
class Fp8:
    """FP8 training: every layer's projections (each kind's in- and out-projections,
    attention's, the MLP's) as FP8 matmuls (pallas_kernels.fp8: E4M3 weights and
    activations, E5M2 gradients, per-tensor current scaling, each amax reduced over the
    mesh), but the first and the last `skip_layers` layers', which stay in the compute
    dtype, as do the embedding and the LM head. The scan, the conv, the norms and the
    float32 rules are unchanged. skip_layers=1 is Megatron-LM's default for
    --first-last-layers-bf16 (--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16
    1), which its Nemotron-H recipes use. Mamba2LM.loss (and hidden, __call__) take it as
    `fp8=`; the trainer's --fp8."""

    skip_layers: int = 1

    def __post_init__(self):
        if not isinstance(self.skip_layers, int) or isinstance(self.skip_layers, bool) \
                or self.skip_layers < 0:
            raise ValueError(f"Fp8(skip_layers={self.skip_layers!r}): give the number of "
                             "layers kept in the compute dtype at each end, 0 or more")

    def in_fp8(self, n_layers: int) -> tuple[bool, ...]:
        """Per layer of n_layers, whether its projections run in FP8."""
        k = self.skip_layers
        return tuple(k <= i < n_layers - k for i in range(n_layers))


class Stream(NamedTuple):
    """The residual stream between layers as mamba_ssm's fused add and norm carries it: its
    value is residual + delta. residual [b, l, d] ([b, l/tp, d] under sequence parallel) in
    the residual dtype; delta, the same shape in the compute dtype: the last layer's output,
    which the next norm adds as it reads the residual (zeros before the first layer)."""

    residual: jax.Array
    delta: jax.Array

    @classmethod
    def start(cls, residual, dtype):
        """The stream before the first layer: residual, and a zero delta in dtype."""
        return cls(residual, jnp.zeros(residual.shape, dtype))

    def value(self):
        """residual + delta [b, l, d] in the residual dtype."""
        return self.residual + self.delta.astype(self.residual.dtype)


class Block(nnx.Module):
    """norm -> mixer (the registered kind of `symbol`), added to the residual stream."""

    def __init__(self, cfg, symbol: str, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = KINDS[symbol](cfg, rngs=rngs, dtype=dtype)

    def __call__(self, stream: Stream, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 cache_len=None, initial_state=None):
        """stream -> (the stream after this layer, the layer's cache: None unless cache_len;
        Mixer.__call__). The norm adds the stream's delta to its residual as it reads it;
        this layer's output is the new delta. initial_state: the cache the sequence
        continues from, for a kind that takes_initial_state."""
        residual, normed = self.norm.add(*stream)
        state = {} if initial_state is None else {"initial_state": initial_state}
        out, cache = self.adapted_mixer()(ctx.layer_input(normed), seq_idx, ctx=ctx,
                                          cache_len=cache_len, **state)
        return Stream(residual, self._delta(ctx.layer_output(out, self.mixer.dtype))), cache

    def adapted_mixer(self):
        """The mixer as this layer runs it: with its LoRA adapters (`lora`, where
        mamba_jax.adapters.add_lora gave it some) merged into its weights, in float32 where
        the base is stored in bfloat16 (adapters.adapted); else the mixer itself."""
        return adapters.adapted(self.mixer, adapters.lora_of(self))

    def _delta(self, out):
        """The mixer's output (float32, or under tp its ranks' shares summed in the compute
        dtype) with its bias, rounded to the compute dtype: what the residual stream adds."""
        bias = self.mixer.output_bias()
        if bias is not None:
            out = out + bias
        return out.astype(self.mixer.dtype)

    def step(self, residual, cache, weights=None, how="xla"):
        """One token: residual [b, d] -> (residual [b, d], the layer's updated cache).
        weights: the mixer's step_weights(how), built before the decode loop; how: "xla",
        "kernel" (the mixer's step kernel) or "fused" (the whole layer as its mixer's
        fused_step, the norm inside its first kernel)."""
        mixer = self.adapted_mixer()
        if weights is None:
            weights = mixer.step_weights(how)
        if how == "fused":
            return mixer.fused_step(residual, self.norm.weight[...], self.norm.eps, cache,
                                    weights)
        hidden = self.norm(residual).astype(mixer.dtype)
        out, cache = mixer.step(hidden, cache, weights, how)
        return Stream(residual, self._delta(out)).value(), cache


class DecodeWeights(NamedTuple):
    """What every decoding step reads that is derived from the parameters, built once before
    the decode loop: XLA does not hoist it out of a while_loop, and would rebuild it at every
    token (the fused input projection is a copy of the layer's largest weights).

    head [v, d]: the LM head in the compute dtype; layers: per layer, its mixer's
    step_weights."""

    head: jax.Array
    layers: tuple


def check_causal(cfg) -> None:
    """A ValueError where cfg has layers whose outputs read later tokens (a kind not
    `causal`, as the bidirectional B): a language model's loss would see the tokens it
    predicts, and it has no step to decode with. The trainer and generate refuse them;
    Mamba2LM itself builds them (the layer kinds' tests run every kind through it)."""
    ahead = sorted({s for s in cfg.layers if not KINDS[s].causal})
    if ahead:
        raise ValueError(f"layer_pattern {cfg.layers!r}: its {', '.join(ahead)} layers read "
                         "later tokens, which a language model predicting the next one cannot "
                         "have; build a mamba_jax.Mamba2Encoder with them")


def init_backbone(module: nnx.Module, cfg, rngs: nnx.Rngs, dtype):
    """module's config, compute dtype, embedding, layers (of cfg.layers) and final norm:
    what Mamba2LM and mamba_jax.encoder.Mamba2Encoder share."""
    module.config = cfg
    module.dtype = dtype
    v, d = cfg.padded_vocab_size, cfg.d_model
    module.embedding = param(0.02 * jax.random.normal(rngs.params(), (v, d), jnp.float32),
                             "vocab", "embed")
    module.layers = nnx.List(init_layers(cfg, rngs.params(), dtype))
    module.norm_f = RMSNorm(d, cfg.norm_eps)


def init_layers(cfg, key: jax.Array, dtype) -> list[Block]:
    """The Blocks of cfg.layers, layer i drawn from fold_in(key, i). The layers of one kind
    are drawn together, as one init vmapped over their keys: a jitted init (the trainer's,
    which creates the parameters already sharded) then compiles each kind's init once, not
    once per layer (mamba2-1.3b's 48 layers drawn one by one were most of the time before the
    first step's compile began, on a CPU and on a GPU alike).

    Each layer's tensors are then taken out of the stack at an offset known only at run time
    (an optimization_barrier hides the offsets from XLA's constant folding), so that every
    layer's copy of a tensor is the same kernel, which XLA's GPU compiler builds once: a
    static slice a layer gave mamba2-1.3b hundreds of distinct copy kernels and a slower
    compile on a GPU (on a CPU the two compile alike; docs/performance.md)."""
    blocks = [None] * len(cfg.layers)
    for symbol in dict.fromkeys(cfg.layers):
        index = [i for i, s in enumerate(cfg.layers) if s == symbol]
        graphdefs = []  # the kind's GraphDef, from vmap's one trace of build

        def build(layer_key, symbol=symbol):
            graphdef, state = nnx.split(Block(cfg, symbol, rngs=nnx.Rngs(params=layer_key),
                                              dtype=dtype))
            graphdefs.append(graphdef)
            return state

        layer_keys = jax.vmap(functools.partial(jax.random.fold_in, key))(jnp.asarray(index))
        stacked = jax.vmap(build)(layer_keys)
        offsets = lax.optimization_barrier(jnp.arange(len(index)))
        for j, i in enumerate(index):
            blocks[i] = nnx.merge(graphdefs[0], jax.tree.map(
                lambda a: lax.dynamic_index_in_dim(a, offsets[j], keepdims=False), stacked))
    return blocks


class Mamba2LM(nnx.Module):
    """A Mamba2 language model (mamba_ssm's MambaLMHeadModel / HF Mamba2ForCausalLM), or a
    hybrid of the registered layer kinds (NemotronHForCausalLM).

    Parameters are float32. `dtype` is the compute dtype (jnp.bfloat16 on GPUs); A_log, dt,
    D and the SSM state stay float32, and logits are returned in float32.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        init_backbone(self, cfg, rngs, dtype)
        v, d = cfg.padded_vocab_size, cfg.d_model
        if not cfg.tie_embeddings:
            # Stored [v, d] like the embedding (torch's nn.Linear layout).
            self.lm_head = param(uniform(rngs, (v, d), 1.0 / math.sqrt(d)), "vocab", "embed")

    @property
    def residual_dtype(self):
        return jnp.float32 if self.config.residual_in_fp32 else self.dtype

    # ------------------------------------------------------------ the forward

    def __call__(self, input_ids, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
                 remat="none", initial_states=None, return_states=False, scan_layers=True,
                 fp8: Fp8 | None = None):
        """input_ids [b, l] -> logits [b, l, v] float32 ([b, l, v/tp] under tp: this rank's
        slice of the vocabulary). seq_idx [b, l]: packed documents (no state crosses a
        document start). initial_states, return_states, scan_layers, fp8: as `hidden`'s;
        with return_states, (logits, states)."""
        hidden = self.hidden(input_ids, seq_idx, ctx=ctx, remat=remat,
                             initial_states=initial_states, return_states=return_states,
                             scan_layers=scan_layers, fp8=fp8)
        if return_states:
            return self._vocab(hidden[0], self.head_weight(ctx)), hidden[1]
        return self._vocab(hidden, self.head_weight(ctx))

    def hidden(self, input_ids, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
               remat="none", initial_states=None, return_states=False, scan_layers=True,
               fp8: Fp8 | None = None):
        """input_ids [b, l] -> the final norm's output [b, l, d] in the compute dtype (every
        position of this device's part, whatever the sequence parallelism). remat: "none",
        "block" or "full" activation checkpointing of each layer (remat_policy). scan_layers:
        each run of layers of one kind as one scan (a shorter compile, less memory a row),
        else one layer after the other (a shorter step: the trainer's default; `_layers`'
        scan).

        initial_states: per layer, the state the sequence continues from (a MambaCache, whose
        conv window and SSM state may each be None; None for a layer without one), e.g. the
        states a previous call returned; gradients flow into it. return_states: also return
        each layer's state after the last token (its decoding cache; under cp every device
        gets the end of the whole sequence): (hidden, states). fp8: an Fp8 recipe, the
        layers' projections in FP8 (for training); None: every matmul in the compute dtype."""
        check_tokens(type(self).__name__, input_ids, self.config.padded_vocab_size,
                     seq_idx=seq_idx)
        stream, states = self._layers(self.embed(input_ids, ctx), seq_idx, ctx, remat,
                                      cache_len=input_ids.shape[1] if return_states else None,
                                      scan=scan_layers, initial_states=initial_states, fp8=fp8)
        hidden = self._final(stream, ctx)
        return (hidden, states) if return_states else hidden

    def loss(self, input_ids, targets, seq_idx=None, *, ctx: ParallelContext = SINGLE_DEVICE,
             remat="none", loss_chunk=None, initial_states=None, return_states=False,
             scan_layers=True, fp8: Fp8 | None = None):
        """Per-token next-token cross-entropy [b, l] float32 (nats) of targets [b, l] (with
        return_states, (that, the states): `hidden`'s initial_states and return_states, for
        truncated backpropagation through time over the pieces of a long sequence; its
        remat, scan_layers and fp8).

        loss_chunk: positions per piece. The logits of one piece at a time, recomputed in the
        backward pass, so the largest logits buffer is [b, loss_chunk, v/tp], not [b, l,
        v/tp] (at 64K tokens and a 50K vocabulary that is 13 GB of float32 per row)."""
        where = f"{type(self).__name__}.loss"
        check_tokens(where, input_ids, targets=targets)
        if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
            raise ValueError(f"{where}: targets of dtype {jnp.result_type(targets)}; give "
                             "integer token ids")
        check_ids(where, "targets", targets, self.config.padded_vocab_size)
        hidden = self.hidden(input_ids, seq_idx, ctx=ctx, remat=remat,
                             initial_states=initial_states, return_states=return_states,
                             scan_layers=scan_layers, fp8=fp8)
        hidden, states = hidden if return_states else (hidden, None)
        with_states = lambda losses: (losses, states) if return_states else losses
        head = self.head_weight(ctx)
        b, l, _ = hidden.shape
        if loss_chunk is not None and (loss_chunk < 1 or loss_chunk < l and l % loss_chunk):
            raise ValueError(f"loss: loss_chunk={loss_chunk} must be a positive divisor of the "
                             f"sequence length {l} (or None: the whole sequence at once)")
        if loss_chunk is None or loss_chunk >= l:
            return with_states(cross_entropy(self._vocab(hidden, head), targets, ctx))

        @jax.checkpoint
        def piece(_, xs):
            return None, cross_entropy(self._vocab(xs[0], head), xs[1], ctx)
        pieces = lambda a: a.reshape(b, l // loss_chunk, loss_chunk, *a.shape[2:]).swapaxes(0, 1)
        _, losses = lax.scan(piece, None, (pieces(hidden), pieces(targets)))
        return with_states(losses.swapaxes(0, 1).reshape(b, l))

    def embed(self, input_ids, ctx: ParallelContext = SINGLE_DEVICE):
        """input_ids [b, l] int -> residual stream [b, l, d] ([b, l/tp, d] under sequence
        parallel). Under tp each rank holds v/tp rows: it looks the ids up in its rows,
        zeros elsewhere, and the sum over tp completes every row."""
        table = ctx.gather_params(self.embedding)[...]
        if ctx.tp == 1:
            rows = jnp.take(table, input_ids, axis=0)
        else:
            v_loc = table.shape[0]
            local = input_ids - ctx.tp_index() * v_loc
            mine = (local >= 0) & (local < v_loc)
            rows = jnp.where(mine[..., None], jnp.take(table, jnp.where(mine, local, 0), axis=0),
                             0.0)
            rows = ctx.layer_output(rows)
        return rows.astype(self.residual_dtype)

    def head_weight(self, ctx: ParallelContext = SINGLE_DEVICE):
        """The LM head [v, d] (this rank's [v/tp, d] under tp; the embedding when tied)."""
        head = self.embedding if self.config.tie_embeddings else self.lm_head
        return ctx.gather_params(head)[...]

    def _layers(self, residual, seq_idx, ctx, remat="none", cache_len=None, scan=True,
                initial_states=None, fp8: Fp8 | None = None):
        """Every layer: residual [b, l(/tp), d] -> (the Stream after the last layer, per
        layer its cache or None). initial_states: per layer the cache it continues from, or
        None (`hidden`). fp8: the layers whose projections run in FP8 (their context's
        `fp8`), each run of layers one precision.

        scan: one scan per run of consecutive layers of one kind, not a copy of the layer per
        layer: compile time and program size stay those of one layer per run. An all-Mamba
        model is one run, one scan; a hybrid pattern such as Megatron's "M-M-M*-..."
        alternates kinds, so most of its runs are a single layer, called directly. A scan
        pays for its stacks: the run's weights stacked (a copy of this device's shards, held
        through the step), their gradients stacked before they are sliced apart, and each
        layer's saved residuals copied into stacks and out of them (layer_scan).
        scan=False calls the layers one after the other: none of those, for a program that
        holds a copy of the layer per layer (a prefill; training without --scan-layers)."""
        # the token arrays' leading shapes: this device's part of the stream, and of the
        # sequence gathered over tp (sequence parallel) and cp (attention's keys)
        tokens = {(residual.shape[0], residual.shape[1] * n) for n in
                  {1, ctx.tp, ctx.cp, ctx.tp * ctx.cp}}
        initial_states = self._check_initial_states(initial_states, residual.shape[0],
                                                    whole=ctx.tp == 1 and ctx.cp == 1)
        stream = Stream.start(residual, self.dtype)
        caches = []
        n = len(self.layers)
        in_fp8 = fp8.in_fp8(n) if fp8 else (False,) * n
        for first, end in _runs(tuple(zip(self.config.layers, in_fp8))):
            graphdef = nnx.graphdef(self.layers[first])  # the same in the whole run
            policy = remat_policy(remat, ctx.fsdp > 1,
                                  tokens if adapters.adapts(self.layers[first]) else None)

            def layer(stream, xs, seq_idx, graphdef=graphdef,
                      ctx=dataclasses.replace(ctx, fp8=in_fp8[first])):
                state, initial_state = xs
                block = nnx.merge(graphdef, ctx.gather_params(state))
                return block(stream, seq_idx, ctx=ctx, cache_len=cache_len,
                             initial_state=initial_state)
            if policy is not None:
                layer = jax.checkpoint(layer, policy=policy)
            states = [(nnx.state(self.layers[i]), initial_states[i]) for i in range(first, end)]
            if len(states) == 1 or not scan:
                # One function traced once for the run's layers, not once a layer: its
                # jaxpr, its derivatives' and its lowering (the kernels') are reused at each
                # call, which XLA inlines.
                call = layer if len(states) == 1 else jax.jit(layer)
                for state in states:
                    stream, cache = call(stream, state, seq_idx)
                    caches.append(cache)
            else:
                stream, stacked = layer_scan.scan(
                    functools.partial(layer, seq_idx=seq_idx), stream,
                    jax.tree.map(lambda *ws: jnp.stack(ws), *states))
                caches.extend(jax.tree.map(lambda c, i=i: c[i], stacked)
                              for i in range(end - first))
        return stream, tuple(caches)

    def _check_initial_states(self, initial_states, batch: int, whole: bool = True) -> tuple:
        """initial_states (None, or one entry per layer) -> one per layer; a ValueError where
        a layer that cannot continue a sequence is given a state, a state is not of its
        layer's kind or batch (it failed inside, an attribute or a concatenation), where
        `whole` (no tp or cp split of the states: a device's parts have other shapes) its
        arrays are not of the shapes return_states gives (another model's, or a conv window
        of another length, read without an error), or a run of layers of one kind is given
        states for some layers and not for others (its layers run as one scan)."""
        n = len(self.layers)
        if initial_states is None:
            return (None,) * n
        if len(initial_states) != n:
            raise ValueError(f"initial_states has {len(initial_states)} entries for {n} "
                             "layers: give one per layer (None for a layer without state)")
        shapes = jax.eval_shape(lambda: self.init_cache(1))
        kinds = tuple(map(type, shapes))
        for i, (layer, state, kind) in enumerate(zip(self.layers, initial_states, kinds)):
            if state is not None and not layer.mixer.takes_initial_state:
                raise ValueError(f"initial_states[{i}] (or a prefill's cache): layer {i} is "
                                 f"{type(layer.mixer).__name__}, which cannot continue from a "
                                 "state (Mamba2 layers can); give None for it, or run the "
                                 "whole sequence at once")
            if state is None:
                continue
            if not isinstance(state, kind):
                raise ValueError(f"initial_states[{i}] is {type(state).__name__}, not the "
                                 f"{kind.__name__} layer {i} takes (as return_states gives "
                                 "it)")
            # per row: every array but a growing cache's one count of its tokens
            rows = {a.shape[0] for a in jax.tree.leaves(state) if jnp.ndim(a)}
            if rows != {batch}:
                raise ValueError(f"initial_states[{i}] holds states of {sorted(rows)} rows for "
                                 f"a batch of {batch}: give one per row")
            if whole:  # field by field: either of a MambaCache's may be None (zeros)
                pairs = [(value, expected) for value, expected in zip(state, shapes[i])
                         if value is not None]
                # a growing cache's keys of any number of slots; its counts as they come
                shape = ((lambda a: tuple(a.shape[2:]) if a.ndim > 2 else ())
                         if layer.mixer.cache_grows else lambda a: tuple(a.shape[1:]))
                got, want = ([shape(a) for pair in pairs for a in jax.tree.leaves(pair[side])]
                             for side in (0, 1))
                if got != want:
                    raise ValueError(f"initial_states[{i}] holds arrays of shapes {got} a row, "
                                     f"where layer {i} takes {want} (as return_states gives "
                                     "them): the states of another model?")
        for first, end in _runs(self.config.layers):
            given = {initial_states[i] is None for i in range(first, end)}
            if len(given) > 1:
                raise ValueError(f"initial_states: layers {first}..{end - 1} "
                                 f"({self.config.layers[first]}) run as one (a scan, or unrolled "
                                 "by scan_layers=False); give a state for all of them or for "
                                 "none")
        return tuple(initial_states)

    def _final(self, stream: Stream, ctx: ParallelContext = SINGLE_DEVICE):
        """The Stream after the last layer -> norm_f's output [b, l, d] in the compute
        dtype (the last layer's output added as norm_f reads the stream)."""
        _, normed = ctx.gathered(self.norm_f).add(*stream)
        return ctx.layer_input(normed)

    def _vocab(self, hidden, head):
        """hidden [..., d] -> float32 logits [..., v] through head [v, d]."""
        return matmul("...d,vd->...v", hidden, head, self.dtype)

    # ------------------------------------------------------------ decoding

    @property
    def cache_grows(self) -> bool:
        """Whether the decoding cache has a slot per token (an attention layer's keys)."""
        return any(layer.mixer.cache_grows for layer in self.layers)

    def _cache_kinds(self) -> tuple:
        """Per layer, the type of its state (its cache's, as init_cache and return_states
        give it: MambaCache, Mamba3State, AttentionCache, or NoneType)."""
        return tuple(map(type, jax.eval_shape(lambda: self.init_cache(1, 1))))

    def init_cache(self, batch_size: int, cache_len: int = 0) -> tuple:
        """An empty decoding cache: per layer its mixer's (None for an MLP), cache_len slots
        where it grows with the tokens."""
        return tuple(layer.mixer.init_cache(batch_size, cache_len) for layer in self.layers)

    def prefill(self, input_ids, seq_idx=None, cache_len=None, cache=None):
        """input_ids [b, l] -> (logits [b, l, v], cache after the last token).

        cache: a cache to continue from (a previous prefill's or decode's, as returned,
        before cache_for_decoding), for models whose layers all take_initial_state; an
        attention layer's keys go after its cache's, which must have a free slot for each
        token (of max(its slots, cache_len)). None starts afresh.

        seq_idx [b, l]: the cache holds only the last document of each row (so left padding
        given its own seq_idx leaves no trace in the state). cache_len: slots of the caches
        that grow with the tokens (the prompt and every token to come; default l, which
        leaves an attention layer no slot for a step)."""
        check_tokens(f"{type(self).__name__}.prefill", input_ids,
                     self.config.padded_vocab_size, seq_idx=seq_idx)
        cache_len = cache_len or input_ids.shape[1]
        if self.cache_grows and cache_len < input_ids.shape[1]:
            raise ValueError(f"prefill: cache_len={cache_len} slots cannot hold the prompt's "
                             f"{input_ids.shape[1]} tokens; give the prompt's tokens + every "
                             "token to come")
        stream, cache = self._layers(self.embed(input_ids), seq_idx, SINGLE_DEVICE,
                                     cache_len=cache_len, scan=False, initial_states=cache)
        return self._vocab(self._final(stream), self.head_weight()), cache

    def cache_for_decoding(self, cache, steps, ssm_state_dtype="float32") -> tuple:
        """The prefill's cache as the decode loop carries it (Mixer.cache_for_decoding), for
        the layers' step implementations `steps`."""
        return tuple(layer.mixer.cache_for_decoding(c, how, ssm_state_dtype)
                     for layer, c, how in zip(self.layers, cache, steps))

    def decode_weights(self, steps=None) -> DecodeWeights:
        """The DecodeWeights of the current parameters (build them outside the decode loop)
        for the layers' step implementations `steps` (default: "xla" for every layer)."""
        steps = steps or ("xla",) * len(self.layers)
        return DecodeWeights(head=self.head_weight().astype(self.dtype),
                             layers=tuple(layer.adapted_mixer().step_weights(how)
                                          for layer, how in zip(self.layers, steps)))

    def step(self, token_ids, cache, weights: DecodeWeights | None = None, steps=None):
        """One decoding step: token_ids [b] -> (logits [b, v], the updated cache).

        steps: each layer's step implementation ("xla", "kernel", "fused"; the decode plan,
        mamba_jax.generate.plan); default "xla" for every layer. weights:
        `decode_weights(steps)`, built once before a decode loop; None builds them here."""
        steps = steps or ("xla",) * len(self.layers)
        if jnp.ndim(token_ids) != 1 or not jnp.issubdtype(jnp.result_type(token_ids),
                                                           jnp.integer):
            raise ValueError(f"step: token_ids of shape {jnp.shape(token_ids)} and dtype "
                             f"{jnp.result_type(token_ids)}; give one integer id per row, [b]")
        # each layer's rows: its cache's first array's (a step kernel's counter comes last)
        batch = jnp.shape(token_ids)[0]
        rows = {jax.tree.leaves(c)[0].shape[0] for c in cache if jax.tree.leaves(c)}
        if len(cache) != len(self.layers) or rows - {batch} \
                or any(type(c) is not kind for c, kind in zip(cache, self._cache_kinds())):
            raise ValueError(f"step: the cache must be this model's, for {batch} "
                             f"rows (a prefill's of these rows, or init_cache's): one entry "
                             f"per layer, {len(self.layers)}")
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if layer_cache is None:  # a layer without state
                continue
            # shapes are static: checked as the step is traced, nothing left under jit
            slots = jax.tree.leaves(layer_cache)[0].shape[1] if layer.mixer.cache_grows else 0
            got, want = _row_shapes(layer_cache, jax.eval_shape(
                lambda mixer=layer.mixer: mixer.init_cache(batch, slots)))
            if got != want:  # another model's: it failed in a concatenation
                raise ValueError(f"step: the cache of layer {i} holds arrays of shapes {got} a "
                                 f"row, where this model's takes {want}: give this model's "
                                 "cache (its prefill's or init_cache's)")
        for layer_cache in cache:  # outside jit, where a growing cache's length is known
            length = getattr(layer_cache, "length", None)
            if length is not None and not isinstance(length, jax.core.Tracer) \
                    and jnp.ndim(length) == 0 and int(length) >= layer_cache.k.shape[1]:
                # its write would land on the last slot, silently
                raise ValueError(f"step: the attention cache is full ({layer_cache.k.shape[1]} "
                                 "slots); prefill with cache_len = the prompt's tokens + every "
                                 "token to come")
        if weights is None:
            weights = self.decode_weights(steps)
        residual = self.embed(token_ids)
        new_cache = []
        for layer, layer_cache, layer_weights, how in zip(self.layers, cache, weights.layers,
                                                          steps):
            residual, layer_cache = layer.step(residual, layer_cache, layer_weights, how)
            new_cache.append(layer_cache)
        return self._vocab(self.norm_f(residual).astype(self.dtype), weights.head), tuple(new_cache)
