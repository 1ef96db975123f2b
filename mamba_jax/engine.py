"""The server's engine: token ids in, token events out. The HTTP side (mamba_jax.serve)
tokenizes, cuts at stop strings and writes the JSON; the engine decodes.

    engine = Engine(model, tokenizer, Limits(), eos_token_id)
    task = asyncio.create_task(engine.run())                # the engine loop
    seq = engine.submit(prompt_ids, SamplingParams(max_new_tokens=16, temperature=0.7))
    async for event in seq: ...                             # TokenEvents as they are sampled
    seq.finish_reason                                       # "stop", "length" or "cancelled"
    await engine.score([ids, ...], top_n=2)                 # each token's log p after the first
    engine.stats()                                          # what /metrics shows

This engine batches by a time window: a request waits up to --batch-window-ms for others,
then every waiting prompt (up to --max-batch) runs as one `generate` call, with per-row
sampling settings and token limits (all traced values, so any requests are compatible).
Should a batch fail all the same, each of its prompts is run again alone, so that a failure
fails only the request that causes it. Generation runs on one executor thread, off the event
loop. Shapes are bucketed to powers of two (batch rows, left-padded prompt length, max new
tokens), which bounds the compiled programs to a few per bucket. A sequence with a seed
decodes in a batch of its own, seeded with it (the same prompt, settings and seed: the same
tokens). A cancelled sequence still queued is dropped before it reaches a batch; one already
decoding finishes its batch (a compiled decode loop is not interrupted) and its tokens are
discarded. `generate` has no presence or frequency penalties and no logit bias: submit
refuses them (ValueError), and its events carry no logprobs (`score` gives them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import time

import numpy as np

from mamba_jax.generate import generate, token_logprobs

log = logging.getLogger("mamba_jax.engine")


@dataclasses.dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    max_batch: int = 64
    batch_window_s: float = 0.005
    max_prompts: int = 64  # per request
    # Prompt and new tokens of every waiting prompt: a full batch of the longest requests
    # (64 x (2048 + 1024)) fits, more waits for the clients to retry.
    max_queued_tokens: int = 1 << 18


# The most likely tokens a scoring pass lists per position at most: one compiled program
# whatever a request asks for.
TOP_LOGPROBS = 5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    top_p_decay: float = 0.0  # top_p at new token i = max(top_p * top_p_decay**i, top_p_bound)
    top_p_bound: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    banned_after: tuple[int, int] | None = None  # (after, banned)
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos; not returned
    logprobs: int | None = None  # k: each new token's logprob and the top k alternatives


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None


class Busy(Exception):
    """The queue is full: retry shortly."""


class Sequence:
    """One prompt's continuation: iterate it for TokenEvents; finish_reason once it ends."""

    def __init__(self, engine: Engine, ids: list[int], params: SamplingParams):
        self.engine, self.ids, self.params = engine, ids, params
        self.future = asyncio.get_running_loop().create_future()  # -> (tokens, reason)
        self.stream: asyncio.Queue = asyncio.Queue()  # token ids as sampled, then None
        self.started = False  # taken into a batch
        self.finish_reason: str | None = None

    @property
    def tokens(self) -> int:
        """What it costs the queue: its prompt and new tokens."""
        return len(self.ids) + self.params.max_new_tokens

    def cancel(self):
        self.future.cancel()
        self.finish_reason = self.finish_reason or "cancelled"

    def _ends(self, token: int) -> bool:
        return token == self.engine.eos or token in self.params.stop_token_ids

    async def __aiter__(self):
        while (token := await self.stream.get()) is not None and not self._ends(token):
            yield TokenEvent(token, None, None)
        tokens, reason = await self.future  # a failed generation raises here
        stopped = any(self._ends(t) for t in tokens)
        self.finish_reason = "stop" if stopped else reason


class Engine:
    """Holds the model, batches waiting sequences and runs each batch on the executor
    thread.

    stats() -> {"queued": sequences waiting for a batch, "slots_busy": sequences decoding,
    "slots": the most that decode at once, "tokens_generated": new tokens since the start,
    "tokens_per_second": new tokens a second over the last batch, "batches": batches run}."""

    def __init__(self, model, tokenizer, limits: Limits, eos_token_id=None,
                 generate_options=None):
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        self.eos = eos_token_id
        self.generate_options = generate_options or {}  # generate's ssm_state_dtype etc.
        self.pending: asyncio.Queue[Sequence] = asyncio.Queue()
        self.queued_tokens = 0  # the tokens of the sequences in `pending`
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "mamba-generate")
        self.seeds = itertools.count()
        self.batches = 0
        self.decoding = 0
        self.tokens_generated = 0
        self.tokens_per_second = 0.0

    def submit(self, ids: list[int], params: SamplingParams) -> Sequence:
        """Queue one prompt for the next batch; Busy when the queue would pass
        --max-queued-tokens, ValueError for a setting generate does not have."""
        if params.presence_penalty or params.frequency_penalty or params.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not "
                             "implemented by this engine")
        seq = Sequence(self, ids, params)
        if self.queued_tokens + seq.tokens > self.limits.max_queued_tokens:
            raise Busy(f"the server is busy ({self.queued_tokens} tokens queued, at most "
                       f"{self.limits.max_queued_tokens}); retry shortly")
        self.pending.put_nowait(seq)
        self.queued_tokens += seq.tokens
        return seq

    def stats(self) -> dict:
        return {"queued": self.pending.qsize(), "slots_busy": self.decoding,
                "slots": self.limits.max_batch, "tokens_generated": self.tokens_generated,
                "tokens_per_second": self.tokens_per_second, "batches": self.batches}

    async def _next(self) -> Sequence:
        """The next queued sequence whose client still waits (the others are dropped)."""
        while True:
            seq = await self.pending.get()
            self.queued_tokens -= seq.tokens
            if not seq.future.done():
                seq.started = True
                return seq

    async def run(self):
        """Forever: wait for a sequence, gather what arrives within the window, generate."""
        loop = asyncio.get_running_loop()
        while True:
            seqs = [await self._next()]
            deadline = loop.time() + self.limits.batch_window_s
            while len(seqs) < self.limits.max_batch:
                try:
                    seqs.append(await asyncio.wait_for(self._next(), deadline - loop.time()))
                except TimeoutError:
                    break
            # Seeded sequences decode in a batch of their own (the same rows, shapes and
            # seed each time: the same samples); the others together.
            groups: dict[object, list[Sequence]] = {}
            for seq in seqs:
                groups.setdefault(seq.params.seed is None or seq, []).append(seq)
            for group in groups.values():
                await self._generate(loop, group)

    async def _generate(self, loop, seqs: list[Sequence]):
        lim = self.limits
        b = _bucket(len(seqs), lim.max_batch)
        l = _bucket(max(len(s.ids) for s in seqs), lim.max_prompt_tokens, least=16)
        t = _bucket(max(s.params.max_new_tokens for s in seqs), lim.max_new_tokens, least=16)
        # Filler rows: a one-token prompt, greedy, stopped after one token.
        params = [s.params for s in seqs] + [SamplingParams(1)] * (b - len(seqs))
        lengths = [len(s.ids) for s in seqs] + [1] * (b - len(seqs))
        ids = np.zeros((b, l), np.int32)
        for row, s in zip(ids, seqs):
            row[l - len(s.ids):] = s.ids
        streamed = False

        def deliver(step, tokens):  # on the event loop, in step order
            nonlocal streamed
            for s, token in zip(seqs, tokens):
                if step < s.params.max_new_tokens and not s.future.done():
                    s.stream.put_nowait(int(token))
                    streamed = True

        def on_token(step, tokens):  # on a runtime thread
            loop.call_soon_threadsafe(deliver, step, tokens)

        # Off is top_k = vocab and top_p = 1 for a row; a filter no row uses is left out of
        # the compiled sampler.
        sampled = any(p.temperature > 0 for p in params)
        vocab = self.model.config.vocab_size
        top_k = [min(p.top_k, vocab) or vocab for p in params]
        top_p = [p.top_p for p in params]
        decay = [p.top_p_decay for p in params]
        ban = np.asarray([p.banned_after or (-1, -1) for p in params]).T
        seed = next(self.seeds) if seqs[0].params.seed is None else seqs[0].params.seed
        self.decoding = len(seqs)
        start = time.perf_counter()
        try:
            out = await loop.run_in_executor(self.executor, lambda: np.asarray(generate(
                self.model, ids, t, [p.temperature for p in params],
                top_k if sampled and min(top_k) < vocab else None,
                top_p if sampled and (min(top_p) < 1 or max(decay) > 0) else None,
                seed, self.eos, prompt_lengths=lengths,
                max_new_tokens_per_row=[p.max_new_tokens for p in params],
                on_token=on_token,
                top_p_decay=decay if sampled and max(decay) > 0 else None,
                top_p_bound=[p.top_p_bound for p in params] if sampled and max(decay) > 0
                else None,
                banned_after=tuple(ban) if ban.max() >= 0 else None,
                **self.generate_options)))
        except Exception as err:  # noqa: BLE001 - keep serving whatever failed
            self.decoding = 0
            waiting = [s for s in seqs if not s.future.done()]
            if len(waiting) > 1 and not streamed:
                # One row's settings may be what failed: alone, each fails only its own.
                for seq in waiting:
                    await self._generate(loop, [seq])
                return
            log.error("generation failed for %d prompt(s): %s: %s", len(waiting),
                      type(err).__name__, err)
            for s in waiting:
                s.stream.put_nowait(None)
                s.future.set_exception(err)
            return
        self.decoding = 0
        self.batches += 1
        for s, new in zip(seqs, out[:, l:]):
            new = new[:s.params.max_new_tokens].tolist()
            reason = "length"
            if self.eos is not None and self.eos in new:
                new, reason = new[:new.index(self.eos)], "stop"
            self.tokens_generated += len(new)
            s.stream.put_nowait(None)
            if not s.future.done():
                s.future.set_result((new, reason))
        self.tokens_per_second = (out.shape[0] * t) / max(time.perf_counter() - start, 1e-9)

    async def score(self, sequences: list[list[int]], top_n: int = 0):
        """Each sequence's tokens from position 1 on: [(log p given the tokens before it,
        ((id, log p) of the top_n most likely tokens, most likely first))], from one forward
        pass on the generation thread (raw logits, no temperature). A ValueError for NaN
        log-probabilities."""
        lim = self.limits
        b = _bucket(len(sequences), max(len(sequences), lim.max_batch))
        l = _bucket(max(map(len, sequences)), lim.max_prompt_tokens + lim.max_new_tokens,
                    least=16)
        ids = np.zeros((b, l), np.int32)
        for row, seq in zip(ids, sequences):
            row[l - len(seq):] = seq
        lengths = [len(s) for s in sequences] + [1] * (b - len(sequences))

        def run():
            chosen, top = token_logprobs(self.model, ids, lengths, TOP_LOGPROBS)
            return np.asarray(chosen), tuple(map(np.asarray, top))

        chosen, (values, top_ids) = await asyncio.get_running_loop().run_in_executor(
            self.executor, run)
        out = []
        for i, seq in enumerate(sequences):
            at = slice(l - len(seq), None)  # the row's own positions
            out.append([(logp, tuple(zip(t[:top_n], v[:top_n])))
                        for logp, v, t in zip(chosen[i, at].tolist(), values[i, at].tolist(),
                                              top_ids[i, at].tolist())])
        return out


def _bucket(n: int, cap: int, least: int = 1) -> int:
    """The power of two >= max(n, least), at most cap (cap >= n)."""
    return min(max(least, 1 << (n - 1).bit_length()), cap)
