"""Generation: a jitted prefill through the chunked scan, then one compiled decode loop.

    tokens = generate(model, input_ids, max_new_tokens=64, temperature=0.0)
    python -m mamba_jax.generate --checkpoint DIR --prompt "Hello"   (the CLI: __main__.py)
    python -m mamba_jax.serve --checkpoint DIR                        (the HTTP server)

Legend: b batch, l prompt length (after left padding), t max_new_tokens, v vocabulary.

Two programs per call. `prefill` runs the prompt through the chunked SSD scan (and, in a
hybrid model, attention, whose KV cache it sizes for the prompt and every new token) and
samples the first token. `decode` is the whole rest (every layer, sampling, per-row
stopping) as one `lax.while_loop`, on a GPU one CUDA graph (DECODE_COMPILER_OPTIONS): no
Python loop, no host round trip and no recompilation per token. Its cache argument is
donated, so XLA updates the conv windows and SSM states in place. Before the loop it builds
the model's DecodeWeights (each layer's step weights in the compute dtype, the fused input
projections, the LM head), which XLA would otherwise rebuild inside the loop at every token.
Which implementation each layer's step runs is the decode plan's choice (plan.py).

Sampling settings are traced values, one per row, so requests with different temperatures
share a batch and a compiled program; only which filters exist at all (greedy-only, top-k,
top-p, top-p decay, a banned token pair) is static.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from mamba_jax.generate.plan import STEP_IMPLEMENTATIONS, DecodePlan, decode_plan
from mamba_jax.model import check_causal

# The decode loop as one CUDA graph: XLA's command buffers with the while loop itself a
# conditional graph node (XLA's default leaves the loop to the host, which launches its
# body's command buffers at every token). Less time per token at batch 1
# (bench/generate.py --command-buffers on,off; docs/performance.md). Ignored on CPU.
DECODE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer":
                           "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"}
SSM_STATE_DTYPES = ("float32", "bfloat16", "int8")
# The output tokens [b, max_new_tokens] (and a hybrid's KV cache, [b, l + max_new_tokens] per
# attention layer) are allocated whole before the first step: a cap of a million tokens
# keeps a typo (1e9) from claiming gigabytes.
MOST_NEW_TOKENS = 1 << 20


class Sampling(NamedTuple):
    """Which filters the compiled sampler contains (static); their values are traced."""

    greedy: bool  # every row has temperature 0: argmax only
    top_k: bool
    top_p: bool
    top_p_decay: bool = False  # some row's top_p shrinks with each new token
    banned_after: bool = False  # some row bans a token right after another
    penalties: bool = False  # some row has a presence or frequency penalty
    logit_bias: bool = False  # some row adds a bias to some logits


class Settings(NamedTuple):
    """The per-row sampling values [b] each (traced): temperature, top_k, top_p, then top_p's
    decay and bound (Megatron-LM's top_p_decay, top_p_bound: new token i samples with
    max(top_p * decay**i, bound) where decay > 0), then the banned pair: after token
    ban_after the next is never ban_token (-1: off; Megatron's prevent_newline_after_colon
    as (":", "\n")), then OpenAI's presence and frequency penalties [b] and logit_bias
    [b, v] float32 (added to the logits), each None where no row uses it."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    top_p_decay: np.ndarray
    top_p_bound: np.ndarray
    ban_after: np.ndarray
    ban_token: np.ndarray
    presence_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    logit_bias: np.ndarray | None = None


def seed_words(seeds) -> np.ndarray:
    """[n, 2] uint32: each 64-bit integer seed's two words, the threefry key data of the
    seed (a seed in [0, 2**32) gives jax.random.key(seed)'s key; jax.random.key keeps only
    a seed's low 32 bits while 64-bit integers are off, so 5 and 2**40 + 5 were one key)."""
    return np.asarray([[(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF]
                       for s in (int(s) & (2**64 - 1) for s in seeds)], np.uint32).reshape(-1, 2)


def alone_streams(words) -> jax.Array:
    """The PRNG stream [n] of a row alone in a generate call with each seed, from its words
    [n, 2] uint32 (seed_words; traceable)."""
    keys = jax.random.wrap_key_data(words, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, jnp.zeros(keys.shape, jnp.uint32))


def row_streams(seed, rows: int) -> jax.Array:
    """The keys [rows] that rows 0..rows-1 of a generate call with `seed` sample from: for
    one seed, row r's is fold_in(seed's key, r); for one seed a row [rows], row r's is
    fold_in(seed[r]'s key, 0), the row as if alone in a call with its seed (the server's
    engine samples a sequence with a seed so). A row's samples depend on these, its prompt
    and its settings, never on the other rows."""
    if np.ndim(seed) != 0:
        return alone_streams(seed_words(seed))
    keys = jax.random.wrap_key_data(seed_words([seed] * rows), impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, jnp.arange(rows, dtype=jnp.uint32))


def token_keys(streams, step) -> jax.Array:
    """The keys [b] that new token `step` (a number, or [b]: each row's) samples with, from
    each row's stream [b]."""
    step = jnp.broadcast_to(jnp.asarray(step, jnp.uint32), streams.shape)
    return jax.vmap(jax.random.fold_in)(streams, step)


def sample_logits(logits, key, temperature=0.0, top_k=None, top_p=None):
    """logits [b, v] float32 -> token ids [b] int32.

    key: one PRNG key for the batch, or one per row [b] (then a row's draw depends on its key
    and logits alone). Each setting is a number (all rows) or an array [b] (one per row).
    temperature 0 is greedy (argmax). top_k keeps the k most likely tokens (None or 0: off);
    top_p then keeps the smallest set whose probability reaches p (None or 1: off), always at
    least the most likely token.
    """
    if isinstance(temperature, (int, float)) and temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    b, v = logits.shape
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))[:, None]
    # Less the row's largest logit before the division: the largest stays 0, where at a
    # temperature near 0 two large logits both overflowed to inf (their tie sampled the
    # first), and at a huge one every logit rounded to the same 0.
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.where(t > 0, t, 1.0)
    if top_k is not None or top_p is not None:
        ranked = -jnp.sort(-scaled, axis=-1)  # [b, v], most likely first
        cutoff = jnp.full((b, 1), -jnp.inf)
        if top_k is not None:  # on the logits: their order is the scaled ones' before rounding
            k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))
            k = jnp.where(k > 0, jnp.minimum(k, v), v)[:, None]
            kth = jnp.take_along_axis(-jnp.sort(-logits, axis=-1), k - 1, axis=-1)
            scaled = jnp.where(logits < kth, -jnp.inf, scaled)
            ranked = -jnp.sort(-scaled, axis=-1)
        if top_p is not None:
            p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))[:, None]
            probs = jax.nn.softmax(ranked, axis=-1)
            # A token stays if the mass strictly before it is below top_p, and the most
            # likely one always: a top_p that XLA flushes to 0 (a float32 denormal) kept none.
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            stays = (mass_before < p) | (jnp.arange(v) == 0)[None, :]
            cutoff = jnp.maximum(cutoff, jnp.min(
                jnp.where(stays, ranked, jnp.inf), axis=-1, keepdims=True))
        scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    if jnp.ndim(key) == 0:
        sampled = jax.random.categorical(key, scaled, axis=-1)
    else:
        sampled = jax.vmap(jax.random.categorical)(key, scaled)
    return jnp.where(t[:, 0] > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def adjusted_logits(logits, settings: Settings, sampling: Sampling, previous, counts=None):
    """logits [b, v] as the sampler's filters see them: the banned token's -inf after
    `previous` [b] (Megatron's), less OpenAI's penalties over counts [b, v] int32 (each
    token's count among the row's new tokens so far), plus logit_bias."""
    s = settings
    if sampling.banned_after:
        banned = (previous == s.ban_after)[:, None] & (
            jnp.arange(logits.shape[-1])[None, :] == s.ban_token[:, None])
        logits = jnp.where(banned, -jnp.inf, logits)
    if sampling.penalties:
        logits = (logits - s.presence_penalty[:, None] * (counts > 0)
                  - s.frequency_penalty[:, None] * counts)
    if sampling.logit_bias:
        logits = logits + s.logit_bias
    return logits


def _sample(logits, key, settings: Settings, sampling: Sampling, step, previous, counts=None):
    """sample_logits of new token `step` (0: the prefill's; a number, or [b]) after the
    tokens `previous` [b], its logits adjusted (adjusted_logits, with counts [b, v] of each
    row's new tokens where sampling.penalties), with the static Sampling deciding which
    traced settings it reads. key: one for the batch, or one per row [b]."""
    s = settings
    logits = adjusted_logits(logits, s, sampling, previous, counts)
    if sampling.greedy:
        return sample_logits(logits, key)
    top_p = s.top_p
    if sampling.top_p_decay:
        top_p = jnp.where(s.top_p_decay > 0, jnp.maximum(
            top_p * s.top_p_decay ** jnp.asarray(step, jnp.float32), s.top_p_bound), top_p)
    return sample_logits(logits, key, s.temperature, s.top_k if sampling.top_k else None,
                         top_p if sampling.top_p else None)


def _picked_nan(logits, token):
    """[b] bool: whether the token sampled from logits [b, v] is where a logit is NaN. Every
    sampler here picks a NaN where a row has one (argmax and the Gumbel draw's argmax take a
    NaN as the largest, and no filter removes it), so this reads b values, not b x v."""
    return jnp.isnan(jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0])


@functools.partial(jax.jit, static_argnames=("sampling", "plan", "cache_len",
                                             "ssm_state_dtype"))
def _prefill(model, input_ids, prompt_lengths, streams, settings, *, sampling,
             plan: DecodePlan, cache_len=None, ssm_state_dtype="float32"):
    """input_ids [b, l], prompt_lengths [b] or None, each row's PRNG stream [b]
    (row_streams) -> (first token [b], -1 where the row's logits are NaN, the cache as the
    decode loop of `plan` carries it).

    model: the Mamba2LM itself, a pytree (see generate). cache_len: the slots of the caches
    that grow with the tokens (None for a model without them, so its prefill compiles once
    for any max_new_tokens). ssm_state_dtype: what the cache stores the SSM states in (the
    decode steps keep that dtype)."""
    seq_idx = None if prompt_lengths is None else _prompt_documents(input_ids, prompt_lengths)
    logits, cache = model.prefill(input_ids, seq_idx=seq_idx, cache_len=cache_len)
    cache = model.cache_for_decoding(cache, plan.steps, ssm_state_dtype)
    vocab = model.config.vocab_size  # never sample the padding rows of the vocabulary
    logits = logits[:, -1, :vocab]
    first = _sample(logits, token_keys(streams, 0), settings, sampling, 0, input_ids[:, -1],
                    jnp.zeros(logits.shape, jnp.int32) if sampling.penalties else None)
    return jnp.where(_picked_nan(logits, first), -1, first), cache


def _nan_logits(where: str, position: str, rows) -> ValueError:
    """The error for NaN logits at `position` of the first of rows (row indices)."""
    more = f", and {len(rows) - 1} more row(s)" if len(rows) > 1 else ""
    return ValueError(f"{where}: the model's logits are NaN (row {rows[0]}, {position}{more}): "
                      "its weights hold NaN or infinity, or its activations overflow (a "
                      "bfloat16 model may where float32 does not: --dtype float32)")


def _learned_state_padding(where: str, lengths: str) -> ValueError:
    return ValueError(
        f"{where}: left-padded rows ({lengths}) of a model with a learnable initial state "
        "(mamba2.learnable_init_state): the state enters a row's first document, its "
        "padding, so the prompt would start from zeros; give rows of different lengths one "
        "at a time")


def learned_state(model) -> bool:
    """Whether model has Mamba2 layers whose scans start from a learned state."""
    return "M" in model.config.layers and model.config.mamba2.learnable_init_state


def _prompt_documents(input_ids, prompt_lengths):
    """seq_idx [b, l] int32 of left-padded input_ids [b, l] whose row r's prompt is its last
    prompt_lengths[r] tokens: the padding is its own document (0), so the conv and the scan
    restart at the prompt (1)."""
    l = input_ids.shape[1]
    return (jnp.arange(l)[None, :] >= (l - prompt_lengths)[:, None]).astype(jnp.int32)


def _emit(stream_id, step, tokens):
    """The host end of the streaming io_callback: hand tokens [b] to the stream's callable.
    What it raises is kept for decode() to raise once the loop ends (raised here, it would
    reach the caller wrapped in the runtime's error), and the stream gets no more steps."""
    stream_id = int(stream_id)
    if stream_id in _FAILURES:
        return
    try:
        _STREAMS[stream_id](int(step), np.asarray(tokens))
    except Exception as error:  # noqa: BLE001 - the caller's, raised again by decode()
        _FAILURES[stream_id] = error


# Streams by id: jit keys on the callable it traces, so the loop calls one fixed function
# (_emit) with the stream's id as data, and a new on_token never recompiles.
_STREAMS: dict[int, Callable[[int, np.ndarray], None]] = {}
_FAILURES: dict[int, Exception] = {}  # by stream id: what its callable raised
_STREAM_IDS = itertools.count()  # next() on it is atomic: threads need no lock


def _decode_loop(model, first, cache, streams, settings, limits, stream_id, *, max_new_tokens,
                 sampling, eos_token_id, stream, plan: DecodePlan):
    """first [b] (the prefill's token, -1 for NaN logits), each row's PRNG stream [b],
    limits [b] (tokens each row may generate, <= t) -> (tokens [b, t] int32, final cache,
    [b] int32: the new token at which a row's logits were NaN, -1 for none).

    A row is done after its eos_token_id or its limit, or at NaN logits; later positions
    hold eos_token_id (0 without one). With `stream`, each step's tokens [b] reach the host
    through an ordered io_callback: one program still runs the whole decode (no per-segment
    dispatch, as a loop run in compiled segments would need), and the non-streaming program
    has no host sync.
    """
    weights = model.decode_weights(plan.steps)
    vocab = model.config.vocab_size
    stop = -1 if eos_token_id is None else eos_token_id
    pad = 0 if eos_token_id is None else eos_token_id
    b = first.shape[0]
    failed = jnp.where(first < 0, 0, -1)
    first = jnp.where(first < 0, pad, first)
    if stream:
        io_callback(_emit, None, stream_id, 0, first, ordered=True)
    out = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
    rows = jnp.arange(b)
    # Each row's count of each new token so far, for the penalties (None without them)
    counts = (jnp.zeros((b, vocab), jnp.int32).at[rows, first].add((failed < 0).astype(jnp.int32))
              if sampling.penalties else None)

    def cond(carry):
        i, _, _, done, _, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, cache, done, out, failed, counts = carry
        logits, cache = model.step(token, cache, weights, plan.steps)
        logits = logits[:, :vocab]
        token = _sample(logits, token_keys(streams, i), settings, sampling, i, token, counts)
        nan = _picked_nan(logits, token) & ~done
        failed = jnp.where(nan, i, failed)
        token = jnp.where(done | nan, pad, token)
        if stream:
            io_callback(_emit, None, stream_id, i, token, ordered=True)
        if counts is not None:
            counts = counts.at[rows, token].add((~done).astype(jnp.int32))
        done = done | nan | (token == stop) | (i + 1 >= limits)
        return i + 1, token, cache, done, out.at[:, i].set(token), failed, counts

    carry = (jnp.int32(1), first, cache, (failed >= 0) | (first == stop) | (limits <= 1), out,
             failed, counts)
    _, _, cache, _, out, failed, _ = jax.lax.while_loop(cond, body, carry)
    return out, cache, failed


@functools.cache
def _jit_decode(compiler_options: tuple):
    """The decode loop jitted with these XLA compiler options ((name, value) pairs; the
    cache donated), one jit (and so one compile cache) per set of options."""
    return jax.jit(_decode_loop, donate_argnames=("cache",),
                   compiler_options=dict(compiler_options),
                   static_argnames=("max_new_tokens", "sampling", "eos_token_id",
                                    "stream", "plan"))


def _per_row(name, value, b, dtype, off):
    """A setting given as None, a number or a sequence [b] -> (array [b], any row uses it)."""
    if value is None:
        return np.full((b,), off, dtype), False
    given = np.asarray(value)
    if np.issubdtype(dtype, np.integer) and given.size and not (
            np.issubdtype(given.dtype, np.integer)):
        # a float was truncated (prompt_lengths 2.5 read as 2)
        raise ValueError(f"generate: {name}={value} must be integers")
    arr = np.broadcast_to(np.asarray(value, dtype), (b,)) if np.ndim(value) == 0 else \
        np.asarray(value, dtype)
    if arr.shape != (b,):
        raise ValueError(f"generate: {name} has shape {arr.shape}; give a number or one "
                         f"value per row, shape ({b},)")
    return arr, bool(np.any(arr != off))


def _check(model, input_ids, max_new_tokens, temperature, top_k, top_p, prompt_lengths,
           max_new_tokens_per_row, ssm_state_dtype="float32", step_implementation="auto",
           top_p_decay=None, top_p_bound=None, banned_after=None, presence_penalty=None,
           frequency_penalty=None, logit_bias=None):
    """Validate generate's arguments; -> (Settings, Sampling, prompt_lengths, limits)."""
    check_causal(model.config)  # a bidirectional layer has no step
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be [batch, seqlen >= 1], got "
                         f"{input_ids.shape}")
    b, l = input_ids.shape
    if step_implementation not in STEP_IMPLEMENTATIONS:
        raise ValueError(f"generate: step_implementation={step_implementation!r}; use one of "
                         f"{STEP_IMPLEMENTATIONS}")
    if ssm_state_dtype not in SSM_STATE_DTYPES:
        raise ValueError(f"generate: ssm_state_dtype={ssm_state_dtype!r}; use one of "
                         f"{SSM_STATE_DTYPES}")
    if not 1 <= max_new_tokens <= MOST_NEW_TOKENS:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be in [1, "
                         f"{MOST_NEW_TOKENS}]: the output (and a hybrid model's KV cache) is "
                         "allocated for all of them before decoding starts")

    def per_row(name, value, dtype, off):
        try:
            return _per_row(name, value, b, dtype, off)
        except OverflowError:
            raise ValueError(f"generate: {name}={value} does not fit {np.dtype(dtype).name}") \
                from None

    t, sampled = per_row("temperature", temperature, np.float32, 0.0)
    if not np.all(np.isfinite(t) & (t >= 0)):
        raise ValueError(f"generate: temperature={temperature} must be a finite number >= 0 "
                         "(0 is greedy)")
    vocab = model.config.vocab_size
    k, use_k = per_row("top_k", top_k, np.int32, 0)
    if top_k is not None and not np.all((k >= 0) & (k <= vocab)):
        raise ValueError(f"generate: top_k={top_k} must be in [0, vocab_size={vocab}] (0 is "
                         "off) or None")
    p, use_p = per_row("top_p", top_p, np.float32, 1.0)
    if top_p is not None and not np.all((p > 0.0) & (p <= 1.0)):
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1] or None")
    if prompt_lengths is not None:
        prompt_lengths, _ = per_row("prompt_lengths", prompt_lengths, np.int32, 0)
        if not np.all((prompt_lengths >= 1) & (prompt_lengths <= l)):
            raise ValueError(f"generate: prompt_lengths={prompt_lengths.tolist()} must each "
                             f"be in [1, seqlen={l}]")
    _check_ids(model, input_ids, prompt_lengths)
    if prompt_lengths is not None and np.any(prompt_lengths < l) and learned_state(model):
        raise _learned_state_padding("generate", "prompt_lengths")
    limits, _ = per_row("max_new_tokens_per_row", max_new_tokens_per_row, np.int32,
                        max_new_tokens)
    if not np.all((limits >= 1) & (limits <= max_new_tokens)):
        raise ValueError(f"generate: max_new_tokens_per_row={limits.tolist()} must each be "
                         f"in [1, max_new_tokens={max_new_tokens}]")
    decay, use_decay = per_row("top_p_decay", top_p_decay, np.float32, 0.0)
    bound, _ = per_row("top_p_bound", top_p_bound, np.float32, 0.0)
    if not np.all((decay >= 0) & (decay <= 1) & (bound >= 0) & (bound <= 1)):
        raise ValueError(f"generate: top_p_decay={top_p_decay} and top_p_bound={top_p_bound} "
                         "must be in [0, 1] (0: off)")
    if top_p is None and (use_decay or np.any(bound > 0)):  # Megatron's: no top_p, no decay
        raise ValueError(f"generate: top_p_decay={top_p_decay} and top_p_bound={top_p_bound} "
                         "change top_p, which is None (off); give top_p (1.0: from no filter)")
    if banned_after is not None and (not isinstance(banned_after, (tuple, list))
                                     or len(banned_after) != 2):
        raise ValueError(f"generate: banned_after={banned_after!r} must be a pair (after, "
                         "banned), each a token id or one per row")
    after, banned = banned_after if banned_after is not None else (None, None)
    after, use_ban = per_row("banned_after", after, np.int32, -1)
    banned, _ = per_row("banned_after", banned, np.int32, -1)
    presence, use_presence = per_row("presence_penalty", presence_penalty, np.float32, 0.0)
    frequency, use_frequency = per_row("frequency_penalty", frequency_penalty, np.float32, 0.0)
    if not np.all(np.isfinite(presence) & np.isfinite(frequency)):
        raise ValueError(f"generate: presence_penalty={presence_penalty} and "
                         f"frequency_penalty={frequency_penalty} must be finite numbers")
    penalties = use_presence or use_frequency
    bias = dense_logit_bias(logit_bias, b, vocab)
    # A decaying top_p filters even where it starts at 1.
    sampling = Sampling(greedy=not sampled, top_k=sampled and use_k,
                        top_p=sampled and (use_p or use_decay),
                        top_p_decay=sampled and use_decay, banned_after=use_ban,
                        penalties=penalties, logit_bias=bias is not None)
    return (Settings(t, k, p, decay, bound, after, banned, presence if penalties else None,
                     frequency if penalties else None, bias),
            sampling, prompt_lengths, limits)


def dense_logit_bias(logit_bias, rows: int, vocab: int) -> np.ndarray | None:
    """generate's logit_bias (None; a mapping {token id: bias} for every row; or a sequence of
    one per row, each a mapping or None) -> [rows, vocab] float32 to add to the logits, or
    None where no row has a bias. A ValueError for ids outside [0, vocab) or biases that are
    not finite."""
    if logit_bias is None:
        return None
    per_row = [logit_bias] * rows if hasattr(logit_bias, "items") else list(logit_bias)
    if len(per_row) != rows or not all(m is None or hasattr(m, "items") for m in per_row):
        raise ValueError(f"generate: logit_bias must be a mapping {{token id: bias}} or one "
                         f"per row ({rows}), each a mapping or None")
    dense = np.zeros((rows, vocab), np.float32)
    for row, mapping in zip(dense, per_row):
        for token, value in (mapping or {}).items():
            if not (isinstance(token, (int, np.integer)) and 0 <= token < vocab):
                raise ValueError(f"generate: logit_bias has token {token!r}; token ids are "
                                 f"integers in [0, vocab_size={vocab})")
            if not np.isfinite(np.float32(value)):
                raise ValueError(f"generate: logit_bias[{token}]={value!r} must be a finite "
                                 "number")
            row[token] += value
    return dense if dense.any() else None


def _check_ids(model, input_ids, prompt_lengths, where="generate"):
    """Refuse token ids that are no integers, or (where the ids are on this host) outside
    the embedding's rows, which its gather would clamp to another token, silently. Each
    row's prompt only: its left padding (before prompt_lengths) is never read."""
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"{where}: input_ids must be integer token ids, got {input_ids.dtype}")
    if not getattr(input_ids, "is_fully_addressable", True):
        return
    ids = np.asarray(input_ids)
    b, l = ids.shape
    first = np.zeros(b, np.int32) if prompt_lengths is None else l - prompt_lengths
    prompt = ids[np.arange(l)[None, :] >= first[:, None]]
    rows = model.config.padded_vocab_size
    outside = prompt[(prompt < 0) | (prompt >= rows)]
    if outside.size:
        raise ValueError(f"{where}: input_ids hold {np.unique(outside)[:8].tolist()}, outside "
                         f"the model's token ids [0, {rows}): were they made by another "
                         "model's tokenizer?")


@functools.partial(jax.jit, static_argnames=("top_n",))
def _score(model, input_ids, prompt_lengths, *, top_n):
    """token_logprobs' program (the model a pytree, as generate's)."""
    seq_idx = _prompt_documents(input_ids, prompt_lengths)
    logits = model(input_ids, seq_idx=seq_idx)[:, :-1, :model.config.vocab_size]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    return chosen, jax.lax.top_k(logp, top_n) if top_n else None


def token_logprobs(model, input_ids, lengths=None, top_n: int = 0):
    """The model's log-probabilities of each token after the first: input_ids [b, l] (left
    padded: row r's tokens are its last lengths[r], default all l) -> (logprobs [b, l - 1]
    float32, log p(input_ids[:, j + 1] | input_ids[:, :j + 1]) from the raw logits (no
    temperature; Megatron-LM's logprobs), and with top_n > 0 the top_n most likely tokens'
    (log-probabilities, ids) [b, l - 1, top_n] each, else None). Positions in the padding
    are meaningless. One forward pass, compiled per (shapes, top_n); a ValueError where a
    row's own positions have NaN log-probabilities."""
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"token_logprobs: input_ids must be [batch, seqlen >= 2] (each token "
                         f"after the first is scored), got {input_ids.shape}")
    b, l = input_ids.shape
    if lengths is None:
        lengths = np.full((b,), l, np.int32)
    else:
        given = np.asarray(lengths)
        if not (np.issubdtype(given.dtype, np.integer) and given.shape == (b,)
                and np.all((given >= 1) & (given <= l))):
            raise ValueError(f"token_logprobs: lengths={np.asarray(lengths).tolist()} must be "
                             f"{b} integers in [1, seqlen={l}], one a row")
        lengths = given.astype(np.int32)
    if not 0 <= top_n <= model.config.vocab_size:
        raise ValueError(f"token_logprobs: top_n={top_n} must be in [0, vocab_size="
                         f"{model.config.vocab_size}]")
    if np.any(lengths < l) and learned_state(model):
        raise _learned_state_padding("token_logprobs", "lengths")
    _check_ids(model, input_ids, lengths, "token_logprobs")
    chosen, top = _score(model, input_ids.astype(jnp.int32), lengths, top_n=top_n)
    # position j scores token j + 1 given the tokens to j: a row's own from l - length on
    nan = np.isnan(np.asarray(chosen)) & (np.arange(l - 1)[None, :] >= (l - lengths)[:, None])
    if np.any(nan):
        rows = np.flatnonzero(nan.any(axis=1))
        raise _nan_logits("token_logprobs", f"position {np.argmax(nan[rows[0]])}", rows)
    return chosen, top


def checkpoint_dir(checkpoint):
    """checkpoint as a Path, a FileNotFoundError naming it where it is no folder or is one
    step of a trainer's --checkpoint-dir (checked without reading the model)."""
    from pathlib import Path

    from mamba_jax.files import holds_model, holds_steps

    path = Path(checkpoint)
    if not path.is_dir():
        what = "a file, not a folder" if path.exists() else "no such directory"
        raise FileNotFoundError(f"--checkpoint {path}: {what}; give the folder of a saved model "
                                "(its config.json and weights) or a trainer's --checkpoint-dir")
    if path.name.isdigit() and holds_steps(path.parent) and not holds_model(path):
        raise FileNotFoundError(f"--checkpoint {path} is step {path.name} of the trainer's "
                                f"--checkpoint-dir {path.parent}: give that folder (its newest "
                                f"step), or export this step with `python -m mamba_jax.convert "
                                f"{path.parent} OUT --step {path.name} --to hf`")
    return path


def load_for_generation(checkpoint, tokenizer=None, dtype="float32"):
    """(model, tokenizer, eos_token_id) from a checkpoint dir: a model dir (HF or mamba_ssm;
    its tokenizer.json or tokenizer.model unless `tokenizer`, a path or 'bytes', is given) or
    a trainer's --checkpoint-dir (its newest step; `tokenizer`, else the run's, else bytes).
    eos is
    config.json's eos_token_id, else the tokenizer's end-of-sequence token
    (tokenizer.special_tokens), else None."""
    # Imported here: the package imports this module, and `python -m mamba_jax.convert`
    # must not find convert already imported (runpy warns).
    import json

    from mamba_jax.convert import (from_pretrained, is_training_checkpoint, load_config,
                                   training_tokenizer)
    from mamba_jax.init_from import load_training_checkpoint
    from mamba_jax.tokenizer import find_tokenizer, load_tokenizer, special_token_ids

    path = checkpoint_dir(checkpoint)
    if is_training_checkpoint(path):
        model, meta = load_training_checkpoint(path, dtype=jnp.dtype(dtype))
        tok = load_tokenizer(tokenizer or training_tokenizer(path, meta))
        eos = None
    else:  # its config read first: a folder without a model is named so, not by its tokenizer
        load_config(path)
        tok = load_tokenizer(tokenizer or find_tokenizer(path) or path / "tokenizer.json")
        model = from_pretrained(path, dtype=jnp.dtype(dtype))
        eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
    if not isinstance(eos, int):
        eos = special_token_ids(tok)["eos_token_id"]
    # An HF config.json's vocab_size is the embedding's rows, padded past the tokenizer's
    # ids (a trainer's export of a 301-token tokenizer says 304): generation samples and
    # scores only the ids the tokenizer has, as from the trainer's own checkpoint, whose
    # config keeps the tokenizer's size. The padded rows (the weights' shape) stay.
    cfg = model.config
    if tok.get_vocab_size() > cfg.padded_vocab_size:  # its ids past the rows: other tokens
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens, more than the "
                         f"{cfg.padded_vocab_size} rows of {path}'s embedding: give the "
                         "tokenizer the model was trained with")
    if tok.get_vocab_size() < cfg.vocab_size:
        model.config = cfg.replace(vocab_size=tok.get_vocab_size(),
                                   pad_vocab_size_multiple=cfg.padded_vocab_size)
    return model, tok, eos


def add_decode_arguments(parser):
    """The generate and serve CLIs' options for how a decode step runs (decode_options)."""
    parser.add_argument("--ssm-state-dtype", choices=SSM_STATE_DTYPES, default="float32",
                        help="what the decoding cache stores the SSM states in (bfloat16: as "
                             "mamba_ssm's cache, half the bytes per step; int8: with a float32 "
                             "scale per headdim channel, about half bf16's, for large "
                             "batches)")
    parser.add_argument("--step-implementation", choices=STEP_IMPLEMENTATIONS, default="auto",
                        help="the Mamba layers' decode step: XLA fusions or Pallas kernels "
                             "(triton); auto: the kernels on a GPU, where they were faster at "
                             "every batch measured (BENCHMARKS.md)")


def decode_options(args) -> dict:
    """generate's keyword arguments from add_decode_arguments' parsed options."""
    return dict(ssm_state_dtype=args.ssm_state_dtype,
                step_implementation=args.step_implementation)


class Prepared(NamedTuple):
    """A generate call's validated arguments, as its two programs take them (prepare)."""

    settings: Settings
    sampling: Sampling
    prompt_lengths: np.ndarray | None
    limits: np.ndarray  # new tokens each row may generate [b]
    max_new_tokens: int
    plan: DecodePlan
    cache_len: int | None  # slots of the caches that grow with the tokens, if any
    ssm_state_dtype: str


def prepare(model, input_ids, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None, *,
            prompt_lengths=None, max_new_tokens_per_row=None, ssm_state_dtype="float32",
            step_implementation="auto", top_p_decay=None, top_p_bound=None,
            banned_after=None, presence_penalty=None, frequency_penalty=None,
            logit_bias=None) -> Prepared:
    """generate's arguments validated (a ValueError naming the one that is wrong) and its
    decode plan chosen (mamba_jax.generate.plan)."""
    input_ids = jnp.asarray(input_ids)
    settings, sampling, prompt_lengths, limits = _check(
        model, input_ids, max_new_tokens, temperature, top_k, top_p, prompt_lengths,
        max_new_tokens_per_row, ssm_state_dtype, step_implementation, top_p_decay,
        top_p_bound, banned_after, presence_penalty, frequency_penalty, logit_bias)
    b, l = input_ids.shape
    return Prepared(settings, sampling, prompt_lengths, limits, int(max_new_tokens),
                    decode_plan(model, b, step_implementation,
                                ssm_state_dtype=ssm_state_dtype),
                    l + max_new_tokens if model.cache_grows else None, ssm_state_dtype)


def prefill(model, input_ids, prepared: Prepared, seed=0):
    """The first program: the prompt input_ids [b, l] -> (the first new token [b], -1 where
    the row's logits are NaN (decode raises for it), the cache after the prompt, as the
    decode loop carries it)."""
    # The model goes to both programs as the pytree it is (flax's Modules are pytrees): its
    # structure keys the compile cache through a treedef that hashes quickly, where
    # nnx.split and a static GraphDef cost far more a call on the host for a 48-layer model
    # (BENCHMARKS.md, row G1), before the GPU starts.
    p = prepared
    return _prefill(model, jnp.asarray(input_ids), p.prompt_lengths,
                    row_streams(seed, len(p.limits)),
                    p.settings, sampling=p.sampling, plan=p.plan, cache_len=p.cache_len,
                    ssm_state_dtype=p.ssm_state_dtype)


def decode(model, first, cache, prepared: Prepared, seed=0, eos_token_id=None, *,
           on_token=None, compiler_options=DECODE_COMPILER_OPTIONS):
    """The second program: prefill's (first, cache) -> the new tokens [b, max_new_tokens]
    int32 (generate's stopping and streaming); a ValueError where a row's logits were NaN
    (its stream, if any, got padding from there on). The cache is donated.
    compiler_options: the decode loop's XLA options (DECODE_COMPILER_OPTIONS: one CUDA graph
    on a GPU)."""
    p = prepared
    stream_id = -1
    if on_token is not None:
        stream_id = next(_STREAM_IDS)
        _STREAMS[stream_id] = on_token
    try:
        out, _, failed = _jit_decode(tuple(sorted(compiler_options.items())))(
            model, first, cache, row_streams(seed, len(p.limits)), p.settings, p.limits,
            np.int32(stream_id), max_new_tokens=p.max_new_tokens, sampling=p.sampling,
            eos_token_id=eos_token_id, stream=on_token is not None, plan=p.plan)
        if on_token is not None:
            jax.effects_barrier()  # every callback has run before the stream is dropped
    finally:
        _STREAMS.pop(stream_id, None)
        failure = _FAILURES.pop(stream_id, None)
    if failure is not None:
        raise failure
    failed = np.asarray(failed)
    if np.any(failed >= 0):
        rows = np.flatnonzero(failed >= 0)
        raise _nan_logits("generate", f"new token {failed[rows[0]]}", rows)
    return out


def generate(model, input_ids, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
             seed=0, eos_token_id=None, *, prompt_lengths=None, max_new_tokens_per_row=None,
             on_token=None, ssm_state_dtype="float32", step_implementation="auto",
             top_p_decay=None, top_p_bound=None, banned_after=None, presence_penalty=None,
             frequency_penalty=None, logit_bias=None):
    """input_ids [b, l] -> [b, l + max_new_tokens] int32: the prompt and its continuation.

    temperature, top_k, top_p: a number for all rows, or one value per row (see
    sample_logits). Rows that emit eos_token_id continue with eos_token_id (0 without one)
    and so do rows past their max_new_tokens_per_row ([b], default max_new_tokens); the loop
    ends early once every row is done.

    prompt_lengths [b]: for left-padded input_ids, row r's prompt is
    input_ids[r, l - prompt_lengths[r]:]. The padding is given its own document, so it
    cannot affect the state: each row continues exactly as if generated alone.

    on_token(step, tokens [b] numpy): called from a runtime thread as each step's tokens
    are sampled (step 0 is the first new token), for streaming. An exception it raises
    ends the stream (no later step reaches it) and is raised by generate once the compiled
    loop, which runs to its end, has.

    top_p_decay, top_p_bound (a number or [b], 0: off): Megatron-LM's decaying top-p, new
    token i sampled with max(top_p * top_p_decay**i, top_p_bound). banned_after (after,
    banned), each a token id or [b] (-1: off): the token right after `after` is never
    `banned` (Megatron's prevent_newline_after_colon bans "\n" after ":").

    presence_penalty, frequency_penalty (a number or [b], 0: off): OpenAI's, over each
    row's new tokens: before new token i, logits[t] -= presence * (count[t] > 0) +
    frequency * count[t], count[t] being how often t is among new tokens 0..i-1. logit_bias:
    {token id: bias} added to every row's logits, or one mapping (or None) per row. Both
    apply before top_k, top_p and the temperature (and greedy's argmax).

    seed: an integer, row r sampling from fold_in(key(seed), r) (two rows of one prompt
    sample differently), or one per row [b], row r sampling as it would alone with seed[r]
    (row_streams); new token i with that key folded with i. A row's samples depend on its
    seed, its prompt and its settings, never on the other rows.

    ssm_state_dtype: "float32" (the default), "bfloat16" or "int8", what the decoding cache
    stores the SSM states in between tokens; each step computes in float32 either way.
    "bfloat16" is what mamba_ssm's cache holds for a bf16 model: it halves the bytes a step
    moves, which at large batches are mostly states (bench/generate.py), and rounds the
    state at every token. "int8" stores each headdim channel's d_state values as int8 with
    a float32 scale (pallas_kernels.ssd.step.Int8State), quantised afresh from float32 at
    every token: about half bf16's bytes at d_state 128, each value off by at most half its
    row's step (max / 254). Its steps never run fused (mamba_jax.generate.plan): it is for
    large batches.

    step_implementation: "auto" (the default), "xla" or "triton": each layer's one-token
    step as XLA fusions, or as Pallas kernels: at batch 1 every layer as its fused kernels
    (a Mamba block in two kernels on a GPU that holds the second's programs at once, else
    three; an attention or MLP block in two), at larger batches a Mamba layer's conv and
    SSM update as one kernel between XLA's projections. "auto" takes "triton" on a GPU
    where the kernels take the model's shapes, by measurement (mamba_jax.generate.plan).

    Two programs, prefill then decode (`prepare`, `prefill` and `decode` run them one at a
    time), each compiled once per (model structure, shapes, max_new_tokens, which sampling
    filters are used, eos_token_id, streaming or not, ssm_state_dtype, decode plan); the
    settings' values and the prompts are data.
    """
    integer = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
    for name, value, may_be_none in (("max_new_tokens", max_new_tokens, False),
                                     ("eos_token_id", eos_token_id, True)):
        if not (integer(value) or may_be_none and value is None):
            # one eos id: an HF config's list of them is a common mistake
            raise ValueError(f"generate: {name}={value!r} must be an integer"
                             + (" (one token id) or None" if may_be_none else ""))
    per_row = isinstance(seed, (list, tuple, np.ndarray))
    seeds = np.asarray(seed, object).ravel().tolist() if per_row else [seed]
    if not all(integer(s) for s in seeds) or per_row and len(seeds) != np.shape(input_ids)[0]:
        raise ValueError(f"generate: seed={seed!r} must be an integer, or one per row")
    if not all(-2**63 <= s < 2**63 for s in seeds):
        raise ValueError(f"generate: seed={seed} must fit 64 bits")
    if eos_token_id is not None and not 0 <= eos_token_id < 2**31:  # the tokens' int32
        raise ValueError(f"generate: eos_token_id={eos_token_id} is no token id (0 to "
                         f"2**31 - 1)")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"generate: on_token={on_token!r} must be a function (step, tokens) "
                         "or None")
    input_ids = jnp.asarray(input_ids)
    prepared = prepare(model, input_ids, max_new_tokens, temperature, top_k, top_p,
                       prompt_lengths=prompt_lengths,
                       max_new_tokens_per_row=max_new_tokens_per_row,
                       ssm_state_dtype=ssm_state_dtype, step_implementation=step_implementation,
                       top_p_decay=top_p_decay, top_p_bound=top_p_bound,
                       banned_after=banned_after, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, logit_bias=logit_bias)
    first, cache = prefill(model, input_ids, prepared, seed)
    out = decode(model, first, cache, prepared, seed, eos_token_id, on_token=on_token)
    return jnp.concatenate([input_ids.astype(jnp.int32), out], axis=1)
