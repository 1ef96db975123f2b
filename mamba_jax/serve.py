"""`python -m mamba_jax.serve --checkpoint DIR [--port 6000] [--host 127.0.0.1]`: a text
generation server (aiohttp). DIR is a model dir (HF or mamba_ssm) or a trainer's
--checkpoint-dir (its newest step).

Endpoints:
  PUT  /api             Megatron-LM's text-generation request: {"prompts": [str],
                        "tokens_to_generate", "temperature", "top_k", "top_p"} ->
                        {"text": [prompt + continuation]}
  POST /v1/completions  OpenAI-style: {"prompt": str | [str], "max_tokens", "temperature",
                        "top_p", "stream", "model"} -> a text_completion, or with "stream":
                        server-sent events, one chunk per token, then "data: [DONE]"
  GET  /health          {"status": "ok", ...}

Bad input (a body that is not UTF-8 JSON or nests deeper than Python parses, unknown or
mistyped fields, numbers that are not finite in float32, more prompts than --max-prompts,
a prompt or max_tokens over the limits) is a 400 whose message names the field; a request
that would queue more than --max-queued-tokens (prompt plus new tokens, over all waiting
prompts) is a 503 to retry later. The server keeps serving.

Concurrent requests are batched: a request waits up to --batch-window-ms for others, then
every waiting prompt (up to --max-batch) runs as one `generate` call, with per-row
sampling settings and token limits (all traced values, so any requests are compatible).
Should a batch fail all the same, each of its prompts is run again alone, so that a failure
fails only the request that causes it (a stream then ends with an error event and [DONE]).
Generation runs on one executor thread, off the event loop, so the server answers (health,
bad input, other streams) while a batch decodes. Shapes are bucketed to powers of two
(batch rows, left-padded prompt length, max new tokens), which bounds the compiled
programs to a few per bucket; streaming batches compile a variant that sends each step's
tokens to the host.

A client that disconnects cancels its prompts: those still queued are dropped before they
reach a batch (one log line says how many); those already decoding finish their batch (a
compiled decode loop is not interrupted) and their tokens are discarded.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from mamba_jax.cli import HelpFormatter, command
from mamba_jax.generate import (add_decode_arguments, decode_options, generate,
                                load_for_generation)

log = logging.getLogger("mamba_jax.serve")


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


def _error_body(field: str | None, message: str) -> str:
    return json.dumps({"error": {"message": message, "field": field}})


class BadRequest(web.HTTPBadRequest):
    """A 400 with a JSON body {"error": {"message", "field"}}."""

    def __init__(self, field: str, message: str):
        super().__init__(text=_error_body(field, message), content_type="application/json")


class Busy(web.HTTPServiceUnavailable):
    """A 503 with a JSON body {"error": {"message", "field": null}}: retry after a second."""

    def __init__(self, message: str):
        super().__init__(text=_error_body(None, message), content_type="application/json",
                         headers={"Retry-After": "1"})


def _bucket(n: int, cap: int, least: int = 1) -> int:
    """The power of two >= max(n, least), at most cap (cap >= n)."""
    return min(max(least, 1 << (n - 1).bit_length()), cap)


@dataclasses.dataclass
class _Row:
    """One prompt of a request: its tokens, settings and where its output goes. A cancelled
    future means its client left."""

    ids: list[int]
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    future: asyncio.Future  # -> (new token ids, finish_reason)
    stream: asyncio.Queue | None = None  # new token ids one at a time, then None
    started: bool = False  # taken into a batch

    @property
    def tokens(self) -> int:
        """What it costs the queue: its prompt and new tokens."""
        return len(self.ids) + self.max_new


class Engine:
    """Holds the model, batches waiting rows and runs each batch on the executor thread."""

    def __init__(self, model, tokenizer, limits: Limits, eos_token_id=None,
                 generate_options=None):
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        self.eos = eos_token_id
        self.generate_options = generate_options or {}  # generate's ssm_state_dtype etc.
        self.pending: asyncio.Queue[_Row] = asyncio.Queue()
        self.queued_tokens = 0  # the tokens of the rows in `pending`
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "mamba-generate")
        self.seeds = itertools.count()
        self.batches = 0

    async def _next_row(self) -> _Row:
        """The next queued row whose client still waits (the others are dropped here)."""
        while True:
            row = await self.pending.get()
            self.queued_tokens -= row.tokens
            if not row.future.done():
                row.started = True
                return row

    async def run(self):
        """Forever: wait for a row, gather what arrives within the window, generate."""
        loop = asyncio.get_running_loop()
        while True:
            rows = [await self._next_row()]
            deadline = loop.time() + self.limits.batch_window_s
            while len(rows) < self.limits.max_batch:
                try:
                    rows.append(await asyncio.wait_for(self._next_row(),
                                                       deadline - loop.time()))
                except TimeoutError:
                    break
            await self._generate(loop, rows)

    async def _generate(self, loop, rows: list[_Row]):
        lim = self.limits
        b = _bucket(len(rows), lim.max_batch)
        l = _bucket(max(len(r.ids) for r in rows), lim.max_prompt_tokens, least=16)
        t = _bucket(max(r.max_new for r in rows), lim.max_new_tokens, least=16)
        # Filler rows: a one-token prompt, greedy, stopped after one token.
        fill = [_Row([0], 1, 0.0, 0, 1.0, None)] * (b - len(rows))
        batch = rows + fill
        ids = np.zeros((b, l), np.int32)
        for row, r in zip(ids, batch):
            row[l - len(r.ids):] = r.ids
        streams = [r.stream for r in rows]
        streamed = False

        def deliver(step, tokens):  # on the event loop, in step order
            nonlocal streamed
            for queue, r, token in zip(streams, rows, tokens):
                if queue is not None and step < r.max_new and not r.future.done():
                    queue.put_nowait(int(token))
                    streamed = True

        def on_token(step, tokens):  # on a runtime thread
            loop.call_soon_threadsafe(deliver, step, tokens)

        # Off is top_k = vocab and top_p = 1 for a row; a filter no row uses is left out of
        # the compiled sampler.
        sampled = any(r.temperature > 0 for r in batch)
        vocab = self.model.config.vocab_size
        top_k = [min(r.top_k, vocab) or vocab for r in batch]
        top_p = [r.top_p for r in batch]
        try:
            out = await loop.run_in_executor(self.executor, lambda: np.asarray(generate(
                self.model, ids, t, [r.temperature for r in batch],
                top_k if sampled and min(top_k) < vocab else None,
                top_p if sampled and min(top_p) < 1 else None,
                next(self.seeds), self.eos, prompt_lengths=[len(r.ids) for r in batch],
                max_new_tokens_per_row=[r.max_new for r in batch],
                on_token=on_token if any(streams) else None, **self.generate_options)))
        except Exception as err:  # noqa: BLE001 - keep serving whatever failed
            waiting = [r for r in rows if not r.future.done()]
            if len(waiting) > 1 and not streamed:
                # One row's settings may be what failed: alone, each fails only its own.
                for row in waiting:
                    await self._generate(loop, [row])
                return
            log.error("generation failed for %d prompt(s): %s: %s", len(waiting),
                      type(err).__name__, err)
            for r in waiting:
                if r.stream is not None:
                    r.stream.put_nowait(None)
                r.future.set_exception(err)
            return
        self.batches += 1
        for r, new in zip(rows, out[:, l:]):
            new = new[:r.max_new].tolist()
            reason = "length"
            if self.eos is not None and self.eos in new:
                new, reason = new[:new.index(self.eos)], "stop"
            if r.stream is not None:
                r.stream.put_nowait(None)
            if not r.future.done():
                r.future.set_result((new, reason))

    def tokenize(self, prompt: str, field: str) -> list[int]:
        """A prompt's token ids; a 400 naming field if it is empty or too long."""
        ids = self.tokenizer.encode(prompt).ids
        if not 1 <= len(ids) <= self.limits.max_prompt_tokens:
            raise BadRequest(field, f"{field}: the prompt is {len(ids)} tokens; it must be 1 "
                             f"to {self.limits.max_prompt_tokens} (the server's limit)")
        return ids

    def submit(self, ids: list[int], max_new: int, temperature: float, top_k: int,
               top_p: float, stream: bool) -> _Row:
        """Queue one prompt for the next batch."""
        row = _Row(ids, max_new, temperature, top_k, top_p,
                   asyncio.get_running_loop().create_future(),
                   asyncio.Queue() if stream else None)
        self.pending.put_nowait(row)
        self.queued_tokens += row.tokens
        return row

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _float32(value) -> float | None:
    """value as the float32 that generation computes with, or None where that is not a
    finite number (NaN, Infinity, 1e39, a 400-digit integer)."""
    try:
        with np.errstate(over="ignore"):  # 1e39 becomes inf, refused below
            f = float(np.float32(value))
    except (OverflowError, ValueError, TypeError):
        return None
    return f if math.isfinite(f) else None


def _temperature(value) -> bool:
    f = _float32(value)
    return f is not None and f >= 0


# Request schemas: field -> (accepted types, default, check or None, what it must be).
# Settings are checked as the float32 they become: a top_p of 1e-300 is 0 there.
_NUMBER = (int, float)
MEGATRON = {
    "prompts": (list, None, lambda v: v and all(isinstance(p, str) for p in v),
                "a non-empty list of strings"),
    "tokens_to_generate": (int, 64, None, "an integer"),
    "temperature": (_NUMBER, 1.0, _temperature, "a finite number >= 0 (0 is greedy)"),
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0 (0 is off)"),
    "top_p": (_NUMBER, 0.0, lambda v: v == 0 or 0 < (_float32(v) or 0) <= 1,
              "0 (off) or a number in (0, 1] that stays above 0 in float32"),
}
COMPLETIONS = {
    "prompt": ((str, list), None, lambda v: isinstance(v, str) or (
        v and all(isinstance(p, str) for p in v)), "a string or a non-empty list of strings"),
    "max_tokens": (int, 16, None, "an integer"),
    "temperature": (_NUMBER, 1.0, _temperature, "a finite number >= 0 (0 is greedy)"),
    "top_p": (_NUMBER, 1.0, lambda v: 0 < (_float32(v) or 0) <= 1,
              "a number in (0, 1] that stays above 0 in float32"),
    "stream": (bool, False, None, "true or false"),
    "model": (str, "", None, "a string"),
}


async def _body(request: web.Request):
    """The request body as JSON: a 400 naming the body or its Content-Type when it is not
    text of the declared charset (UTF-8 by default), not JSON, or nested too deeply."""
    charset = request.charset or "utf-8"
    try:
        text = (await request.read()).decode(charset)
    except LookupError:
        raise BadRequest("Content-Type", f"Content-Type: charset={charset} is not a known "
                         "encoding; send UTF-8 JSON") from None
    except UnicodeDecodeError as err:
        raise BadRequest("body", f"the request body is not {charset} text: {err}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise BadRequest("body", "the request body nests JSON too deeply") from None
    except ValueError as err:  # JSONDecodeError, or an integer of over 4300 digits
        raise BadRequest("body", f"the request body is not valid JSON: {err}") from None


async def _parse(request: web.Request, schema: dict, max_new_field: str, limits: Limits):
    """The request's JSON object checked against schema, defaults filled in."""
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise BadRequest(unknown[0], f"unknown field {unknown[0]!r}; this endpoint takes "
                         f"{sorted(schema)}")
    values = {}
    for name, (types, default, check, must) in schema.items():
        if name not in body:
            if default is None:
                raise BadRequest(name, f"{name} is required: {must}")
            values[name] = default
            continue
        value = body[name]
        # JSON true/false are Python bools, which are also ints: only "stream" takes them.
        if (isinstance(value, bool) and types is not bool) or not isinstance(value, types) \
                or (check is not None and not check(value)):
            shown = json.dumps(value)
            raise BadRequest(name, f"{name}={shown if len(shown) <= 60 else shown[:57] + '...'}"
                             f" must be {must}")
        values[name] = value
    n = values[max_new_field]
    if not 1 <= n <= limits.max_new_tokens:
        raise BadRequest(max_new_field, f"{max_new_field}={n} must be in [1, "
                         f"{limits.max_new_tokens}] (the server's limit)")
    return values


def _rows(engine: Engine, prompts, field, max_new, temperature, top_k, top_p, stream=False):
    """Tokenize every prompt before queueing any, so a 400 or 503 leaves nothing running."""
    lim = engine.limits
    if len(prompts) > lim.max_prompts:
        raise BadRequest(field, f"{field}: {len(prompts)} prompts; at most {lim.max_prompts} "
                         "per request (the server's limit)")
    names = [f"{field}[{i}]" if len(prompts) > 1 else field for i in range(len(prompts))]
    ids = [engine.tokenize(p, name) for p, name in zip(prompts, names)]
    tokens = sum(len(i) + max_new for i in ids)
    if tokens > lim.max_queued_tokens:
        raise BadRequest(field, f"{field}: the request needs {tokens} prompt and new tokens, "
                         f"more than the server queues at once ({lim.max_queued_tokens}); "
                         "split it")
    if engine.queued_tokens + tokens > lim.max_queued_tokens:
        raise Busy(f"the server is busy ({engine.queued_tokens} tokens queued, at most "
                   f"{lim.max_queued_tokens}); retry shortly")
    return [engine.submit(i, max_new, float(temperature), top_k, float(top_p), stream)
            for i in ids]


def _drop(request: web.Request, rows: list[_Row]):
    """The client of `rows` left: cancel them (the handler's cancellation may have done so
    already) and log one line."""
    for r in rows:
        r.future.cancel()
    queued = sum(not r.started for r in rows)
    decoding = sum(r.started and r.future.cancelled() for r in rows)
    log.warning("client %s left: %d queued prompt(s) dropped, %d decoding in the current "
                "batch discarded", request.remote, queued, decoding)


async def _results(request: web.Request, rows: list[_Row]):
    """Every row's (new tokens, finish_reason); the rows are cancelled if the client leaves,
    and a failed generation is a 500 naming the error (the other rows cancelled too)."""
    try:
        return await asyncio.gather(*(r.future for r in rows))
    except asyncio.CancelledError:
        _drop(request, rows)
        raise
    except Exception as err:  # noqa: BLE001 - logged by the engine
        for r in rows:
            r.future.cancel()
        raise web.HTTPInternalServerError(
            text=_error_body(None, f"generation failed: {type(err).__name__}: {err}"),
            content_type="application/json") from None


async def megatron_api(request: web.Request):
    engine: Engine = request.app[ENGINE]
    v = await _parse(request, MEGATRON, "tokens_to_generate", engine.limits)
    rows = _rows(engine, v["prompts"], "prompts", v["tokens_to_generate"], v["temperature"],
                 v["top_k"], v["top_p"] or 1.0)
    results = await _results(request, rows)
    return web.json_response({"text": [p + engine.text(new)
                                       for p, (new, _) in zip(v["prompts"], results)]})


async def completions(request: web.Request):
    engine: Engine = request.app[ENGINE]
    v = await _parse(request, COMPLETIONS, "max_tokens", engine.limits)
    prompts = [v["prompt"]] if isinstance(v["prompt"], str) else v["prompt"]
    rows = _rows(engine, prompts, "prompt", v["max_tokens"], v["temperature"], 0, v["top_p"],
                 stream=v["stream"])
    meta = {"id": f"cmpl-{id(rows[0]):x}", "object": "text_completion",
            "created": int(time.time()), "model": v["model"] or request.app[MODEL_NAME]}
    if not v["stream"]:
        results = await _results(request, rows)
        return web.json_response({**meta, "choices": [
            {"index": i, "text": engine.text(new), "finish_reason": reason}
            for i, (new, reason) in enumerate(results)], "usage": {
            "prompt_tokens": sum(len(r.ids) for r in rows),
            "completion_tokens": sum(len(new) for new, _ in results)}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})

    async def send(payload):
        await response.write(f"data: {payload}\n\n".encode())

    try:
        await response.prepare(request)
        for i, row in enumerate(rows):
            tokens, sent = [], ""
            while (token := await row.stream.get()) is not None:
                if token == engine.eos:
                    break
                tokens.append(token)
                text = engine.text(tokens)
                if text.endswith("\ufffd"):  # a multi-byte character not yet complete
                    continue
                await send(json.dumps({**meta, "choices": [
                    {"index": i, "text": text[len(sent):], "finish_reason": None}]}))
                sent = text
            try:
                _, reason = await row.future
            except Exception as err:  # noqa: BLE001 - logged by the engine
                await send(_error_body(None, f"generation failed: {type(err).__name__}: {err}"))
                break
            await send(json.dumps({**meta, "choices": [
                {"index": i, "text": engine.text(tokens)[len(sent):],
                 "finish_reason": reason}]}))
        await send("[DONE]")
    except (asyncio.CancelledError, ConnectionResetError) as left:
        _drop(request, rows)
        if isinstance(left, asyncio.CancelledError):
            raise
    return response


async def health(request: web.Request):
    engine: Engine = request.app[ENGINE]
    return web.json_response({"status": "ok", "model": request.app[MODEL_NAME],
                              "queued": engine.pending.qsize(), "batches": engine.batches})


ENGINE = web.AppKey("engine", Engine)
MODEL_NAME = web.AppKey("model_name", str)


def make_app(model, tokenizer, limits: Limits = Limits(), eos_token_id=None,
             model_name: str = "mamba2", generate_options=None) -> web.Application:
    """The aiohttp application; its batching task runs while the app does.
    generate_options: keyword arguments of every generate call (ssm_state_dtype,
    step_implementation)."""
    # A client that disconnects cancels its handler, which cancels its prompts.
    app = web.Application(handler_args={"handler_cancellation": True})
    app[MODEL_NAME] = model_name

    async def engine_task(app):
        app[ENGINE] = Engine(model, tokenizer, limits, eos_token_id, generate_options)
        task = asyncio.create_task(app[ENGINE].run())
        yield
        task.cancel()
        app[ENGINE].executor.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(engine_task)
    app.router.add_put("/api", megatron_api)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


@command("python -m mamba_jax.serve")
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_jax.serve",
                                     description="Serve a Mamba2 checkpoint over HTTP.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint dir (HF or mamba_ssm), or a trainer's "
                             "--checkpoint-dir (its newest step)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 exposes the server to the network)")
    parser.add_argument("--port", type=int, default=6000)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json path or 'bytes' (default: the checkpoint's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-prompt-tokens", type=int, default=Limits.max_prompt_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=Limits.max_new_tokens)
    parser.add_argument("--max-batch", type=int, default=Limits.max_batch)
    parser.add_argument("--batch-window-ms", type=float, default=1e3 * Limits.batch_window_s)
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts,
                        help="prompts in one request")
    parser.add_argument("--max-queued-tokens", type=int, default=Limits.max_queued_tokens,
                        help="prompt and new tokens of all waiting prompts; more is a 503")
    add_decode_arguments(parser)
    args = parser.parse_args(argv)

    model, tokenizer, eos = load_for_generation(args.checkpoint, args.tokenizer, args.dtype)
    limits = Limits(args.max_prompt_tokens, args.max_new_tokens, args.max_batch,
                    args.batch_window_ms / 1e3, args.max_prompts, args.max_queued_tokens)
    web.run_app(make_app(model, tokenizer, limits, eos, Path(args.checkpoint).name,
                         decode_options(args)),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
