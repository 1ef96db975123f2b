"""The server's engine: continuous batching over a fixed set of decode slots. Token ids in,
token events out; the HTTP side (mamba_jax.serve, its protocols mamba_jax.openai_api and
mamba_jax.megatron_api) tokenizes, cuts at stop strings and writes the JSON.

    engine = Engine(model, tokenizer, Limits(), eos_token_id, slots=64)
    task = asyncio.create_task(engine.run())              # the engine loop
    seq = engine.submit(prompt_ids, SamplingParams(max_new_tokens=16, temperature=0.7))
    async for event in seq: ...                           # TokenEvents as they are sampled
    seq.finish_reason                                     # "stop", "length" or "cancelled"
    await engine.score([ids, ...], top_n=2)               # each token's log p after the first
    engine.stats()                                        # what /metrics shows

The interface:
- `submit(prompt_ids, params)` -> Sequence; raises Busy (a 503 at the API) when the queue
  would hold more than `limits.max_queued_tokens` prompt and new tokens, and ValueError for
  a request the engine cannot run (an empty prompt, max_new_tokens < 1, a hybrid's prompt
  and new tokens past its attention keys a slot, `kv_tokens`; settings out of range: the API
  validates first, this is the backstop).
- `Sequence`: `async for event in seq` gives its TokenEvents as they are sampled (the stop
  token, eos or one of params.stop_token_ids, is not given); then `finish_reason` is "stop",
  "length" or "cancelled" ("error" where the iteration raised GenerationError: the model's
  logits were NaN, or its prompt's prefill failed). `seq.cancel()` (the client left) or
  `seq.cancel("stop")` (a stop string was found) ends it: its iteration ends and its slot
  is freed at the engine's next step.
- `score(sequences, top_n)` -> per sequence, per token from position 1 on, (log p of the
  token given the tokens before it, the top_n most likely tokens' ((id, log p), ...)), from
  the raw logits' log-softmax (no temperature): echo and Megatron's logprobs.
- `stats()` -> dict, the numbers behind /metrics:
    "queued": sequences waiting for a slot (prefilling ones included); "queued_tokens": the
    prompt and new tokens of those not yet prefilling (what `max_queued_tokens` bounds);
    "slots_busy", "slots": sequences decoding, and the most that decode at once;
    "tokens_generated": new tokens since the start; "tokens_per_second": new tokens a
    second over the last STATS_WINDOW_S seconds;
    "requests_finished": {"stop": n, "length": n, "cancelled": n, "error": n} (a sequence
    that a stop string ended counts as "stop");
    "prefix_cache_hits", "prefix_cache_lookups": prompts that started from a cached
    prefix's states, and prompts long enough to (a prefill chunk and a token or more);
    "prefix_cache_bytes", "prefix_cache_entries"; "prefill_tokens": prompt tokens
    prefilled (a cached prefix's are not);
    "ttft_seconds": time to first token (submit to the first TokenEvent) and
    "tpot_seconds": time per output token after the first (a finished sequence's time from
    its first token to its last over its tokens less one), each a histogram as
    Prometheus's: {"buckets": ((upper bound, cumulative count), ..., (inf, count)),
    "sum": seconds, "count": observations}.

Sampling per sequence (SamplingParams): a sequence with a `seed` samples the same tokens
for the same prompt and settings whatever runs beside it, and the same as
`mamba_jax.generate` of that one prompt with that seed (its row 0's stream,
generate.row_streams); without one, a random seed. presence_penalty and frequency_penalty
follow OpenAI's definition over the sequence's new tokens, `logits[t] -= presence *
(count[t] > 0) + frequency * count[t]`, and logit_bias adds to the logits, both before the
filters and the temperature (generate's, the same code); logprobs are the raw logits'.

How it runs. Legend: S slots, R staging rows, C the prefill chunk, G = GRANULE, v vocab.

- **Slots.** Each decoding sequence owns a row of one batched decoding cache (a Mamba
  layer's conv window and SSM state, a fixed size; an attention layer's keys and values for
  `kv_tokens` tokens and its own count of them), of its sampling settings (generate's
  Settings, one row a slot; logit_bias as a dense [S, v] row), its PRNG stream, its new
  tokens' counts [S, v] (the penalties'), and the prompt tokens still to feed. One compiled
  program runs `steps_per_dispatch` decoding steps of every slot (a while loop, one CUDA
  graph on a GPU, the decode plan's step implementations); an idle slot steps garbage that
  nothing reads. The host dispatches the next program before it reads the last one's
  tokens, so the GPU works while the host hands tokens out and admits requests; a sequence
  that ends by its length frees its slot before its last dispatch is read, one that ends
  by a stop token when it is read.
- **Capacity.** The slots run as a batch of the power of two above those in use (at most
  `slots`): one client decodes at batch 1 (the fused kernels), not at 64. The batch grows
  as sequences come, and shrinks (the busy rows moved to the front) once a quarter of it or
  less has been in use for SHRINK_AFTER_S; each size is a program of its own.
- **Prefill.** A new prompt waits for a slot, then takes a staging row (R of them: the
  prefill's own batch of caches, in the prefill's form, float32 states). Its tokens but the
  last are prefilled in chunks, `Mamba2LM.prefill(ids, cache=...)` continuing from the
  row's state, batched over the staging rows with a chunk of the same length; up to R x C
  prompt tokens each engine step, between decode dispatches, and while sequences decode
  (each round stalls them) a round at most every `prefill_interval_ms` unless R prompts
  wait. Chunk lengths are G times a
  power of two, at most C, and end on multiples of C (so the prefix cache's entries do): a
  fresh prompt of C tokens or fewer is one chunk left-padded to its bucket (the padding its
  own document, as generate's), a longer one or one continuing a cached prefix runs exact
  chunks, and the last fewer than G tokens of those, with the prompt's last token, are fed
  to the decode steps, whose first sample after the prompt is its first new token. A model
  whose layers cannot continue a state (Mamba-1, Mamba-3) prefills each prompt as one
  chunk. Then a jitted, donated scatter writes the row into a free slot (its SSM state in
  `ssm_state_dtype`, its attention keys moved to start at 0).
- **Prefix cache.** The states at every multiple of C along a prompt (the chunks' ends)
  are kept in an LRU bounded by `prefix_cache_mb` (0: off), keyed by the prefix's token
  ids (a hash chained over its chunks; the ids compared on a hit). A prompt that extends a
  cached prefix starts its staging row from the entry and prefills only the rest. A
  hybrid's entry holds its attention keys and values of the prefix.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import random
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mamba_jax.generate import (DECODE_COMPILER_OPTIONS, Sampling, Settings, _picked_nan,
                                _sample, alone_streams, learned_state, seed_words,
                                token_keys, token_logprobs)
from mamba_jax.generate.plan import decode_plan
from mamba_jax.layers.attention import AttentionCache

log = logging.getLogger("mamba_jax.engine")

GRANULE = 16  # prefill chunks are multiples of this; fewer prompt tokens go to the steps
MAX_TOP_LOGPROBS = 20  # the most likely tokens a sequence's events list at most (OpenAI's)
STATS_WINDOW_S = 10.0  # tokens_per_second's window
SHRINK_AFTER_S = 1.0  # a quarter or less of the batch in use this long: it shrinks
# Prometheus histogram bounds, seconds: time to first token and time per output token
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server accepts: a prompt's tokens, a sequence's new tokens, prompts a
    request, and the prompt and new tokens of every queued sequence together."""

    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    max_prompts: int = 64  # per request
    # 64 of the longest requests (64 x (2048 + 1024)) fit; more waits for the clients to
    # retry.
    max_queued_tokens: int = 1 << 18


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the engine batches (`serve --slots ...`; add_engine_arguments)."""

    slots: int = 64  # sequences that decode at once
    steps_per_dispatch: int = 4  # decoding steps a compiled program runs
    prefill_chunk: int = 256  # C: the longest prefill chunk; G times a power of two
    prefill_rows: int = 16  # R: prompts that prefill at once (the staging rows)
    # While sequences decode, a prefill round starts at most this often (unless R prompts
    # wait): each round stalls every decoding slot for its time, much of which does not
    # grow with its rows, so a few prompts share it
    prefill_interval_ms: float = 30.0
    prefix_cache_mb: float = 1024.0  # the prefix cache's bound; 0: no prefix cache
    kv_tokens: int | None = None  # attention keys a slot holds; None: the limits' prompt
    # and new tokens


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off (the API refuses top_k above the vocabulary)
    top_p: float = 1.0
    top_p_decay: float = 0.0  # Megatron: top_p at new token i = max(top_p * decay**i, bound)
    top_p_bound: float = 0.0
    seed: int | None = None  # None: a random one
    presence_penalty: float = 0.0  # OpenAI's, over the sequence's new tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    banned_after: tuple[int, int] | None = None  # (after, banned): never banned right after
    stop_token_ids: tuple[int, ...] = ()  # besides the engine's eos; never returned
    logprobs: int | None = None  # None: none; k >= 0: each token's log p and the top k


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None  # None unless the sequence's params.logprobs is set
    top_logprobs: tuple[tuple[int, float], ...] | None  # ((id, log p), ...) most likely first


class Busy(Exception):
    """The queue is full: retry shortly (a 503 at the API)."""


class GenerationError(RuntimeError):
    """A sequence's generation failed (NaN logits): the model's fault, not the request's."""


class Histogram:
    """A Prometheus histogram of observations (seconds): counts per bucket, and the sum."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        cumulative = np.cumsum(self.counts).tolist()
        return {"buckets": tuple(zip((*self.bounds, math.inf), cumulative)),
                "sum": self.sum, "count": cumulative[-1]}


class Sequence:
    """One prompt's continuation: iterate it for its TokenEvents; finish_reason once it
    ends. Made by Engine.submit; its state changes on the event loop's thread only."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams):
        self.engine, self.prompt_ids, self.params = engine, list(prompt_ids), params
        self.events: list[TokenEvent] = []  # the TokenEvents so far (no stop token's)
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self._events: asyncio.Queue = asyncio.Queue()  # TokenEvents, then None at the end
        self.cancelled = False  # read by the engine's thread

    @property
    def tokens(self) -> list[int]:
        """The new token ids so far."""
        return [event.token_id for event in self.events]

    @property
    def cost(self) -> int:
        """What it holds of the queue: its prompt and new tokens."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    def cancel(self, finish_reason: str = "cancelled"):
        """End it now: no more events, its slot freed at the engine's next step.
        finish_reason: "cancelled" (the client left) or "stop" (a stop string was found),
        what stats() counts it as; a sequence that a stop string ends after it ended by its
        length counts as "stop" (as its client was told)."""
        self.cancelled = True
        self.engine._swept = False  # the engine sweeps it out of its queue
        if finish_reason == "stop" and self.finish_reason == "length":
            self.engine._reasons["length"] -= 1
            self.engine._reasons["stop"] += 1
            self.finish_reason = "stop"
        self._finish(finish_reason)
        self.engine._wake()

    async def __aiter__(self):
        while (event := await self._events.get()) is not None:
            yield event
        if self.error is not None:
            raise self.error

    def _emit(self, event: TokenEvent):
        if self.finish_reason is not None:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.engine._ttft.observe(self.first_token_at - self.submitted)
        self.events.append(event)
        self._events.put_nowait(event)

    def _finish(self, reason: str, error: Exception | None = None):
        if self.finish_reason is not None:
            return
        self.finish_reason, self.error = reason, error
        self.engine._finished(self)
        self._events.put_nowait(None)


# ------------------------------------------------------------------ the device's programs
# Each takes the model's arrays (params: its pytree's leaves) and its treedef (static: it
# keys the compile cache), and shapes bucketed by the host, so that a few programs serve
# any load.


def _rows_of(tree, rows):
    """Every array of tree (leading dim: rows of a batch) at `rows` (clipped)."""
    return jax.tree.map(lambda a: jnp.take(a, rows, axis=0, mode="clip"), tree)


def _set_rows(tree, rows, values):
    """tree with `rows` set to values' rows (a row index past the end writes nothing)."""
    return jax.tree.map(lambda a, x: a.at[rows].set(x.astype(a.dtype), mode="drop"), tree,
                        values)


def _per_row_lengths(cache, b):
    """A cache's attention counts of tokens as one a row [b] (prefill gives one for all)."""
    return tuple(c._replace(length=jnp.broadcast_to(c.length, (b,)).astype(jnp.int32))
                 if isinstance(c, AttentionCache) else c for c in cache)


def _blank(model, rows: int, kv_len: int):
    """The cache a prompt starts from, rows of it, in the prefill's form (the learned
    initial state where the model has one), attention keys for kv_len tokens."""
    return _per_row_lengths(model.init_cache(rows, kv_len), rows)


def _kv_len(cache) -> int:
    """The attention keys a row of cache holds (0 for a model without attention)."""
    return max((c.k.shape[1] for c in cache if isinstance(c, AttentionCache)), default=0)


def _staged(model, staging, rows, fresh):
    """The staging rows `rows` [B], blank where fresh [B] (a prompt that starts now)."""
    return jax.tree.map(lambda s, z: jnp.where(fresh.reshape(-1, *[1] * (s.ndim - 1)), z, s),
                        _rows_of(staging, rows),
                        _blank(model, rows.shape[0], _kv_len(staging)))


@functools.partial(jax.jit, donate_argnames=("staging",), static_argnames=("tree",
                                                                          "from_state"))
def _prefill_chunk(params, staging, rows, ids, seq_idx, fresh, *, tree, from_state: bool):
    """Prefill a chunk of each staging row: ids [B, L] of the rows `rows` [B] (past the
    staging's end: a filler row), seq_idx [B, L] or None (left padding its own document),
    fresh [B] bool (the row starts blank, not from its staged state) -> the staging caches
    with those rows after the chunk. from_state: some row continues its staged state
    (else every row starts blank, and the Mamba layers may run their fused kernels)."""
    model = jax.tree.unflatten(tree, params)
    start = _staged(model, staging, rows, fresh) if from_state else None
    _, cache = model.prefill(ids, seq_idx, cache_len=_kv_len(staging), cache=start)
    return _set_rows(staging, rows, _per_row_lengths(cache, ids.shape[0]))


@functools.partial(jax.jit, donate_argnames=("slots",),
                   static_argnames=("tree", "ssm_state_dtype"))
def _insert(params, slots, staging, stage_rows, slot_rows, fresh, settings, bias_ids,
            bias_values, seeds, forced, n_forced, *, tree, ssm_state_dtype: str):
    """Write prefilled rows into decode slots: staging rows stage_rows [R] (fresh [R]: a
    blank state instead) into slots slot_rows [R] (past the end: no slot), with each new
    sequence's Settings rows [R] (logit_bias None), its logit bias as (ids, values) [R, W]
    (an id past the vocabulary: none), its seed's words [R, 2] uint32 (seed_words), the prompt
    tokens still to feed forced [R, G] and their number n_forced [R] (>= 1). The cache is
    converted to the decode loop's form (SSM states in ssm_state_dtype) and each attention
    row's keys moved to start at index 0 (its left padding dropped)."""
    model = jax.tree.unflatten(tree, params)
    r = stage_rows.shape[0]
    steps = ("xla",) * len(model.layers)  # the form without the fused steps' counters
    cache = model.cache_for_decoding(_staged(model, staging, stage_rows, fresh), steps,
                                     ssm_state_dtype)
    kv_len = _kv_len(slots.cache)

    def moved(c):
        if not isinstance(c, AttentionCache):
            return c
        index = c.start[:, None] + jnp.arange(kv_len, dtype=jnp.int32)[None]  # [R, kv_len]
        take = lambda t: jnp.take_along_axis(t, index[:, :, None, None], axis=1, mode="fill",
                                             fill_value=0)
        return AttentionCache(take(c.k), take(c.v), c.length - c.start,
                              jnp.zeros_like(c.start))
    cache = tuple(moved(c) for c in cache)
    vocab = model.config.vocab_size
    bias = jnp.zeros((r, vocab), jnp.float32).at[jnp.arange(r)[:, None], bias_ids].add(
        bias_values, mode="drop")
    new = _Slots(cache, settings._replace(logit_bias=bias),
                 jax.random.key_data(alone_streams(seeds)),
                 jnp.zeros((r, vocab), jnp.int32), jnp.zeros((r,), jnp.int32),
                 jnp.zeros((r,), jnp.int32), forced, n_forced)
    return _set_rows(slots, slot_rows, new)


class _Slots(NamedTuple):
    """The decode slots' device state, rows S each."""

    cache: tuple  # per layer, the decode loop's form without the fused steps' counters
    settings: Settings  # generate's, logit_bias [S, v]
    streams: jax.Array  # [S, 2] uint32: each sequence's PRNG key data
    counts: jax.Array  # [S, v] int32: each new token's count
    last: jax.Array  # [S] int32: the token sampled last
    t: jax.Array  # [S] int32: steps since the insert
    forced: jax.Array  # [S, G] int32: prompt tokens to feed first
    n_forced: jax.Array  # [S] int32: how many (>= 1)


def _with_counters(cache, steps):
    """The cache as the plan's steps carry it: a fused Mamba step's counter (zeros)."""
    return tuple(c._replace(sync=jnp.zeros((1,), jnp.int32))
                 if how == "fused" and hasattr(c, "sync") else c
                 for c, how in zip(cache, steps))


def _without_counters(cache):
    return tuple(c._replace(sync=None) if hasattr(c, "sync") else c for c in cache)


def _decode(params, weights, slots: _Slots, *, tree, steps: tuple, k: int,
            sampling: Sampling, top_n: int):
    """k decoding steps of every slot -> (the slots after them, per step and slot [k, S]:
    tokens int32, emitted (a new token, not a prompt token's garbage), NaN-picked (the
    logits were NaN), and with top_n >= 0 the raw log p of the token [k, S] and the top_n
    most likely (log p, ids) [k, S, top_n] each, else None)."""
    model = jax.tree.unflatten(tree, params)
    vocab = model.config.vocab_size
    s = slots.t.shape[0]
    rows = jnp.arange(s)
    streams = jax.random.wrap_key_data(slots.streams, impl="threefry2x32")

    def body(j, carry):
        cache, counts, last, t, out = carry
        token_in = jnp.where(t < slots.n_forced, slots.forced[
            rows, jnp.minimum(t, slots.forced.shape[1] - 1)], last)
        logits, cache = model.step(token_in, cache, weights, steps)
        logits = logits[:, :vocab]
        i = jnp.maximum(t - slots.n_forced + 1, 0)  # the new token this step samples
        token = _sample(logits, token_keys(streams, i), slots.settings, sampling, i, token_in,
                        counts)
        emitted = t >= slots.n_forced - 1
        if sampling.penalties:
            counts = counts.at[rows, token].add(emitted.astype(jnp.int32))
        picked = [token, emitted, _picked_nan(logits, token)]
        if top_n >= 0:
            logp = jax.nn.log_softmax(logits, axis=-1)
            picked.append(jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0])
            picked.extend(jax.lax.top_k(logp, top_n))
        out = [o.at[j].set(p) for o, p in zip(out, picked)]
        return cache, counts, token, t + 1, out

    out = [jnp.zeros((k, s), jnp.int32), jnp.zeros((k, s), bool), jnp.zeros((k, s), bool)]
    if top_n >= 0:
        out += [jnp.zeros((k, s), jnp.float32), jnp.zeros((k, s, top_n), jnp.float32),
                jnp.zeros((k, s, top_n), jnp.int32)]
    cache = _with_counters(slots.cache, steps)
    cache, counts, last, t, out = jax.lax.fori_loop(
        0, k, body, (cache, slots.counts, slots.last, slots.t, out))
    slots = slots._replace(cache=_without_counters(cache), counts=counts, last=last, t=t)
    return slots, out


# The steps as one CUDA graph on a GPU, as generate's decode loop
_decode_program = jax.jit(_decode, donate_argnames=("slots",),
                          compiler_options=DECODE_COMPILER_OPTIONS,
                          static_argnames=("tree", "steps", "k", "sampling", "top_n"))


_resize = jax.jit(_rows_of)


@functools.partial(jax.jit, static_argnames=("length",))
def _extract(staging, row, *, length: int):
    """A prefix cache entry: staging row `row`'s cache, rows 1, attention keys of its first
    `length` tokens."""
    entry = _rows_of(staging, row[None])
    return tuple(c._replace(k=c.k[:, :length], v=c.v[:, :length])
                 if isinstance(c, AttentionCache) else c for c in entry)


@functools.partial(jax.jit, donate_argnames=("staging",))
def _load(staging, row, entry):
    """staging with row `row` started from a prefix cache entry (rows 1)."""
    def put(s, e):
        if not isinstance(s, AttentionCache):
            return _set_rows(s, row[None], e)
        at = lambda buf, x: jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype),
                                                         (row, 0, 0, 0))
        return AttentionCache(at(s.k, e.k), at(s.v, e.v), s.length.at[row].set(e.length[0]),
                              s.start.at[row].set(e.start[0]))
    return tuple(put(s, e) if s is not None else None for s, e in zip(staging, entry))


@functools.partial(jax.jit, static_argnames=("tree", "steps"))
def _decode_weights(params, *, tree, steps):
    return jax.tree.unflatten(tree, params).decode_weights(steps)


# ------------------------------------------------------------------ the host's side


def _bucket(n: int, least: int = 1) -> int:
    """The power of two >= max(n, least); 0 for n = least = 0."""
    return max(least, 1 << (n - 1).bit_length()) if n else least


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class _Request:
    """A sequence as the engine's thread tracks it."""

    def __init__(self, seq: Sequence, stream_seed: int):
        self.seq, self.ids, self.params = seq, seq.prompt_ids, seq.params
        self.seed = stream_seed
        self.pos = 0  # prompt tokens prefilled (in its staging row)
        self.fresh = True  # its staging row holds nothing of it yet
        self.whole = False  # its prompt was prefilled as one chunk, left-padded: no more
        self.stage_row: int | None = None
        self.slot: int | None = None
        self.done_prefill = False
        self.t = 0  # decoding steps dispatched since its insert
        self.n_forced = 0
        self.delivered = 0  # new tokens handed out (or decided: a stop)


class _PrefixCache:
    """An LRU of prefix states, bounded by bytes: key hash of the ids -> (ids, entry)."""

    def __init__(self, max_bytes: int, chunk: int):
        self.max_bytes, self.chunk = max_bytes, chunk
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.lookups = 0

    @staticmethod
    def keys(ids, chunk: int, upto: int):
        """The hash of ids[:p] for p = chunk, 2 chunk, ... <= upto, chained chunk by chunk."""
        h, out = 0, []
        for p in range(chunk, upto + 1, chunk):
            h = hash((h, tuple(ids[p - chunk:p])))
            out.append((p, h))
        return out

    def find(self, ids, upto: int):
        """(p, entry) of the longest cached prefix of ids of p <= upto tokens, or (0, None)."""
        for p, h in reversed(self.keys(ids, self.chunk, upto)):
            found = self.entries.get(h)
            if found is not None and found[0] == tuple(ids[:p]):
                self.entries.move_to_end(h)
                return p, found[1]
        return 0, None

    def holds(self, ids, p: int) -> bool:
        h = self.keys(ids, self.chunk, p)[-1][1]
        return h in self.entries and self.entries[h][0] == tuple(ids[:p])

    def put(self, ids, p: int, entry):
        size = sum(a.nbytes for a in jax.tree.leaves(entry))
        if size > self.max_bytes:
            return
        h = self.keys(ids, self.chunk, p)[-1][1]
        if h in self.entries:
            self.bytes -= self.entries.pop(h)[2]
        self.entries[h] = (tuple(ids[:p]), entry, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, freed) = self.entries.popitem(last=False)
            self.bytes -= freed


class Engine:
    """Holds the model, its decode slots and staging rows, and the thread that runs them
    (module docstring)."""

    def __init__(self, model, tokenizer, limits: Limits, eos_token_id=None,
                 generate_options=None, **engine_options):
        self.options = options = EngineOptions(**engine_options)
        check_options(options)
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        # The model's arrays as a list, flattened once: jit reads a list in C++, where a
        # Module is flattened by a Python traversal of every layer at each call.
        self._params, self._tree = jax.tree.flatten(model)
        self.eos = eos_token_id
        generate_options = dict(generate_options or {})
        self.ssm_state_dtype = generate_options.pop("ssm_state_dtype", "float32")
        self.step_implementation = generate_options.pop("step_implementation", "auto")
        if generate_options:
            raise TypeError(f"Engine: unknown generate_options {sorted(generate_options)}")
        self.vocab = model.config.vocab_size
        self.top_logprobs = min(MAX_TOP_LOGPROBS, self.vocab)
        kinds = model._cache_kinds()
        self.continuable = all(kind is type(None) or layer.mixer.takes_initial_state
                               for kind, layer in zip(kinds, model.layers))
        self.learned = learned_state(model)
        if self.learned and not self.continuable:
            raise ValueError("Engine: a model with a learnable initial state and layers that "
                             "cannot continue a state is not served (its prompts could not "
                             "be padded)")
        self.kv_tokens = (options.kv_tokens or limits.max_prompt_tokens + limits.max_new_tokens
                          ) if model.cache_grows else 0
        c = options.prefill_chunk
        self.stage_kv = (max(limits.max_prompt_tokens + c, _bucket(limits.max_prompt_tokens))
                         if model.cache_grows else 0)
        self.prefix = (_PrefixCache(int(options.prefix_cache_mb * 2**20), c)
                       if self.continuable and options.prefix_cache_mb > 0 else None)
        # The host's bookkeeping, on the engine's thread
        self._lock = threading.Lock()  # guards _incoming and queued_tokens
        self._incoming: collections.deque[_Request] = collections.deque()
        self.queued_tokens = 0
        self._wakeup = threading.Event()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._swept = True  # no sequence was cancelled since _waiting was last swept
        self._staging: list[_Request | None] = [None] * options.prefill_rows
        self._slot: list[_Request | None] = []  # per slot of the current capacity
        self._reserved = 0  # staging requests, each sure of a slot
        self._in_flight = None  # the last dispatch not yet read: (outputs, owners)
        self._small_since: float | None = None
        self._last_prefill = 0.0  # time.monotonic() of the last prefill chunk's dispatch
        self._plan = None
        self._weights = None
        self._slots: _Slots | None = None
        self._stage = None
        self._post = lambda f, *args: f(*args)  # onto the event loop, once run() starts
        self._stopping = False
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "mamba-score")
        # Statistics
        self.tokens_generated = self.prefill_tokens = 0
        self._recent: collections.deque = collections.deque()  # (time, tokens)
        self._reasons = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self._ttft, self._tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)

    # ------------------------------------------------------------ the interface

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self._check(prompt_ids, params)
        seq = Sequence(self, prompt_ids, params)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        with self._lock:
            if self.queued_tokens + seq.cost > self.limits.max_queued_tokens:
                raise Busy(f"the server is busy ({self.queued_tokens} tokens queued, at most "
                           f"{self.limits.max_queued_tokens}); retry shortly")
            self.queued_tokens += seq.cost
            self._incoming.append(_Request(seq, seed))
        self._wake()
        return seq

    async def score(self, sequences: list[list[int]], top_n: int = 0):
        """Per sequence, per token from position 1 on: (log p, ((id, log p), ...) top_n)."""
        if not self.learned:  # one batch, left-padded to a bucket
            return await self._score(sequences, top_n, _bucket(max(map(len, sequences)),
                                                               least=16))
        # A learned initial state would enter a row's left padding: each length unpadded
        out = [[] for _ in sequences]
        for length in sorted({len(s) for s in sequences} - {1}):  # one token: nothing scored
            rows = [i for i, s in enumerate(sequences) if len(s) == length]
            for i, scored in zip(rows, await self._score([sequences[i] for i in rows], top_n,
                                                         length)):
                out[i] = scored
        return out

    async def _score(self, sequences: list[list[int]], top_n: int, l: int):
        """score of sequences left-padded to l tokens, in one program."""
        b = _bucket(len(sequences))
        ids = np.zeros((b, l), np.int32)
        for row, seq in zip(ids, sequences):
            row[l - len(seq):] = seq
        lengths = [len(s) for s in sequences] + [l] * (b - len(sequences))  # fillers: zeros

        def scored():
            chosen, top = token_logprobs(self.model, ids, lengths, top_n)
            return np.asarray(chosen), None if top is None else tuple(map(np.asarray, top))

        chosen, top = await asyncio.get_running_loop().run_in_executor(self.executor, scored)
        out = []
        for i, seq in enumerate(sequences):
            at = slice(l - len(seq), None)
            alternatives = ([()] * (len(seq) - 1) if top is None else
                            [tuple(zip(ids_.tolist(), values.tolist()))
                             for values, ids_ in zip(top[0][i, at], top[1][i, at])])
            out.append(list(zip(chosen[i, at].tolist(), alternatives)))
        return out

    def stats(self) -> dict:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > STATS_WINDOW_S:
            self._recent.popleft()
        prefix = self.prefix
        return {"queued": len(self._incoming) + len(self._waiting) + self._reserved,
                "queued_tokens": self.queued_tokens,
                "slots_busy": sum(r is not None for r in self._slot),
                "slots": self.options.slots,
                "tokens_generated": self.tokens_generated,
                "tokens_per_second": sum(n for _, n in self._recent) / STATS_WINDOW_S,
                "requests_finished": dict(self._reasons),
                "prefix_cache_hits": prefix.hits if prefix else 0,
                "prefix_cache_lookups": prefix.lookups if prefix else 0,
                "prefix_cache_bytes": prefix.bytes if prefix else 0,
                "prefix_cache_entries": len(prefix.entries) if prefix else 0,
                "prefill_tokens": self.prefill_tokens,
                "ttft_seconds": self._ttft.snapshot(), "tpot_seconds": self._tpot.snapshot()}

    def memory(self) -> dict:
        """What the engine holds on the device at most, bytes: "slot" (one decode slot's
        cache and sampling state), "slots" (all of them), "staging" (the prefill's rows),
        "prefix_cache" (its bound), and "kv_tokens" (attention keys a slot holds; 0 without
        attention layers)."""
        slot = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
            jax.eval_shape(lambda: self._init_slots(1))))
        stage = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
            jax.eval_shape(lambda: _blank(self.model, self.options.prefill_rows,
                                          self.stage_kv))))
        return {"slot": slot, "slots": slot * self.options.slots, "staging": stage,
                "prefix_cache": self.prefix.max_bytes if self.prefix else 0,
                "kv_tokens": self.kv_tokens}

    async def run(self):
        """The engine's thread, for as long as this task runs."""
        loop = asyncio.get_running_loop()
        self._post = loop.call_soon_threadsafe
        thread = threading.Thread(target=self._serve, name="mamba-engine", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()
        finally:
            self._stopping = True
            self._wake()

    # ------------------------------------------------------------ checks and statistics

    def _check(self, ids, params: SamplingParams):
        """A ValueError naming what the engine cannot run."""
        if not ids:
            raise ValueError("submit: an empty prompt; give at least one token id")
        rows = self.model.config.padded_vocab_size
        if not all(isinstance(i, (int, np.integer)) and 0 <= i < rows for i in ids):
            raise ValueError(f"submit: the prompt holds ids outside the model's [0, {rows})")
        p = params
        if len(ids) > self.limits.max_prompt_tokens:
            raise ValueError(f"submit: the prompt is {len(ids)} tokens, over the limit of "
                             f"{self.limits.max_prompt_tokens}")
        if not 1 <= p.max_new_tokens <= self.limits.max_new_tokens:
            raise ValueError(f"submit: max_new_tokens={p.max_new_tokens} must be in [1, "
                             f"{self.limits.max_new_tokens}]")
        if self.kv_tokens and len(ids) + p.max_new_tokens > self.kv_tokens:
            raise ValueError(f"the prompt's {len(ids)} tokens and max_new_tokens="
                             f"{p.max_new_tokens} need {len(ids) + p.max_new_tokens} attention "
                             f"key slots; this server holds {self.kv_tokens} a sequence "
                             "(serve --kv-tokens): shorten the prompt or ask fewer tokens")
        finite = [p.temperature, p.top_p, p.top_p_decay, p.top_p_bound, p.presence_penalty,
                  p.frequency_penalty, *(v for _, v in p.logit_bias)]
        if not all(math.isfinite(float(np.float32(x))) for x in finite):
            raise ValueError("submit: sampling settings must be finite numbers")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or not (
                0 <= p.top_p_decay <= 1 and 0 <= p.top_p_bound <= 1):
            raise ValueError(f"submit: settings out of range: {p}")
        if any(not 0 <= t < self.vocab for t, _ in p.logit_bias):
            raise ValueError(f"submit: logit_bias ids must be in [0, {self.vocab})")
        if p.logprobs is not None and not 0 <= p.logprobs <= self.top_logprobs:
            raise ValueError(f"submit: logprobs={p.logprobs} must be in [0, "
                             f"{self.top_logprobs}]")

    def _finished(self, seq: Sequence):
        self._reasons["error" if seq.error is not None else seq.finish_reason] += 1
        if seq.first_token_at is not None and len(seq.events) > 1:
            self._tpot.observe((time.monotonic() - seq.first_token_at)
                               / (len(seq.events) - 1))

    def _wake(self):
        self._wakeup.set()

    # ------------------------------------------------------------ the engine's thread

    def _serve(self):
        while not self._stopping:
            try:
                if not self.step():
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
            except Exception as err:  # noqa: BLE001 - fail what ran, keep serving
                log.exception("the engine's step failed")
                self._fail_all(err)

    def step(self) -> bool:
        """One round: admit waiting prompts, prefill, insert, dispatch the decoding steps,
        read the previous dispatch's tokens. -> whether there is work left."""
        self._take_incoming()
        self._admit()
        self._prefill()
        self._insert()
        self._release_cancelled()
        self._fit_capacity()
        dispatched = self._dispatch() if any(r is not None for r in self._slot) else None
        if self._in_flight is not None:
            self._collect(*self._in_flight)
        self._in_flight = dispatched
        return bool(self._waiting or self._reserved or dispatched is not None
                    or any(r is not None for r in self._slot))

    def _take_incoming(self):
        """New requests into the queue, and those cancelled while they wait out of it: their
        room is free at once (it was held until they reached the front, refusing requests as
        busy for clients that had left)."""
        with self._lock:
            while self._incoming:
                self._waiting.append(self._incoming.popleft())
        if not self._swept:
            self._swept = True  # before the sweep: a cancel meanwhile sweeps again
            kept = collections.deque()
            for req in self._waiting:
                if req.seq.cancelled:
                    self._dequeue(req)
                else:
                    kept.append(req)
            self._waiting = kept

    def _admit(self):
        """Waiting prompts into free staging rows while a slot is sure for each."""
        busy = sum(r is not None for r in self._slot)
        for row, held in enumerate(self._staging):
            if held is not None:
                continue
            if not self._waiting or busy + self._reserved >= self.options.slots:
                return
            req = self._waiting.popleft()
            self._dequeue(req)
            req.stage_row, self._staging[row] = row, req
            self._reserved += 1
            self._start_from_prefix(req)

    def _dequeue(self, req: _Request):
        with self._lock:
            self.queued_tokens -= req.seq.cost

    def _start_from_prefix(self, req: _Request):
        n = len(req.ids) - 1
        if self.prefix is None or n < self.options.prefill_chunk:
            return
        self.prefix.lookups += 1
        p, entry = self.prefix.find(req.ids, n)
        if entry is None:
            return
        self.prefix.hits += 1
        self._stage = _load(self._staging_cache(), np.int32(req.stage_row), entry)
        req.pos, req.fresh = p, False

    def _staging_cache(self):
        if self._stage is None:
            self._stage = jax.jit(_blank, static_argnums=(1, 2))(
                self.model, self.options.prefill_rows, self.stage_kv)
        return self._stage

    def _next_chunk(self, req: _Request) -> tuple[int, int] | None:
        """(tokens, left padding) of the request's next prefill chunk, or None when the rest
        goes to the decode steps."""
        n, p, c = len(req.ids) - 1, req.pos, self.options.prefill_chunk
        if req.whole or n - p < 1:
            return None
        if not self.continuable:
            return (n, _bucket(n, GRANULE) - n) if p == 0 else None
        if p == 0 and not self.learned and n <= c:
            return n, _bucket(n, GRANULE) - n
        most = min(n - p, c - p % c)
        if most < GRANULE:
            return None
        return GRANULE * _floor_pow2(most // GRANULE), 0

    def _prefill_due(self) -> bool:
        """Whether a prefill round may start: no sequence decodes, R prompts wait, or the
        last round started prefill_interval_ms ago."""
        waited = time.monotonic() - self._last_prefill
        return (not any(r is not None for r in self._slot)
                or all(r is not None and not r.done_prefill for r in self._staging)
                or waited >= self.options.prefill_interval_ms / 1e3)

    def _prefill(self):
        """Chunks of the staging rows' prompts, batched by length, up to R x C tokens (one
        chunk at least)."""
        if not self._prefill_due():
            return
        budget, spent = self.options.prefill_rows * self.options.prefill_chunk, 0
        while True:
            groups: dict[int, list] = {}
            full = False
            for req in self._staging:
                if req is None or req.done_prefill:
                    continue
                chunk = self._next_chunk(req)
                if chunk is None:
                    req.done_prefill = True
                    continue
                tokens, pad = chunk
                if spent and spent + tokens + pad > budget:
                    full = True
                    break
                spent += tokens + pad
                groups.setdefault(tokens + pad, []).append((req, tokens, pad))
            for length, chunks in groups.items():
                self._run_chunks(length, chunks)
                self._last_prefill = time.monotonic()
            if full or not groups:
                return

    def _run_chunks(self, length: int, chunks: list):
        """Prefill a chunk of each of chunks' requests [(request, tokens, left padding)], all
        `length` tokens long with their padding. Should the program fail, each request runs
        alone, and one that fails alone fails its own sequence only (a failure that the
        device reports later, at a read, fails every sequence held: _fail_all)."""
        b = _bucket(len(chunks))
        ids = np.zeros((b, length), np.int32)
        rows = np.full((b,), self.options.prefill_rows, np.int32)  # past the end: filler
        fresh = np.ones((b,), bool)
        padded = any(pad for _, _, pad in chunks)
        seq_idx = np.ones((b, length), np.int32) if padded else None
        for i, (req, tokens, pad) in enumerate(chunks):
            ids[i, pad:] = req.ids[req.pos:req.pos + tokens]
            rows[i], fresh[i] = req.stage_row, req.fresh
            if padded:
                seq_idx[i, :pad] = 0
        try:
            self._stage = _prefill_chunk(self._params, self._staging_cache(), rows, ids,
                                         seq_idx, fresh, tree=self._tree,
                                         from_state=not fresh.all())
        except Exception as err:  # noqa: BLE001 - one prompt's failure is its own
            if any(a.is_deleted() for a in jax.tree.leaves(self._stage)):
                raise  # the staging rows were given to the program: none can go on
            if len(chunks) > 1:
                for chunk in chunks:
                    self._run_chunks(length, [chunk])
                return
            self._fail_prefill(chunks[0][0], err)
            return
        c = self.options.prefill_chunk
        for req, tokens, pad in chunks:
            self.prefill_tokens += tokens
            req.pos += tokens
            req.fresh = False
            req.whole = pad > 0 or not self.continuable
            if (self.prefix is not None and req.pos % c == 0
                    and not self.prefix.holds(req.ids, req.pos)):
                self.prefix.put(req.ids, req.pos, _extract(
                    self._stage, np.int32(req.stage_row), length=req.pos if self.stage_kv
                    else 0))

    def _fail_prefill(self, req: _Request, err: Exception):
        """End a sequence whose prompt's prefill failed with the error; free its row."""
        log.error("the prefill of a prompt of %d tokens failed: %s: %s", len(req.ids),
                  type(err).__name__, err)
        self._staging[req.stage_row] = None
        self._reserved -= 1
        error = GenerationError(f"its prompt's prefill failed: {type(err).__name__}: {err}")
        self._post(self._deliver, [(req.seq, [], ("error", error))])

    def _insert(self):
        """Prefilled staging rows into free slots (the capacity grown to hold them)."""
        ready = [r for r in self._staging if r is not None and r.done_prefill
                 and not r.seq.cancelled]
        if not ready:
            return
        busy = sum(r is not None for r in self._slot)
        self._resize(max(len(self._slot), self._capacity(busy + len(ready))))
        free = [s for s, r in enumerate(self._slot) if r is None]
        r = self.options.prefill_rows
        stage_rows = np.zeros((r,), np.int32)
        slot_rows = np.full((r,), len(self._slot), np.int32)  # past the end: no slot
        fresh = np.zeros((r,), bool)
        f32, i32 = lambda fill=0: np.full((r,), fill, np.float32), lambda fill=0: np.full(
            (r,), fill, np.int32)
        settings = Settings(f32(), i32(), f32(1), f32(), f32(), i32(-1), i32(-1), f32(), f32())
        width = _bucket(max(len(q.params.logit_bias) for q in ready))
        bias_ids = np.full((r, width), self.vocab, np.int32)
        bias_values = np.zeros((r, width), np.float32)
        seeds = np.zeros((r, 2), np.uint32)
        forced = np.zeros((r, GRANULE), np.int32)
        n_forced = np.ones((r,), np.int32)
        for i, (req, slot) in enumerate(zip(ready, free)):
            p = req.params
            stage_rows[i], slot_rows[i], fresh[i] = req.stage_row, slot, req.fresh
            values = (p.temperature, min(p.top_k, self.vocab), p.top_p, p.top_p_decay,
                      p.top_p_bound, *(p.banned_after or (-1, -1)), p.presence_penalty,
                      p.frequency_penalty)
            for array, value in zip(settings, values):  # logit_bias (None) left out
                array[i] = value
            for j, (token, value) in enumerate(p.logit_bias):
                bias_ids[i, j], bias_values[i, j] = token, value
            seeds[i] = seed_words([req.seed])[0]
            tail = req.ids[req.pos:]
            forced[i, :len(tail)] = tail
            n_forced[i] = req.n_forced = len(tail)
            req.slot, req.t = slot, 0
            self._slot[slot] = req
            self._staging[req.stage_row] = None
            self._reserved -= 1
        self._slots = _insert(self._params, self._slots, self._staging_cache(), stage_rows,
                              slot_rows, fresh, settings, bias_ids, bias_values,
                              seeds, forced, n_forced, tree=self._tree,
                              ssm_state_dtype=self.ssm_state_dtype)

    def _release_cancelled(self):
        """Cancelled sequences give back their staging rows and slots."""
        for row, req in enumerate(self._staging):
            if req is not None and req.seq.cancelled:
                self._staging[row] = None
                self._reserved -= 1
        for slot, req in enumerate(self._slot):
            if req is not None and req.seq.cancelled:
                self._free(req)

    def _free(self, req: _Request):
        """req leaves its slot. Its index is forgotten: a sequence freed as its last dispatch
        went out is read after that, when the batch may have shrunk below the index (an
        IndexError failed every sequence held) or another sequence taken the slot."""
        if req.slot is not None and self._slot[req.slot] is req:
            self._slot[req.slot] = None
        req.slot = None

    def _init_slots(self, capacity: int) -> _Slots:
        m, v = self.model, self.vocab
        cache = m.cache_for_decoding(_per_row_lengths(m.init_cache(capacity, self.kv_tokens),
                                                      capacity),
                                     ("xla",) * len(m.layers), self.ssm_state_dtype)
        zeros = lambda dtype, *shape: jnp.zeros((capacity, *shape), dtype)
        settings = Settings(zeros(jnp.float32), zeros(jnp.int32), zeros(jnp.float32),
                            zeros(jnp.float32), zeros(jnp.float32), zeros(jnp.int32),
                            zeros(jnp.int32), zeros(jnp.float32), zeros(jnp.float32),
                            zeros(jnp.float32, v))
        return _Slots(cache, settings, zeros(jnp.uint32, 2), zeros(jnp.int32, v),
                      zeros(jnp.int32), zeros(jnp.int32), zeros(jnp.int32, GRANULE),
                      zeros(jnp.int32))

    def _resize(self, capacity: int, order: list[int] | None = None):
        """The slots as a batch of `capacity` rows: each kept slot's row moved to its place
        in `order` (the old slots, in their new order; default: where they are)."""
        old = len(self._slot)
        if capacity == old and order is None:
            return
        if self._slots is None:
            self._slots = jax.jit(self._init_slots, static_argnums=0)(capacity)
        else:
            order = list(range(min(old, capacity))) if order is None else order
            rows = np.asarray(order + [0] * (capacity - len(order)), np.int32)
            self._slots = _resize(self._slots, rows)
        slot = [None] * capacity
        for new, previous in enumerate(order or []):
            slot[new] = self._slot[previous]
            if slot[new] is not None:
                slot[new].slot = new
        self._slot = slot
        plan = decode_plan(self.model, capacity, self.step_implementation,
                           ssm_state_dtype=self.ssm_state_dtype).steps
        if plan != self._plan:  # the step weights of the plan's implementations
            self._plan, self._weights = plan, None  # one copy on the device at a time
            self._weights = _decode_weights(self._params, tree=self._tree, steps=plan)

    def _capacity(self, used: int) -> int:
        """The batch that holds `used` slots: its power of two, at most `slots`."""
        return min(_bucket(used), self.options.slots)

    def _fit_capacity(self):
        """Shrink to the busy slots' bucket once a quarter of the batch or less has been
        in use for SHRINK_AFTER_S."""
        busy = [s for s, r in enumerate(self._slot) if r is not None]
        target = self._capacity(len(busy) + self._reserved)
        if target * 4 > len(self._slot):
            self._small_since = None
            return
        now = time.monotonic()
        if self._small_since is None:
            self._small_since = now
        elif now - self._small_since >= SHRINK_AFTER_S:
            self._small_since = None
            self._resize(target, busy)

    def _dispatch(self):
        """The next decode program, not waited for -> (its outputs, each slot's owner)."""
        k = self.options.steps_per_dispatch
        owners = list(self._slot)
        live = [r.params for r in owners if r is not None]
        sampled = [p for p in live if p.temperature > 0]
        # Only the sort that top_k and top_p need, and the log-softmax and top-k of the
        # logprobs, are left out of a program whose slots do not use them: the other
        # settings cost little, and each variant is a compile of the whole step.
        filters = any(0 < p.top_k < self.vocab or p.top_p < 1 or p.top_p_decay > 0
                      for p in sampled)
        sampling = Sampling(greedy=not sampled, top_k=filters, top_p=filters,
                            top_p_decay=filters, banned_after=True, penalties=True,
                            logit_bias=True)
        top_n = -1 if all(p.logprobs is None for p in live) else self.top_logprobs
        self._slots, out = _decode_program(self._params, self._weights, self._slots,
                                           tree=self._tree, steps=self._plan, k=k,
                                           sampling=sampling, top_n=top_n)
        for req in filter(None, owners):
            req.t += k
            # Its length is reached in this dispatch: its slot is free for the next insert
            # (which the device runs after this program), its tokens still to be read.
            if req.t - req.n_forced + 1 >= req.params.max_new_tokens:
                self._free(req)
        return out, owners

    def _collect(self, out, owners):
        """Read a dispatch's tokens and hand them to their sequences (on the event loop)."""
        out = jax.device_get(out)
        tokens, emitted, nan = out[:3]
        deliveries = []
        for s, req in enumerate(owners):
            if req is None or req.delivered < 0:
                continue
            events, finish = [], None
            stops = set(req.params.stop_token_ids) | ({self.eos} if self.eos is not None
                                                      else set())
            for j in np.flatnonzero(emitted[:, s]):
                if nan[j, s]:
                    finish = ("error", GenerationError(
                        f"the model's logits are NaN (new token {req.delivered}): its "
                        "weights hold NaN or infinity, or its activations overflow (a "
                        "bfloat16 model may where float32 does not)"))
                    break
                token = int(tokens[j, s])
                if token in stops:
                    finish = ("stop", None)
                    break
                events.append(self._event(req, out, j, s, token))
                req.delivered += 1
                if req.delivered >= req.params.max_new_tokens:
                    finish = ("length", None)
                    break
            if finish is not None:
                req.delivered = -1  # nothing more of it is read
                self._free(req)
            deliveries.append((req.seq, events, finish))
        self._post(self._deliver, deliveries)

    @staticmethod
    def _event(req: _Request, out, j: int, s: int, token: int) -> TokenEvent:
        k = req.params.logprobs
        if k is None:
            return TokenEvent(token, None, None)
        logp, top_logp, top_ids = out[3:]
        return TokenEvent(token, float(logp[j, s]), tuple(zip(
            top_ids[j, s, :k].tolist(), top_logp[j, s, :k].tolist())))

    def _deliver(self, deliveries):
        """On the event loop: each sequence's new events, and its end."""
        tokens = 0
        for seq, events, finish in deliveries:
            for event in events:
                seq._emit(event)
            tokens += len(events)
            if finish is not None:
                seq._finish(*finish)
        self.tokens_generated += tokens
        self._recent.append((time.monotonic(), tokens))

    def _fail_all(self, err: Exception):
        """After an unexpected failure of a step: end every sequence the engine holds with
        the error and start over from empty slots."""
        held = [r for r in (*self._staging, *self._slot) if r is not None]
        if self._in_flight is not None:
            held += [r for r in self._in_flight[1] if r is not None]
        error = GenerationError(f"{type(err).__name__}: {err}")
        self._post(self._deliver, [(r.seq, [], ("error", error)) for r in set(held)])
        self._staging = [None] * self.options.prefill_rows
        self._slot, self._slots, self._stage = [], None, None
        self._reserved, self._in_flight = 0, None


def check_options(o: EngineOptions):
    """A ValueError naming an option out of its range (as serve's flag)."""
    for name in ("slots", "steps_per_dispatch", "prefill_chunk", "prefill_rows"):
        value = getattr(o, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value!r} must be an integer >= 1")
    c = o.prefill_chunk
    if c < GRANULE or c % GRANULE or (c // GRANULE) & (c // GRANULE - 1):
        raise ValueError(f"--prefill-chunk={c} must be {GRANULE} times a power of two "
                         f"({GRANULE}, {2 * GRANULE}, ... 256, 512)")
    for name in ("prefix_cache_mb", "prefill_interval_ms"):
        value = getattr(o, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a number >= 0")
    if o.kv_tokens is not None and o.kv_tokens < 1:
        raise ValueError(f"--kv-tokens={o.kv_tokens} must be >= 1")


def add_engine_arguments(parser):
    """The serve CLI's options of the engine (EngineOptions)."""
    d = EngineOptions()
    parser.add_argument("--slots", type=int, default=d.slots,
                        help="sequences that decode at once (each a row of the decoding "
                             "cache)")
    parser.add_argument("--steps-per-dispatch", type=int, default=d.steps_per_dispatch,
                        help="decoding steps of one compiled program, between which the "
                             "engine admits prompts and hands out tokens")
    parser.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                        help=f"the longest prefill chunk, {GRANULE} times a power of two; "
                             "prefix-cache entries are at its multiples")
    parser.add_argument("--prefill-rows", type=int, default=d.prefill_rows,
                        help="prompts that prefill at once")
    parser.add_argument("--prefill-interval-ms", type=float, default=d.prefill_interval_ms,
                        help="while sequences decode, a prefill round (which stalls them) "
                             "starts at most this often, unless --prefill-rows prompts wait")
    parser.add_argument("--prefix-cache-mb", type=float, default=d.prefix_cache_mb,
                        help="the bound of the states kept after shared prompt prefixes; "
                             "0: none")
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="attention keys each slot holds, prompt and new tokens (models "
                             "with attention layers; default --max-prompt-tokens + "
                             "--max-new-tokens)")


def engine_options(args) -> dict:
    """Engine's keyword options from add_engine_arguments' parsed options."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)}
