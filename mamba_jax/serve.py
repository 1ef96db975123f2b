"""`python -m mamba_jax.serve --checkpoint DIR [--port 6000] [--host 127.0.0.1]`: a text
generation server (aiohttp). DIR is a model dir (HF or mamba_ssm) or a trainer's
--checkpoint-dir (its newest step).

Endpoints:
  PUT  /api             Megatron-LM's text-generation request: {"prompts": [str],
                        "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs",
                        "random_seed", "add_BOS", "stop_on_eol", "stop_on_double_eol",
                        "prevent_newline_after_colon", "top_p_decay", "top_p_bound",
                        "length_penalty"} -> Megatron's {"text": [prompt + continuation],
                        "segments": [[each token's text]], "tokens": [[prompt and new
                        ids]], "logprobs": [[log p of each token after the first]] (with
                        "logprobs": true)}. "beam_width" is a 400 (BEAM_SEARCH says why).
  POST /v1/completions  OpenAI-style: {"prompt": str | [str], "max_tokens", "temperature",
                        "top_p", "n", "stop", "logprobs", "stream", "model"} -> a
                        text_completion, or with "stream": server-sent events, one chunk
                        per token, then "data: [DONE]"
  GET  /v1/models       OpenAI-style: the one model served, {"object": "list", "data":
                        [{"id", "object": "model", "created", "owned_by"}]} (OpenAI's
                        clients list the models before they complete)
  GET  /health          {"status": "ok", ...}

Megatron's fields as its server reads them: stop_on_eol ends a continuation at its first
token whose text holds a newline, stop_on_double_eol at two newlines in a row (the prompt's
last newline counts), the ending token kept (Megatron stops at GPT-2's newline ids; here
the tokens' text decides, for any tokenizer); prevent_newline_after_colon bans the
token of "\n" right after the token of ":" (each as it reads after other text); top_p
decays to max(top_p * top_p_decay**i, top_p_bound) at new token i; random_seed makes a
request's samples reproducible (each prompt samples from it, whatever decodes beside it);
add_BOS puts the tokenizer's BOS token first. The stops end the text after the decode
loop, which runs to the token limit or eos. length_penalty is accepted and unused, as
Megatron's sampling path does (it weighs beam search's hypotheses). logprobs come from one
forward pass over the prompt and continuation (Engine.score): the raw logits'
log-softmax, as Megatron's.

Bad input (a body that is not UTF-8 JSON or nests deeper than Python parses, unknown or
mistyped fields, numbers that are not finite in float32, more prompts than --max-prompts,
a prompt or max_tokens over the limits) is a 400 whose message names the field; a request
that would queue more than --max-queued-tokens (prompt plus new tokens, over all waiting
prompts) is a 503 to retry later. The server keeps serving.

Requests decode in the engine's slots (mamba_jax.engine: continuous batching; a request
joins the running batch at its next step and leaves it when done), each prompt with its own
sampling settings and token limit. A failure fails the request it is in (a stream then ends
with an error event and [DONE]). A client that disconnects cancels its prompts: those still
queued never run, those decoding leave their slots at the engine's next step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import socket
import sys
import time
from pathlib import Path

import numpy as np

try:
    from aiohttp import web
except ImportError as missing:
    if __name__ != "__main__":
        raise
    # `python -m mamba_jax.serve` without the [serve] extra: the CLI's one line, not a traceback
    print(f"python -m mamba_jax.serve: the server needs {missing.name}: pip install "
          "'mamba-jax[serve]'", file=sys.stderr)
    raise SystemExit(2) from None

from mamba_jax import compilation_cache
from mamba_jax import engine as slot_engine
from mamba_jax.cli import HelpFormatter, command, require_at_least
from mamba_jax.engine import (EngineOptions, GenerationError, Limits, SamplingParams, Sequence,
                              add_engine_arguments, check_options, engine_options)
from mamba_jax.generate import (MOST_NEW_TOKENS, add_decode_arguments, decode_options,
                                load_for_generation)
from mamba_jax.tokenizer import special_token_ids

log = logging.getLogger("mamba_jax.serve")


MAX_BODY_BYTES = 1 << 20  # a request's body (aiohttp's default)


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


@dataclasses.dataclass
class _Row:
    """One prompt of a request as the handlers await it: its ids, the engine's Sequence, a
    future of (new token ids, finish_reason) and, streamed, a queue of its ids as they come
    (then None). Cancelling the future cancels the sequence."""

    ids: list[int]
    seq: Sequence
    future: asyncio.Future
    stream: asyncio.Queue | None = None

    def __post_init__(self):
        self.future.add_done_callback(lambda f: f.cancelled() and self.seq.cancel())
        asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self):
        try:
            async for event in self.seq:
                if self.stream is not None:
                    self.stream.put_nowait(event.token_id)
        except GenerationError as err:
            if not self.future.done():
                self.future.set_exception(err)
        else:
            if not self.future.done():
                self.future.set_result((self.seq.tokens, self.seq.finish_reason))
        finally:
            if self.stream is not None:
                self.stream.put_nowait(None)


class Engine(slot_engine.Engine):
    """The engine (mamba_jax.engine) and the text of its tokens: tokenizing, decoding,
    each token's piece of the text, and scoring as the endpoints answer it."""

    def tokenize(self, prompt: str, field: str, add_bos: bool = False) -> list[int]:
        """A prompt's token ids (after the tokenizer's BOS token with add_bos); a 400 naming
        field if it is empty or too long, or add_bos and the tokenizer has no BOS."""
        ids = self.tokenizer.encode(prompt).ids
        if add_bos:
            bos = special_token_ids(self.tokenizer)["bos_token_id"]
            if bos is None:
                raise BadRequest("add_BOS", "add_BOS: this server's tokenizer has no BOS "
                                 "token; leave add_BOS out")
            ids = [bos] + ids
        if not 1 <= len(ids) <= self.limits.max_prompt_tokens:
            raise BadRequest(field, f"{field}: the prompt is {len(ids)} tokens; it must be 1 "
                             f"to {self.limits.max_prompt_tokens} (the server's limit)")
        return ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def continuation(self, prompt: list[int], new: list[int]) -> str:
        """The text new adds after prompt (decoded together: a SentencePiece model drops the
        space that begins a text decoded alone)."""
        head, whole = self.text(prompt), self.text(prompt + new)
        return whole[len(head):] if whole.startswith(head) else self.text(new)

    def token_of(self, text: str) -> int:
        """The first token text adds after other text (how ":" and "\n" reach the sampler:
        Megatron takes the first token of each alone, which for GPT-2 is the same, and for a
        SentencePiece model the word-start piece)."""
        before = self.tokenizer.encode("a").ids
        ids = self.tokenizer.encode("a" + text).ids
        ids = ids[len(before):] if ids[:len(before)] == before else ids
        return ids[0] if ids else -1

    def segments(self, ids: list[int], window: int = 8) -> list[str]:
        """Each token's text: what decoding it adds to the tokens before it (decoded from up
        to `window` tokens back, so the cost is linear); a token that ends inside a
        multi-byte character adds "" and the one that completes it the character."""
        pieces = []
        for j in range(len(ids)):
            start = max(0, j - window)
            before = self.text(ids[start:j]).rstrip("\ufffd") if j > start else ""
            after = self.text(ids[start:j + 1])
            after = after if j == len(ids) - 1 else after.rstrip("\ufffd")
            pieces.append(after[len(before):] if after.startswith(before) else after)
        return pieces

    def new_segments(self, prompt: list[int], new: list[int], window: int = 8) -> list[str]:
        """Each new token's text as it reads after prompt (`segments` over prompt's last
        `window` tokens and new, prompt's own left out)."""
        context = prompt[-window:]
        return self.segments(context + new, window)[len(context):]

    async def logprobs(self, sequences: list[list[int]]):
        """Engine.score of each sequence (prompt and continuation): [log p of each token
        after the first] per sequence, and the TOP_LOGPROBS most likely tokens' [(log p, id)]
        at each of those positions."""
        try:
            scored = await self.score(sequences, TOP_LOGPROBS)
        except Exception as err:  # noqa: BLE001 - the model's (NaN logits), not the request's
            log.error("scoring failed for %d sequence(s): %s: %s", len(sequences),
                      type(err).__name__, err)
            raise web.HTTPInternalServerError(
                text=_error_body(None, f"scoring failed: {type(err).__name__}: {err}"),
                content_type="application/json") from None
        return ([[logp for logp, _ in seq] for seq in scored],
                [[[(p, i) for i, p in top] for _, top in seq] for seq in scored])


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


# Request schemas: field -> (accepted types, default, check or None, what it must be). A
# default of REQUIRED makes the field required; OPTIONAL leaves it None when absent.
# Settings are checked as the float32 they become: a top_p of 1e-300 is 0 there.
REQUIRED, OPTIONAL = object(), object()
TOP_LOGPROBS = 5  # the most likely tokens /v1/completions lists per position at most
_NUMBER = (int, float)
_UNIT = lambda v: 0 <= (_float32(v) if _float32(v) is not None else -1) <= 1
MEGATRON = {
    "prompts": (list, REQUIRED, lambda v: v and all(isinstance(p, str) for p in v),
                "a non-empty list of strings"),
    "tokens_to_generate": (int, 64, None, "an integer"),
    "temperature": (_NUMBER, 1.0, _temperature, "a finite number >= 0 (0 is greedy)"),
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0 (0 is off)"),
    "top_p": (_NUMBER, 0.0, lambda v: v == 0 or 0 < (_float32(v) or 0) <= 1,
              "0 (off) or a number in (0, 1] that stays above 0 in float32"),
    "logprobs": (bool, False, None, "true or false"),
    # A jax PRNG key takes 32 bits of a seed: larger ones would collide.
    "random_seed": (int, OPTIONAL, lambda v: 0 <= v < 1 << 32, "an integer in [0, 2**32)"),
    "add_BOS": (bool, False, None, "true or false"),
    "stop_on_eol": (bool, False, None, "true or false"),
    "stop_on_double_eol": (bool, False, None, "true or false"),
    "prevent_newline_after_colon": (bool, False, None, "true or false"),
    "top_p_decay": (_NUMBER, 0.0, _UNIT, "a number in [0, 1] (0 is off)"),
    "top_p_bound": (_NUMBER, 0.0, _UNIT, "a number in [0, 1] (0 is off)"),
    "length_penalty": (_NUMBER, 1.0, lambda v: _float32(v) is not None, "a finite number"),
    "beam_width": (int, OPTIONAL, None, "an integer"),
}
# Why PUT /api answers a beam_width with a 400 (Megatron-LM's own server now refuses it too:
# "Beam search is no longer supported").
BEAM_SEARCH = ("beam_width: beam search is not supported: the compiled decode loop carries "
               "one recurrent state per row (every Mamba layer's conv window and SSM state), "
               "and beam search would have to copy those states between beams at every "
               "token; sample instead (temperature, top_k, top_p), or send several prompts")
COMPLETIONS = {
    "prompt": ((str, list), REQUIRED, lambda v: isinstance(v, str) or (
        v and all(isinstance(p, str) for p in v)), "a string or a non-empty list of strings"),
    "max_tokens": (int, 16, None, "an integer"),
    "temperature": (_NUMBER, 1.0, _temperature, "a finite number >= 0 (0 is greedy)"),
    "top_p": (_NUMBER, 1.0, lambda v: 0 < (_float32(v) or 0) <= 1,
              "a number in (0, 1] that stays above 0 in float32"),
    "n": (int, 1, lambda v: v >= 1, "an integer >= 1 (completions per prompt)"),
    "stop": ((str, list), OPTIONAL, lambda v: (isinstance(v, str) and v) or (
        isinstance(v, list) and 1 <= len(v) <= 4 and all(isinstance(s, str) and s for s in v)),
        "a non-empty string or a list of 1 to 4 of them"),
    "logprobs": (int, OPTIONAL, lambda v: 0 <= v <= TOP_LOGPROBS,
                 f"an integer in [0, {TOP_LOGPROBS}] (the most likely tokens listed per "
                 "position)"),
    "stream": (bool, False, None, "true or false"),
    "model": (str, "", None, "a string"),
}


async def _body(request: web.Request):
    """The request body as JSON: a 400 naming the body or its Content-Type when it is not
    text of the declared charset (UTF-8 by default), not JSON, or nested too deeply, and
    naming the field whose strings are not valid Unicode."""
    charset = request.charset or "utf-8"
    try:
        text = (await request.read()).decode(charset)
    except LookupError:
        raise BadRequest("Content-Type", f"Content-Type: charset={charset} is not a known "
                         "encoding; send UTF-8 JSON") from None
    except UnicodeDecodeError as err:
        raise BadRequest("body", f"the request body is not {charset} text: {err}") from None
    except web.HTTPRequestEntityTooLarge as err:  # aiohttp's answer is plain text
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_BODY_BYTES, actual_size=request.content_length or MAX_BODY_BYTES + 1,
            text=_error_body("body", f"the request body is over {MAX_BODY_BYTES} bytes, the "
                             "server's limit: send fewer or shorter prompts a request"),
            content_type="application/json") from err
    try:
        body = json.loads(text)
    except RecursionError:
        raise BadRequest("body", "the request body nests JSON too deeply") from None
    except ValueError as err:  # JSONDecodeError, or an integer of over 4300 digits
        raise BadRequest("body", f"the request body is not valid JSON: {err}") from None
    for name, value in body.items() if isinstance(body, dict) else [("body", body)]:
        if _holds_lone_surrogate(value) or _holds_lone_surrogate(name):
            raise BadRequest(name, f"{name} holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                             "escape without its pair), which is no text; send valid Unicode")
    return body


def _holds_lone_surrogate(value) -> bool:
    """Whether parsed JSON holds a string that is not valid Unicode: JSON's \\u escapes can
    spell half a UTF-16 pair, which Python keeps in a str and no tokenizer takes."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend([*v, *v.values()])
    return False


async def _parse(request: web.Request, schema: dict, max_new_field: str, limits: Limits,
                 least_new: int = 1, null_is_absent: bool = False):
    """The request's JSON object checked against schema, defaults filled in;
    max_new_field in [least_new, the server's limit]. null_is_absent: a null field takes its
    default, as OpenAI's API reads its optional fields (its clients may send them as null)."""
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise BadRequest(unknown[0], f"unknown field {unknown[0]!r}; this endpoint takes "
                         f"{sorted(schema)}")
    values = {}
    for name, (types, default, check, must) in schema.items():
        if name not in body or (null_is_absent and body[name] is None):
            if default is REQUIRED:
                raise BadRequest(name, f"{name} is required: {must}")
            values[name] = None if default is OPTIONAL else default
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
    if not least_new <= n <= limits.max_new_tokens:
        raise BadRequest(max_new_field, f"{max_new_field}={n} must be in [{least_new}, "
                         f"{limits.max_new_tokens}] (the server's limit)")
    return values


def _check_prompts(limits: Limits, count: int, field: str) -> None:
    """Refuse a request of more than the server's --max-prompts prompts (rows)."""
    if count > limits.max_prompts:
        raise BadRequest(field, f"{field}: {count} prompts; at most {limits.max_prompts} per "
                         "request (the server's limit)")


def _tokenized(engine: Engine, prompts, field, add_bos=False) -> list[list[int]]:
    """Every prompt's ids (Engine.tokenize), at most the server's --max-prompts of them."""
    _check_prompts(engine.limits, len(prompts), field)
    names = [f"{field}[{i}]" if len(prompts) > 1 else field for i in range(len(prompts))]
    return [engine.tokenize(p, name, add_bos) for p, name in zip(prompts, names)]


def _rows(engine: Engine, ids, field, max_new, temperature, top_k, top_p, stream=False,
          **extra):
    """Queue every prompt's ids (checked first, so a 400 or 503 leaves nothing running);
    extra: SamplingParams' other settings."""
    lim = engine.limits
    _check_prompts(lim, len(ids), field)
    tokens = sum(len(i) + max_new for i in ids)
    if tokens > lim.max_queued_tokens:
        raise BadRequest(field, f"{field}: the request needs {tokens} prompt and new tokens, "
                         f"more than the server queues at once ({lim.max_queued_tokens}); "
                         "split it")
    if engine.queued_tokens + tokens > lim.max_queued_tokens:
        raise Busy(f"the server is busy ({engine.queued_tokens} tokens queued, at most "
                   f"{lim.max_queued_tokens}); retry shortly")
    params = SamplingParams(max_new, float(temperature), top_k, float(top_p), **extra)
    try:
        seqs = [engine.submit(i, params) for i in ids]
    except ValueError as err:  # what the engine cannot hold (a hybrid's attention keys)
        raise BadRequest(field, f"{field}: {err}") from None
    loop = asyncio.get_running_loop()
    return [_Row(i, seq, loop.create_future(), asyncio.Queue() if stream else None)
            for i, seq in zip(ids, seqs)]


def _drop(request: web.Request, rows: list[_Row]):
    """The client of `rows` left: cancel them (the handler's cancellation may have done so
    already) and log one line."""
    for r in rows:
        r.future.cancel()
    log.warning("client %s left: %d prompt(s) cancelled", request.remote, len(rows))


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


def _first_stop(text: str, stops) -> int | None:
    """Where the first of the stop strings begins in text, or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def _line_end(engine: Engine, prompt: list[int], new: list[int], double: bool) -> list[int]:
    """new up to and with its first token that completes a newline (double: two newlines in
    a row, the prompt's last character counting): Megatron's stop_on_eol and
    stop_on_double_eol, on the tokens' text."""
    text = engine.text(prompt)[-1:] if double else ""
    for j, piece in enumerate(engine.new_segments(prompt, new)):
        text += piece
        if ("\n\n" if double else "\n") in text:
            return new[:j + 1]
    return new


async def megatron_api(request: web.Request):
    engine: Engine = request.app[ENGINE]
    v = await _parse(request, MEGATRON, "tokens_to_generate", engine.limits, least_new=0)
    if v["beam_width"] is not None:
        raise BadRequest("beam_width", BEAM_SEARCH)
    if v["tokens_to_generate"] == 0 and not v["logprobs"]:
        raise BadRequest("tokens_to_generate", "tokens_to_generate=0 generates nothing: it "
                         "scores the prompts, and needs logprobs=true")
    for name in ("top_p_decay", "top_p_bound"):
        if v[name] and not v["top_p"]:
            raise BadRequest(name, f"{name}={v[name]} needs top_p > 0: it changes top_p")
    if v["top_p_bound"] > v["top_p"]:
        raise BadRequest("top_p_bound", f"top_p_bound={v['top_p_bound']} must be at most "
                         f"top_p={v['top_p']} (top_p decays down to it)")
    ids = _tokenized(engine, v["prompts"], "prompts", v["add_BOS"])
    new = [[] for _ in ids]
    if v["tokens_to_generate"]:
        ban = ((engine.token_of(":"), engine.token_of("\n"))
               if v["prevent_newline_after_colon"] else None)
        rows = _rows(engine, ids, "prompts", v["tokens_to_generate"], v["temperature"],
                     v["top_k"], v["top_p"] or 1.0, top_p_decay=float(v["top_p_decay"]),
                     top_p_bound=float(v["top_p_bound"]), banned_after=ban,
                     seed=v["random_seed"])
        new = [tokens for tokens, _ in await _results(request, rows)]
        if v["stop_on_eol"] or v["stop_on_double_eol"]:
            new = [_line_end(engine, i, n, v["stop_on_double_eol"]) for i, n in zip(ids, new)]
    tokens = [i + n for i, n in zip(ids, new)]
    response = {"text": [p + engine.continuation(i, n)
                         for p, i, n in zip(v["prompts"], ids, new)],
                "segments": [engine.segments(t) for t in tokens], "tokens": tokens}
    if v["logprobs"]:
        response["logprobs"], _ = await engine.logprobs(tokens)
    return web.json_response(response)


async def _openai_logprobs(engine: Engine, rows: list[_Row], new: list[list[int]],
                           prompts: list[str], top_n: int) -> list[dict]:
    """OpenAI's completion logprobs of each row's new tokens: their texts, log-probabilities,
    the top_n most likely tokens at each position ({text: log p}; null for 0) and each
    token's character offset from the start of the prompt."""
    sequences = [r.ids + n for r, n in zip(rows, new)]
    chosen, top = await engine.logprobs(sequences)
    def listed(position):  # {text: log p}, most likely first; tokens of one text: the first
        found = {}
        for logp, token in position:
            found.setdefault(engine.text([token]), logp)
        return found

    out = []
    for r, n, prompt, lp, t in zip(rows, new, prompts, chosen, top):
        pieces = engine.new_segments(r.ids, n)
        offsets = np.cumsum([len(prompt)] + [len(p) for p in pieces])[:-1].tolist()
        first = len(r.ids) - 1  # position of the first new token's log-probability
        out.append({"tokens": pieces, "token_logprobs": lp[first:], "text_offset": offsets,
                    "top_logprobs": None if not top_n else [
                        listed(p[:top_n]) for p in t[first:]]})
    return out


async def completions(request: web.Request):
    engine: Engine = request.app[ENGINE]
    v = await _parse(request, COMPLETIONS, "max_tokens", engine.limits, null_is_absent=True)
    prompts = [v["prompt"]] if isinstance(v["prompt"], str) else v["prompt"]
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"] or []
    if v["stream"] and v["logprobs"] is not None:
        raise BadRequest("logprobs", "logprobs are not streamed; ask for them without stream")
    # n copies of each prompt: where they pass a limit the prompts alone do not, n is named
    # (checked before they are made: a huge n held the server while it built them)
    _check_prompts(engine.limits, len(prompts) * v["n"], "prompt" if v["n"] == 1 else "n")
    ids = [i for i in _tokenized(engine, prompts, "prompt") for _ in range(v["n"])]
    rows = _rows(engine, ids, "prompt" if v["n"] == 1 else "n", v["max_tokens"],
                 v["temperature"], 0, v["top_p"], stream=v["stream"])
    prompts = [p for p in prompts for _ in range(v["n"])]
    meta = {"id": f"cmpl-{id(rows[0]):x}", "object": "text_completion",
            "created": int(time.time()), "model": v["model"] or request.app[MODEL_NAME]}
    if not v["stream"]:
        results = await _results(request, rows)
        choices, kept = [], []
        for i, (row, (new, reason)) in enumerate(zip(rows, results)):
            text = engine.continuation(row.ids, new)
            cut = _first_stop(text, stops)
            if cut is not None:  # the tokens that the text before the stop needs
                ends = np.cumsum([len(p) for p in engine.new_segments(row.ids, new)])
                new = new[:int(np.searchsorted(ends, cut)) + 1 if cut else 0]
                text, reason = text[:cut], "stop"
            kept.append(new)
            choices.append({"index": i, "text": text, "finish_reason": reason,
                            "logprobs": None})
        if v["logprobs"] is not None:
            for choice, lp in zip(choices, await _openai_logprobs(engine, rows, kept, prompts,
                                                                  v["logprobs"])):
                choice["logprobs"] = lp
        return web.json_response({**meta, "choices": choices, "usage": {
            "prompt_tokens": sum(len(r.ids) for r in rows[::v["n"]]),
            "completion_tokens": sum(map(len, kept))}})  # as the stops cut them
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})

    async def send(payload):
        await response.write(f"data: {payload}\n\n".encode())

    hold = max(map(len, stops), default=1) - 1  # text that may be a stop's beginning waits
    try:
        await response.prepare(request)
        for i, row in enumerate(rows):
            tokens, sent, stopped = [], "", False
            while (token := await row.stream.get()) is not None:
                if token == engine.eos:
                    break
                tokens.append(token)
                text = engine.continuation(row.ids, tokens)
                if text.endswith("\ufffd"):  # a multi-byte character not yet complete
                    continue
                cut = _first_stop(text, stops)
                stopped = cut is not None
                text = text[:cut] if stopped else text[:max(len(text) - hold, 0)]
                if len(text) > len(sent):
                    await send(json.dumps({**meta, "choices": [
                        {"index": i, "text": text[len(sent):], "finish_reason": None}]}))
                    sent = text
                if stopped:
                    break
            try:
                _, reason = await row.future
            except Exception as err:  # noqa: BLE001 - logged by the engine
                await send(_error_body(None, f"generation failed: {type(err).__name__}: {err}"))
                break
            rest = "" if stopped else engine.continuation(row.ids, tokens)[len(sent):]
            await send(json.dumps({**meta, "choices": [
                {"index": i, "text": rest, "finish_reason": "stop" if stopped else reason}]}))
        await send("[DONE]")
    except (asyncio.CancelledError, ConnectionResetError) as left:
        _drop(request, rows)
        if isinstance(left, asyncio.CancelledError):
            raise
    return response


async def models(request: web.Request):
    return web.json_response({"object": "list", "data": [
        {"id": request.app[MODEL_NAME], "object": "model", "created": request.app[STARTED],
         "owned_by": "mamba-jax"}]})


async def health(request: web.Request):
    engine: Engine = request.app[ENGINE]
    stats = engine.stats()
    return web.json_response({"status": "ok", "model": request.app[MODEL_NAME],
                              "queued": stats["queued"], "slots_busy": stats["slots_busy"]})


ENGINE = web.AppKey("engine", Engine)
MODEL_NAME = web.AppKey("model_name", str)
STARTED = web.AppKey("started", int)  # the server's start, seconds since the epoch


def make_app(model, tokenizer, limits: Limits = Limits(), eos_token_id=None,
             model_name: str = "mamba2", generate_options=None,
             engine_options=None) -> web.Application:
    """The aiohttp application; its engine runs while the app does. generate_options: how
    the decode steps run (ssm_state_dtype, step_implementation); engine_options:
    mamba_jax.engine.EngineOptions' fields (slots, prefix_cache_mb, ...). A ValueError for
    a model or options the engine cannot serve."""
    # A client that disconnects cancels its handler, which cancels its prompts.
    app = web.Application(handler_args={"handler_cancellation": True},
                          client_max_size=MAX_BODY_BYTES)
    app[MODEL_NAME] = model_name
    app[STARTED] = int(time.time())
    app[ENGINE] = Engine(model, tokenizer, limits, eos_token_id, generate_options,
                         **(engine_options or {}))

    async def engine_task(app):
        task = asyncio.create_task(app[ENGINE].run())
        yield
        task.cancel()
        app[ENGINE].executor.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(engine_task)
    app.router.add_put("/api", megatron_api)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def _check_serving_flags(args):
    """Refuse limits the server could not serve under and an address it cannot listen on,
    before the model loads (minutes for a large one)."""
    require_at_least(args, ("max_prompt_tokens", "max_new_tokens", "max_prompts",
                            "max_queued_tokens"))
    if args.max_new_tokens > MOST_NEW_TOKENS:  # generate's bound: each request would fail
        raise SystemExit(f"--max-new-tokens={args.max_new_tokens} must be at most "
                         f"{MOST_NEW_TOKENS} (generate allocates the output whole up front)")
    try:
        check_options(EngineOptions(**engine_options(args)))
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"--port={args.port} must be in [0, 65535]")
    try:  # the listening socket is made again once the model is loaded
        socket.create_server((args.host, args.port)).close()
    except OSError as error:
        raise SystemExit(f"--host {args.host} --port {args.port}: cannot listen there "
                         f"({error.strerror or error}); give a free --port, or an address of "
                         "this machine as --host") from None


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
                        help="tokenizer.json or tokenizer.model path, or 'bytes' (default: "
                             "the checkpoint's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-prompt-tokens", type=int, default=Limits.max_prompt_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=Limits.max_new_tokens)
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts,
                        help="prompts in one request")
    parser.add_argument("--max-queued-tokens", type=int, default=Limits.max_queued_tokens,
                        help="prompt and new tokens of all waiting prompts: a request "
                             "that needs more alone is a 400, one that finds the queue too "
                             "full a 503")
    add_engine_arguments(parser)
    add_decode_arguments(parser)
    compilation_cache.add_argument(parser)
    args = parser.parse_args(argv)
    _check_serving_flags(args)

    compilation_cache.use(args.compilation_cache)
    model, tokenizer, eos = load_for_generation(args.checkpoint, args.tokenizer, args.dtype)
    limits = Limits(args.max_prompt_tokens, args.max_new_tokens, args.max_prompts,
                    args.max_queued_tokens)
    try:
        app = make_app(model, tokenizer, limits, eos, Path(args.checkpoint).resolve().name,
                       decode_options(args), engine_options(args))
    except ValueError as error:
        raise SystemExit(f"{args.checkpoint}: {error}") from None
    print(_memory_line(app[ENGINE].memory(), args.slots), flush=True)
    web.run_app(app, host=args.host, port=args.port)


def _memory_line(memory: dict, slots: int) -> str:
    """What the engine holds on the device, as serve reports it at start."""
    mb = lambda n: f"{n / 2**20:,.1f} MB"
    keys = (f" (attention keys and values for {memory['kv_tokens']} tokens a slot: "
            "a longer prompt and max_tokens is refused)" if memory["kv_tokens"] else "")
    prefix = mb(memory["prefix_cache"]) if memory["prefix_cache"] else "off"
    return (f"engine: {slots} slots of {mb(memory['slot'])} each, {mb(memory['slots'])} in "
            f"all{keys}; prefill staging {mb(memory['staging'])}; prefix cache {prefix}")


if __name__ == "__main__":
    main()
