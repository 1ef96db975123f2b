"""The server's engine: token ids in, token events out. The HTTP side (mamba_jax.serve)
tokenizes, cuts at stop strings and writes the JSON; the engine decodes.

    engine = Engine(model, tokenizer, Limits(), eos_token_id)
    task = asyncio.create_task(engine.run())              # the engine loop
    seq = engine.submit(prompt_ids, SamplingParams(max_new_tokens=16, temperature=0.7))
    async for event in seq: ...                           # TokenEvents as they are sampled
    seq.finish_reason                                     # "stop", "length" or "cancelled"
    await engine.score([ids, ...], top_n=2)               # each token's log p after the first
    engine.stats()                                        # what /metrics shows

The interface:
- `submit(prompt_ids, params)` -> Sequence; raises Busy (a 503 at the API) when the queue
  would hold more than `limits.max_queued_tokens` prompt and new tokens, ValueError for
  params the engine cannot run (the API validates first: this is the backstop).
- `Sequence`: `async for event in seq` gives its TokenEvents as they are sampled (the stop
  token, eos or one of params.stop_token_ids, is not given); then `finish_reason` is "stop",
  "length" or "cancelled". A generation that fails (NaN logits) raises GenerationError from
  the iteration. `seq.cancel()` (the client left, a stop string was found) ends it: its
  iteration ends and its slot is freed at the next step.
- `score(sequences, top_n)` -> per sequence, per token from position 1 on, (log p of the
  token given the tokens before it, the top_n most likely tokens' ((id, log p), ...)), from
  the raw logits' log-softmax (no temperature): echo and Megatron's logprobs.
- `stats()` -> dict, the numbers behind /metrics:
    "queued": sequences waiting for a slot; "queued_tokens": their prompt and new tokens;
    "slots_busy", "slots": sequences decoding, and the most that decode at once;
    "tokens_generated": new tokens since the start; "tokens_per_second": new tokens a
    second over the last STATS_WINDOW_S seconds;
    "requests_finished": {"stop": n, "length": n, "cancelled": n, "error": n};
    "prefix_cache_hits", "prefix_cache_lookups": prompts that started from a cached prefix's
    states, and prompts looked up; "prefix_cache_bytes", "prefix_cache_entries";
    "ttft_seconds": time to first token (submit to the first TokenEvent) and
    "tpot_seconds": time per output token after the first (a finished sequence's time from
    its first token to its last over its tokens less one), each a histogram as
    Prometheus's: {"buckets": ((upper bound, cumulative count), ..., (inf, count)),
    "sum": seconds, "count": observations}.

Sampling per sequence (SamplingParams): a sequence with a `seed` samples the same tokens
for the same prompt and settings whatever runs beside it, and the same as
`mamba_jax.generate` of that one prompt with that seed; without one, a random seed.
presence_penalty and frequency_penalty follow OpenAI's definition over the sequence's new
tokens, `logits[t] -= presence * (count[t] > 0) + frequency * count[t]`, and logit_bias adds
to the logits, both before the filters and the temperature; logprobs are the raw logits'.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
import logging
import math
import random
import time

import numpy as np

from mamba_jax.generate import generate, token_logprobs

log = logging.getLogger("mamba_jax.engine")

STATS_WINDOW_S = 10.0  # tokens_per_second's window
# Prometheus histogram bounds, seconds: time to first token and time per output token
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server accepts: a prompt's tokens, a sequence's new tokens, prompts a
    request, and the prompt and new tokens of every queued sequence together."""

    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    max_batch: int = 64
    batch_window_s: float = 0.005
    max_prompts: int = 64  # per request
    # A full batch of the longest requests (64 x (2048 + 1024)) fits; more waits for the
    # clients to retry.
    max_queued_tokens: int = 1 << 18


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
    """Prometheus-style cumulative histogram of observations, seconds."""

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
    ends. Made by Engine.submit."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams):
        self.engine, self.prompt_ids, self.params = engine, list(prompt_ids), params
        self.tokens: list[int] = []  # the new tokens so far (no stop token)
        self.finish_reason: str | None = None
        self.error: Exception | None = None
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self._events: asyncio.Queue = asyncio.Queue()  # TokenEvents, then None at the end
        self.started = False  # taken into a batch or slot

    @property
    def cost(self) -> int:
        """What it holds of the queue: its prompt and new tokens."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    def cancel(self):
        """End it now (the client left, a stop string was found): no more events."""
        self._finish("cancelled")

    async def __aiter__(self):
        while (event := await self._events.get()) is not None:
            yield event
        if self.error is not None:
            raise self.error

    # The engine's side, on the event loop

    def _emit(self, event: TokenEvent):
        if self.finish_reason is not None:
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.engine._ttft.observe(self.first_token_at - self.submitted)
        self.tokens.append(event.token_id)
        self._events.put_nowait(event)

    def _finish(self, reason: str, error: Exception | None = None):
        if self.finish_reason is not None:
            return
        self.finish_reason, self.error = reason, error
        self.engine._finished(self)
        self._events.put_nowait(None)


class Engine:
    """Holds the model and decodes the submitted sequences."""

    def __init__(self, model, tokenizer, limits: Limits, eos_token_id=None,
                 generate_options=None, **engine_options):
        if engine_options:
            raise TypeError(f"Engine: unknown options {sorted(engine_options)}")
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        self.eos = eos_token_id
        self.generate_options = generate_options or {}
        self.pending: asyncio.Queue[Sequence] = asyncio.Queue()
        self.queued_tokens = 0
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "mamba-engine")
        self.busy = 0
        self.tokens_generated = 0
        self._recent: list[tuple[float, int]] = []  # (time, tokens) of recent deliveries
        self._reasons = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self._ttft, self._tpot = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)

    # ------------------------------------------------------------ the interface

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise ValueError("submit: an empty prompt; give at least one token id")
        if params.max_new_tokens < 1:
            raise ValueError(f"submit: max_new_tokens={params.max_new_tokens} must be >= 1")
        if params.presence_penalty or params.frequency_penalty or params.logit_bias:
            raise ValueError("submit: presence_penalty, frequency_penalty and logit_bias are "
                             "not implemented yet")
        seq = Sequence(self, prompt_ids, params)
        if self.queued_tokens + seq.cost > self.limits.max_queued_tokens:
            raise Busy(f"the server is busy ({self.queued_tokens} tokens queued, at most "
                       f"{self.limits.max_queued_tokens}); retry shortly")
        self.queued_tokens += seq.cost
        self.pending.put_nowait(seq)
        return seq

    async def score(self, sequences: list[list[int]], top_n: int = 0):
        """Per sequence, per token from position 1 on: (log p, ((id, log p), ...) top_n)."""
        b = _bucket(len(sequences), len(sequences))
        l = _bucket(max(map(len, sequences)), max(map(len, sequences)), least=16)
        ids = np.zeros((b, l), np.int32)
        for row, seq in zip(ids, sequences):
            row[l - len(seq):] = seq
        lengths = [len(s) for s in sequences] + [1] * (b - len(sequences))

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
        self._recent = [(t, n) for t, n in self._recent if now - t <= STATS_WINDOW_S]
        return {"queued": self.pending.qsize(), "queued_tokens": self.queued_tokens,
                "slots_busy": self.busy, "slots": self.limits.max_batch,
                "tokens_generated": self.tokens_generated,
                "tokens_per_second": sum(n for _, n in self._recent) / STATS_WINDOW_S,
                "requests_finished": dict(self._reasons),
                "prefix_cache_hits": 0, "prefix_cache_lookups": 0, "prefix_cache_bytes": 0,
                "prefix_cache_entries": 0,
                "ttft_seconds": self._ttft.snapshot(), "tpot_seconds": self._tpot.snapshot()}

    async def run(self):
        """Forever: wait for a sequence, gather what arrives within the window, generate."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._next()]
            deadline = loop.time() + self.limits.batch_window_s
            while len(batch) < self.limits.max_batch:
                try:
                    batch.append(await asyncio.wait_for(self._next(), deadline - loop.time()))
                except TimeoutError:
                    break
            # a seeded sequence decodes alone (its samples then depend on its seed only)
            groups = [[s] for s in batch if s.params.seed is not None]
            rest = [s for s in batch if s.params.seed is None]
            for group in groups + ([rest] if rest else []):
                await self._generate(loop, group)

    # ------------------------------------------------------------ today's batching

    async def _next(self) -> Sequence:
        while True:
            seq = await self.pending.get()
            self.queued_tokens -= seq.cost
            if seq.finish_reason is None:
                seq.started = True
                return seq

    def _finished(self, seq: Sequence):
        self._reasons["error" if seq.error is not None else seq.finish_reason] += 1
        if seq.first_token_at is not None and len(seq.tokens) > 1:
            self._tpot.observe((time.monotonic() - seq.first_token_at)
                               / (len(seq.tokens) - 1))

    async def _generate(self, loop, rows: list[Sequence]):
        b = _bucket(len(rows), self.limits.max_batch)
        l = _bucket(max(len(r.prompt_ids) for r in rows), self.limits.max_prompt_tokens,
                    least=16)
        t = _bucket(max(r.params.max_new_tokens for r in rows), self.limits.max_new_tokens,
                    least=16)
        params = [r.params for r in rows] + [SamplingParams(1)] * (b - len(rows))
        prompts = [r.prompt_ids for r in rows] + [[0]] * (b - len(rows))
        ids = np.zeros((b, l), np.int32)
        for row, p in zip(ids, prompts):
            row[l - len(p):] = p
        vocab = self.model.config.vocab_size
        sampled = any(p.temperature > 0 for p in params)
        top_k = [min(p.top_k, vocab) or vocab for p in params]
        top_p = [p.top_p for p in params]
        decay = [p.top_p_decay for p in params]
        ban = np.asarray([p.banned_after or (-1, -1) for p in params]).T
        seed = rows[0].params.seed if rows[0].params.seed is not None else random.getrandbits(63)
        stops = [set(p.stop_token_ids) | ({self.eos} if self.eos is not None else set())
                 for p in params]
        ended = [False] * len(rows)

        def deliver(step, tokens):  # on the event loop
            for i, (seq, token) in enumerate(zip(rows, tokens)):
                if ended[i] or step >= seq.params.max_new_tokens:
                    continue
                if int(token) in stops[i]:
                    ended[i] = True
                    continue
                if seq.params.logprobs is None:
                    seq._emit(TokenEvent(int(token), None, None))
            self.tokens_generated += len(rows)
            self._recent.append((time.monotonic(), len(rows)))

        def on_token(step, tokens):  # on a runtime thread
            loop.call_soon_threadsafe(deliver, step, np.asarray(tokens))

        self.busy = len(rows)
        try:
            out = await loop.run_in_executor(self.executor, lambda: np.asarray(generate(
                self.model, ids, t, [p.temperature for p in params],
                top_k if sampled and min(top_k) < vocab else None,
                top_p if sampled and (min(top_p) < 1 or max(decay) > 0) else None,
                seed, None, prompt_lengths=[len(p) for p in prompts],
                max_new_tokens_per_row=[p.max_new_tokens for p in params], on_token=on_token,
                top_p_decay=decay if sampled and max(decay) > 0 else None,
                top_p_bound=[p.top_p_bound for p in params] if sampled and max(decay) > 0
                else None,
                banned_after=tuple(ban) if ban.max() >= 0 else None,
                **self.generate_options)))
        except Exception as err:  # noqa: BLE001 - keep serving whatever failed
            log.error("generation failed for %d sequence(s): %s: %s", len(rows),
                      type(err).__name__, err)
            for seq in rows:
                seq._finish("error", GenerationError(f"generation failed: "
                                                     f"{type(err).__name__}: {err}"))
            return
        finally:
            self.busy = 0
        await asyncio.sleep(0)  # the deliveries queued by on_token run first
        for i, (seq, new) in enumerate(zip(rows, out[:, l:])):
            new = new[:seq.params.max_new_tokens].tolist()
            stop = next((j for j, token in enumerate(new) if token in stops[i]), None)
            new = new[:stop]
            if seq.params.logprobs is not None and new and seq.finish_reason is None:
                [scored] = await self.score([seq.prompt_ids + new], seq.params.logprobs)
                for token, (logp, top) in zip(new, scored[len(seq.prompt_ids) - 1:]):
                    seq._emit(TokenEvent(token, logp, top))
            seq._finish("length" if stop is None else "stop")


def _bucket(n: int, cap: int, least: int = 1) -> int:
    """The power of two >= max(n, least), at most cap (cap >= n)."""
    return min(max(least, 1 << (n - 1).bit_length()), cap)
