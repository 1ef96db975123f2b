"""`python -m mamba_jax.serve --checkpoint DIR [--port 6000] [--host 127.0.0.1]`: a text
generation server (aiohttp) speaking the APIs that clients already use. DIR is a model dir
(HF or mamba_ssm) or a trainer's --checkpoint-dir (its newest step).

Endpoints (docs/serving.md lists every field):
  POST /v1/completions       OpenAI's completions, as the `openai` package and lm-eval's
                             local-completions send them: prompts as text or token ids,
                             echo, logprobs, seed, penalties, logit_bias, stop strings,
                             streaming with stream_options
  POST /v1/chat/completions  OpenAI's chat completions, the conversation rendered with the
                             model's chat template (or serve --chat-template FILE)
  PUT  /api                  Megatron-LM's text-generation request, every field its server
                             reads
  GET  /v1/models            the one model served
  GET  /metrics              Prometheus's text format: queue, slots, tokens, latencies
  GET  /health               {"status": "ok", ...}

This module is the HTTP side: it parses and checks requests, tokenizes, cuts at stop
strings, assembles echo and logprobs and writes the JSON; mamba_jax.engine decodes token
ids. Every answer that is not a 200 has OpenAI's error shape, {"error": {"message", "type",
"param", "code"}}, aiohttp's own 404, 405 and 413 included: a bad request is a 400 naming
the field (`param`), never a 500, and the server keeps serving.
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
import uuid
from pathlib import Path

import numpy as np

try:
    from aiohttp import web
    import prometheus_client
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily)
except ImportError as missing:
    if __name__ != "__main__":
        raise
    # `python -m mamba_jax.serve` without the [serve] extra: the CLI's one line, not a traceback
    print(f"python -m mamba_jax.serve: the server needs {missing.name}: pip install "
          "'mamba-jax[serve]'", file=sys.stderr)
    raise SystemExit(2) from None

from mamba_jax import compilation_cache
from mamba_jax.chat import ChatTemplate, ChatTemplateError
from mamba_jax.cli import HelpFormatter, command, require_at_least
from mamba_jax.engine import Busy, Engine, GenerationError, Limits, SamplingParams
from mamba_jax.generate import (MOST_NEW_TOKENS, add_decode_arguments, checkpoint_dir,
                                decode_options, learned_state, load_for_generation)
from mamba_jax.tokenizer import special_token_ids

log = logging.getLogger("mamba_jax.serve")

MAX_BODY_BYTES = 1 << 20  # a request's body (aiohttp's default)


# ------------------------------------------------------------------------------ errors


class ApiError(Exception):
    """An answer in OpenAI's error shape: status, message, the field at fault (`param`) and
    a code (OpenAI's: invalid_value, unknown_parameter, unsupported_parameter, ...)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def BadRequest(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def Unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param, "unsupported_parameter")


# aiohttp's own refusals, in our words
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every non-200 answer in OpenAI's error shape: ours (ApiError), aiohttp's (an unknown
    path, a method the path does not take, a body over the limit) and a failure of our own
    (a 500 that names it; the server keeps serving)."""
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        if error.status == 404:
            message = (f"{request.method} {request.path}: no such endpoint; this server "
                       f"serves {', '.join(ROUTES)}")
        elif error.status == 405:
            allowed = sorted(error.allowed_methods) if isinstance(
                error, web.HTTPMethodNotAllowed) else []
            message = f"{request.path} takes {' or '.join(allowed)}, not {request.method}"
        elif error.status == 413:
            message = (f"the request body is over {MAX_BODY_BYTES} bytes, the server's limit: "
                       "send fewer or shorter prompts a request")
        else:
            message = error.text or error.reason
        headers = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
        return ApiError(error.status, message, "body" if error.status == 413 else None,
                        _HTTP_CODES.get(error.status), headers).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:  # noqa: BLE001 - a bug or a failed generation: answer, log
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, f"{type(error).__name__}: {error}", None,
                        "internal_error").response()


# ------------------------------------------------------------------------------ text


class Texts:
    """The API's side of the tokenizer: prompts to ids, ids to text, each token's text."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

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
        before = self.encode("a")
        ids = self.encode("a" + text)
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

    def single_token(self, text: str | None) -> int | None:
        """The id of a special token's text where it is one token, else None."""
        ids = self.encode(text) if text else []
        return ids[0] if len(ids) == 1 else None


# ------------------------------------------------------------------------------ schemas


def _float32(value) -> float | None:
    """value as the float32 that generation computes with, or None where that is not a
    finite number (NaN, Infinity, 1e39, a 400-digit integer)."""
    try:
        with np.errstate(over="ignore"):  # 1e39 becomes inf, refused below
            f = float(np.float32(value))
    except (OverflowError, ValueError, TypeError):
        return None
    return f if math.isfinite(f) else None


def _within(low: float, high: float):
    """A check: a finite float32 in [low, high]."""
    return lambda v: (f := _float32(v)) is not None and low <= f <= high


def _token_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in v)


# Request schemas: field -> (accepted types, default, check or None, what it must be). A
# default of REQUIRED makes the field required; OPTIONAL leaves it None when absent.
# Settings are checked as the float32 they become: a top_p of 1e-300 is 0 there.
REQUIRED, OPTIONAL = object(), object()
# The most likely tokens listed per position at most: OpenAI's bounds (completions' logprobs,
# chat's top_logprobs); each count asked for is a scoring program of its own
TOP_LOGPROBS, TOP_LOGPROBS_CHAT = 5, 20
_NUMBER = (int, float)
_BOOL = (bool, False, None, "true or false")
_INT64 = lambda v: -2**63 <= v < 2**63
_PENALTY = (_NUMBER, 0.0, _within(-2, 2), "a number in [-2, 2]")
_TOP_P = (_NUMBER, 1.0, lambda v: 0 < (_float32(v) or 0) <= 1,
          "a number in (0, 1] that stays above 0 in float32")
_STOP = ((str, list), OPTIONAL, lambda v: (isinstance(v, str) and v) or (
    isinstance(v, list) and 1 <= len(v) <= 16 and all(isinstance(s, str) and s for s in v)),
    "a non-empty string or a list of 1 to 16 of them")
MEGATRON = {
    "prompts": (list, REQUIRED, lambda v: v and all(isinstance(p, str) for p in v),
                "a non-empty list of strings"),
    "tokens_to_generate": (int, 64, None, "an integer"),
    "temperature": (_NUMBER, 1.0, _within(0, math.inf), "a finite number >= 0 (0 is greedy)"),
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0 (0 is off)"),
    "top_p": (_NUMBER, 0.0, lambda v: v == 0 or 0 < (_float32(v) or 0) <= 1,
              "0 (off) or a number in (0, 1] that stays above 0 in float32"),
    "logprobs": _BOOL,
    # A jax PRNG key takes 32 bits of a seed: larger ones would collide.
    "random_seed": (int, OPTIONAL, lambda v: 0 <= v < 1 << 32, "an integer in [0, 2**32)"),
    "add_BOS": _BOOL,
    "stop_on_eol": _BOOL,
    "stop_on_double_eol": _BOOL,
    "prevent_newline_after_colon": _BOOL,
    "top_p_decay": (_NUMBER, 0.0, _within(0, 1), "a number in [0, 1] (0 is off)"),
    "top_p_bound": (_NUMBER, 0.0, _within(0, 1), "a number in [0, 1] (0 is off)"),
    "length_penalty": (_NUMBER, 1.0, lambda v: _float32(v) is not None, "a finite number"),
    "beam_width": (int, OPTIONAL, None, "an integer"),
    "stop_token": (int, OPTIONAL, None, "an integer (a token id)"),
    "no_log": _BOOL,
}
# Fields Megatron-LM's server names a replacement for
MEGATRON_RENAMED = {"max_len": "tokens_to_generate", "sentences": "prompts"}
# Why PUT /api answers a beam_width with a 400 (Megatron-LM's own server now refuses it too:
# "Beam search is no longer supported").
BEAM_SEARCH = ("beam_width: beam search is not supported: the compiled decode loop carries "
               "one recurrent state per row (every Mamba layer's conv window and SSM state), "
               "and beam search would have to copy those states between beams at every "
               "token; sample instead (temperature, top_k, top_p), or send several prompts")
# The fields both of OpenAI's endpoints read alike
SAMPLING = {
    "model": (str, "", None, "a string"),
    "temperature": (_NUMBER, 1.0, _within(0, 2), "a number in [0, 2] (0 is greedy)"),
    "top_p": _TOP_P,
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0 (0 is off)"),
    "n": (int, 1, lambda v: v >= 1, "an integer >= 1 (completions per prompt)"),
    "stop": _STOP,
    "stream": _BOOL,
    "stream_options": (dict, OPTIONAL, lambda v: set(v) <= {"include_usage"} and isinstance(
        v.get("include_usage", False), bool), '{"include_usage": true or false}'),
    "seed": (int, OPTIONAL, _INT64, "an integer of 64 bits"),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "logit_bias": (dict, OPTIONAL, None, "an object of token ids and numbers"),
    "user": (str, OPTIONAL, None, "a string"),
}
COMPLETIONS = {
    **SAMPLING,
    "prompt": ((str, list), REQUIRED, lambda v: isinstance(v, str) or (v and (
        all(isinstance(p, str) for p in v) or _token_ids(v)
        or all(_token_ids(p) for p in v))),
        "a string, a non-empty list of strings, a list of token ids or a list of lists of "
        "them"),
    "max_tokens": (int, 16, None, "an integer"),
    "echo": _BOOL,
    "logprobs": (int, OPTIONAL, lambda v: 0 <= v <= TOP_LOGPROBS,
                 f"an integer in [0, {TOP_LOGPROBS}] (the most likely tokens listed per "
                 "position)"),
    "best_of": (int, OPTIONAL, lambda v: v >= 1, "an integer >= 1"),
}
CHAT = {
    **SAMPLING,
    "messages": (list, REQUIRED, lambda v: v and all(isinstance(m, dict) for m in v),
                 "a non-empty list of {role, content} objects"),
    "max_tokens": (int, OPTIONAL, None, "an integer"),
    "max_completion_tokens": (int, OPTIONAL, None, "an integer"),
    "logprobs": _BOOL,
    "top_logprobs": (int, OPTIONAL, lambda v: 0 <= v <= TOP_LOGPROBS_CHAT,
                     f"an integer in [0, {TOP_LOGPROBS_CHAT}]"),
}
# OpenAI's fields that this server does not implement: accepted only at the value that asks
# for nothing (null, or the value named), else a 400 that says so.
_NONE = lambda v: v is None
NOT_IMPLEMENTED = {
    "suffix": (lambda v: v in (None, ""), "text after the insertion point"),
    "tools": (lambda v: not v, "tool calls"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calls"),
    "parallel_tool_calls": (_NONE, "tool calls"),
    "functions": (lambda v: not v, "function calls"),
    "function_call": (lambda v: v in (None, "none"), "function calls"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "structured output (only {\"type\": \"text\"})"),
    "modalities": (lambda v: v in (None, ["text"]), "modalities other than text"),
    "audio": (_NONE, "audio output"),
    "prediction": (_NONE, "predicted outputs"),
    "reasoning_effort": (_NONE, "reasoning models"),
    "web_search_options": (_NONE, "web search"),
    "store": (lambda v: v in (None, False), "stored completions"),
    "metadata": (_NONE, "stored completions"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service tiers"),
}
COMPLETIONS_NOT_IMPLEMENTED = ("suffix",)
CHAT_NOT_IMPLEMENTED = tuple(k for k in NOT_IMPLEMENTED if k != "suffix")


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


def _shown(value) -> str:
    shown = json.dumps(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


async def _parse(request: web.Request, schema: dict, not_implemented=(), renamed=None,
                 null_is_absent: bool = False) -> dict:
    """The request's JSON object checked against schema, defaults filled in. Fields of
    not_implemented (NOT_IMPLEMENTED's) are refused unless they ask for nothing; renamed:
    {old field: its replacement}, named in the refusal. null_is_absent: a null field takes
    its default, as OpenAI's API reads its optional fields (its clients may send them as
    null)."""
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "the request body must be a JSON object")
    for name in not_implemented:
        accepted, what = NOT_IMPLEMENTED[name]
        if name in body and not accepted(body[name]):
            raise Unsupported(name, f"{name}={_shown(body[name])}: this server does not "
                              f"implement {what}; leave {name} out")
    unknown = sorted(set(body) - set(schema) - set(not_implemented))
    if unknown:
        name = unknown[0]
        instead = f"; use {renamed[name]}" if name in (renamed or {}) else ""
        raise BadRequest(name, f"unknown field {name!r}{instead}; this endpoint takes "
                         f"{sorted(schema)}", "unknown_parameter")
    values = {}
    for name, (types, default, check, must) in schema.items():
        if name not in body or (null_is_absent and body[name] is None):
            if default is REQUIRED:
                raise BadRequest(name, f"{name} is required: {must}")
            values[name] = None if default is OPTIONAL else default
            continue
        value = body[name]
        # JSON true/false are Python bools, which are also ints: only bool fields take them.
        if (isinstance(value, bool) and types is not bool) or not isinstance(value, types) \
                or (check is not None and not check(value)):
            raise BadRequest(name, f"{name}={_shown(value)} must be {must}")
        values[name] = value
    return values


def _check_new_tokens(name: str, n: int, limits: Limits, least: int = 1):
    if not least <= n <= limits.max_new_tokens:
        raise BadRequest(name, f"{name}={n} must be in [{least}, {limits.max_new_tokens}] (the "
                         "server's limit)")


def _check_prompts(limits: Limits, count: int, field: str) -> None:
    """Refuse a request of more than the server's --max-prompts prompts (rows)."""
    if count > limits.max_prompts:
        raise BadRequest(field, f"{field}: {count} prompts; at most {limits.max_prompts} per "
                         "request (the server's limit)")


def _check_ids(texts: Texts, ids: list[int], field: str, limits: Limits) -> list[int]:
    """A prompt's ids: a 400 naming field if it is empty, too long, or holds an id outside
    the vocabulary."""
    if not 1 <= len(ids) <= limits.max_prompt_tokens:
        raise BadRequest(field, f"{field}: the prompt is {len(ids)} tokens; it must be 1 to "
                         f"{limits.max_prompt_tokens} (the server's limit)")
    bad = next((j for j, i in enumerate(ids) if not 0 <= i < texts.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{field}[{bad}]", f"{field}[{bad}]={ids[bad]} is not a token id of "
                         f"this model (its vocabulary is 0 to {texts.vocab_size - 1})")
    return ids


def _check_top_k(texts: Texts, top_k: int):
    if top_k > texts.vocab_size:
        raise BadRequest("top_k", f"top_k={top_k} is more than the model's {texts.vocab_size} "
                         "tokens; give at most that (0 is off)")


def _logit_bias(texts: Texts, value: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as (id, bias) pairs."""
    pairs = []
    for key, bias in (value or {}).items():
        token = int(key) if key.isdigit() else -1
        if not 0 <= token < texts.vocab_size:
            raise BadRequest("logit_bias", f"logit_bias: {key!r} is not a token id of this "
                             f"model (0 to {texts.vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, _NUMBER) \
                or not _within(-100, 100)(bias):
            raise BadRequest("logit_bias", f"logit_bias[{key!r}]={_shown(bias)} must be a "
                             "number in [-100, 100]")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _sampling(texts: Texts, v: dict, max_new: int, seed: int | None) -> SamplingParams:
    """The settings of an OpenAI request for one choice."""
    _check_top_k(texts, v["top_k"])
    return SamplingParams(
        max_new, float(v["temperature"]), v["top_k"], float(v["top_p"]), seed=seed,
        presence_penalty=float(v["presence_penalty"]),
        frequency_penalty=float(v["frequency_penalty"]),
        logit_bias=_logit_bias(texts, v["logit_bias"]))


def _choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of a prompt's j-th choice: n choices of one seeded request differ, and each
    repeats with the request (seed + j, wrapped to 64 bits)."""
    return None if seed is None else (seed + j + 2**63) % 2**64 - 2**63


# ------------------------------------------------------------------------------ decoding


class Choice:
    """One sequence's continuation as text: the text before the first stop string (a
    stream holds back the characters that may begin one, and a character not yet whole),
    the tokens that text needs, and why it ended."""

    def __init__(self, texts: Texts, seq, prompt: list[int], stops: list[str]):
        self.texts, self.seq, self.prompt, self.stops = texts, seq, prompt, stops
        self.new: list[int] = []  # the tokens kept
        self.text = ""  # the text sent so far (all of it once `deltas` ends)
        self.finish_reason: str | None = None
        self.at_stop_string = False

    async def deltas(self):
        """The continuation's text in pieces, as its tokens arrive; at its end,
        finish_reason ("stop": eos or a stop string; "length") and the tokens kept."""
        hold = max(map(len, self.stops), default=1) - 1
        tokens, stopped = [], None
        async for event in self.seq:
            tokens.append(event.token_id)
            text = self.texts.continuation(self.prompt, tokens)
            if text.endswith("\ufffd"):  # a multi-byte character not yet complete
                continue
            stopped = _first_stop(text, self.stops)
            ready = text[:stopped] if stopped is not None else text[:max(len(text) - hold, 0)]
            if len(ready) > len(self.text):
                yield ready[len(self.text):]
                self.text = ready
            if stopped is not None:
                self.seq.cancel()  # frees its slot
                break
        whole = self.texts.continuation(self.prompt, tokens)
        if stopped is None:
            self.finish_reason = self.seq.finish_reason
            if len(whole) > len(self.text):
                yield whole[len(self.text):]
            self.text, self.new = whole, tokens
        else:  # the tokens that the text before the stop needs
            self.finish_reason, self.at_stop_string = "stop", True
            ends = np.cumsum([len(p) for p in self.texts.new_segments(self.prompt, tokens)])
            self.new = tokens[:int(np.searchsorted(ends, stopped)) + 1 if stopped else 0]

    async def run(self) -> Choice:
        async for _ in self.deltas():
            pass
        return self


def _first_stop(text: str, stops) -> int | None:
    """Where the earliest of the stop strings begins in text (whatever their order in the
    list), or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


def _submit(request: web.Request, prompts: list[list[int]], params: list[SamplingParams],
            field: str, stops: list[str]) -> list[Choice]:
    """Queue every (prompt, settings) pair, checked first so that a 400 or 503 leaves
    nothing running."""
    engine, texts, lim = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    _check_prompts(lim, len(prompts), field)
    tokens = sum(len(i) + p.max_new_tokens for i, p in zip(prompts, params))
    if tokens > lim.max_queued_tokens:
        raise BadRequest(field, f"{field}: the request needs {tokens} prompt and new tokens, "
                         f"more than the server queues at once ({lim.max_queued_tokens}); "
                         "split it")
    choices = []
    try:
        for ids, p in zip(prompts, params):
            choices.append(Choice(texts, engine.submit(ids, p), ids, stops))
    except (Busy, ValueError) as error:
        for c in choices:
            c.seq.cancel()
        if isinstance(error, Busy):
            raise ApiError(503, str(error), None, "server_busy", {"Retry-After": "1"}) from None
        raise Unsupported(field, str(error)) from None
    return choices


async def _finished(request: web.Request, choices: list[Choice]) -> list[Choice]:
    """Every choice run to its end; all are cancelled if the client leaves, and a failed
    generation is a 500 naming the error (the other choices cancelled too)."""
    try:
        done = await asyncio.gather(*(c.run() for c in choices))
    except asyncio.CancelledError:
        _left(request, choices)
        raise
    except GenerationError as err:  # logged by the engine
        for c in choices:
            c.seq.cancel()
        raise ApiError(500, str(err), None, "generation_failed") from None
    return done


def _left(request: web.Request, choices: list[Choice]):
    """The client left: cancel its sequences, log one line."""
    for c in choices:
        c.seq.cancel()
    log.warning("client %s left: %d sequence(s) cancelled", request.remote, len(choices))


async def _score(engine: Engine, sequences: list[list[int]], top_n: int):
    """engine.score, a failure (NaN logits: the model's, not the request's) a 500."""
    try:
        return await engine.score(sequences, top_n)
    except Exception as err:  # noqa: BLE001
        log.error("scoring failed for %d sequence(s): %s: %s", len(sequences),
                  type(err).__name__, err)
        raise ApiError(500, f"scoring failed: {type(err).__name__}: {err}", None,
                       "scoring_failed") from None


# ------------------------------------------------------------------------------ streams


class EventStream:
    """A server-sent events answer: `send` a JSON chunk, `close` with [DONE]."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})

    async def open(self):
        await self.response.prepare(self.request)

    async def send(self, payload: dict | str):
        text = payload if isinstance(payload, str) else json.dumps(payload)
        await self.response.write(f"data: {text}\n\n".encode())

    async def close(self) -> web.StreamResponse:
        await self.send("[DONE]")
        return self.response


async def _stream(request: web.Request, choices: list[Choice], chunk, usage: dict | None,
                  usage_chunk: dict, first=None) -> web.StreamResponse:
    """Stream the choices one after another: chunk(i, text, finish_reason) per piece,
    first(i) before a choice's first piece where given; the usage chunk last when asked
    (stream_options.include_usage). A failed generation ends the stream with an error
    event and [DONE]."""
    stream = EventStream(request)
    try:
        await stream.open()
        for i, c in enumerate(choices):
            try:
                if first is not None:
                    await stream.send(first(i))
                async for piece in c.deltas():
                    await stream.send(chunk(i, piece, None))
            except GenerationError as err:  # logged by the engine
                for rest in choices:
                    rest.seq.cancel()
                await stream.send(ApiError(500, str(err), None, "generation_failed").body())
                return await stream.close()
            await stream.send(chunk(i, None, c.finish_reason))
        if usage is not None:
            await stream.send({**usage_chunk, "choices": [], "usage": _usage(usage, choices)})
        return await stream.close()
    except (asyncio.CancelledError, ConnectionResetError) as left:
        _left(request, choices)
        if isinstance(left, asyncio.CancelledError):
            raise
        return stream.response


def _usage(prompt_tokens: dict, choices: list[Choice]) -> dict:
    """OpenAI's usage: the prompts' tokens (each prompt once, whatever n), the completions'
    tokens as the stops cut them, and their sum."""
    completion = sum(len(c.new) for c in choices)
    prompt = prompt_tokens["prompt_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# ------------------------------------------------------------------------------ endpoints


def _prompts(texts: Texts, prompt, limits: Limits) -> tuple[list[list[int]], list[str]]:
    """OpenAI's prompt (a string, strings, token ids, or lists of them) as each prompt's
    ids and text."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif _token_ids(prompt):
        prompt = [prompt]
    _check_prompts(limits, len(prompt), "prompt")
    names = [f"prompt[{i}]" if len(prompt) > 1 else "prompt" for i in range(len(prompt))]
    ids = [_check_ids(texts, texts.encode(p) if isinstance(p, str) else p, name, limits)
           for p, name in zip(prompt, names)]
    return ids, [p if isinstance(p, str) else texts.text(p) for p in prompt]


def _top(texts: Texts, alternatives) -> dict:
    """{token text: log p}, most likely first; of tokens of one text, the likelier."""
    found = {}
    for token, logp in alternatives:
        found.setdefault(texts.text([token]), logp)
    return found


async def _completion_logprobs(engine: Engine, texts: Texts, prompt: list[int],
                               prompt_text: str, c: Choice | None, echo: bool,
                               top_n: int) -> dict:
    """OpenAI's completion logprobs: each token's text, log-probability, the top_n most
    likely tokens ({text: log p}, or null for 0) and its character offset in the prompt and
    completion's text; with echo the prompt's tokens first (the first without a
    log-probability). A completion that ended at the end-of-text token lists it last, as
    OpenAI's does (its text is not in the completion's)."""
    new = c.new if c is not None else []
    at_eos = (c is not None and c.finish_reason == "stop" and not c.at_stop_string
              and texts.eos is not None)
    scored_ids = prompt + new + [texts.eos] * at_eos
    [scored] = await _score(engine, [scored_ids], top_n) if len(scored_ids) > 1 else [[]]
    pieces = texts.new_segments(prompt, scored_ids[len(prompt):])
    first = len(prompt) - 1  # the position of the first new token's log-probability
    logps = [lp for lp, _ in scored[first:]]
    tops = [_top(texts, t) for _, t in scored[first:]]
    offsets = np.cumsum([len(prompt_text)] + [len(p) for p in pieces])[:-1].tolist()
    if echo:
        prompt_pieces = texts.segments(prompt)
        pieces = prompt_pieces + pieces
        logps = [None] + [lp for lp, _ in scored[:first]] + logps
        tops = [None] + [_top(texts, t) for _, t in scored[:first]] + tops
        offsets = np.cumsum([0] + [len(p) for p in prompt_pieces])[:-1].tolist() + offsets
    return {"tokens": pieces, "token_logprobs": logps, "text_offset": offsets,
            "top_logprobs": tops if top_n else None}


def _meta(kind: str, request: web.Request, model: str) -> dict:
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind, "created": int(time.time()),
            "model": model or request.app[MODEL_NAME]}


def _stream_fields(v: dict):
    """The usage the stream's last chunk carries (stream_options.include_usage), and a 400
    for stream_options without stream or logprobs with it."""
    if v["stream_options"] is not None and not v["stream"]:
        raise BadRequest("stream_options", "stream_options is for streamed answers: send it "
                         "with stream=true, or leave it out")
    include_usage = bool((v["stream_options"] or {}).get("include_usage"))
    if v["stream"] and v["logprobs"]:
        raise BadRequest("logprobs", "logprobs are not streamed; ask for them without stream")
    return include_usage


async def completions(request: web.Request):
    engine, texts, limits = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    v = await _parse(request, COMPLETIONS, COMPLETIONS_NOT_IMPLEMENTED, null_is_absent=True)
    include_usage = _stream_fields(v)
    n, echo = v["n"], v["echo"]
    if v["best_of"] is not None and v["best_of"] != n:
        raise Unsupported("best_of", f"best_of={v['best_of']} with n={n}: this server does not "
                          "rank several samples; leave best_of out or equal to n")
    _check_new_tokens("max_tokens", v["max_tokens"], limits, least=0 if echo else 1)
    if v["stream"] and echo and v["max_tokens"] == 0:
        raise BadRequest("stream", "max_tokens=0 with echo scores the prompt: ask for it "
                         "without stream")
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"] or []
    # n copies of each prompt: where they pass a limit the prompts alone do not, n is named
    # (checked before they are made: a huge n held the server while it built them)
    single = isinstance(v["prompt"], str) or _token_ids(v["prompt"])
    _check_prompts(limits, (1 if single else len(v["prompt"])) * n, "prompt" if n == 1 else "n")
    prompts, prompt_texts = _prompts(texts, v["prompt"], limits)
    meta = _meta("text_completion", request, v["model"])
    usage = {"prompt_tokens": sum(map(len, prompts))}
    if v["max_tokens"] == 0:  # echo: the prompts scored, nothing generated
        choices = [None] * len(prompts) * n
    else:
        params = [_sampling(texts, v, v["max_tokens"], _choice_seed(v["seed"], j))
                  for _ in prompts for j in range(n)]
        choices = _submit(request, [p for p in prompts for _ in range(n)], params,
                          "prompt" if n == 1 else "n", stops)
        if v["stream"]:
            echoed = [t for t in prompt_texts for _ in range(n)]
            return await _stream(
                request, choices, lambda i, text, reason: {**meta, "choices": [
                    {"index": i, "text": text or "", "logprobs": None,
                     "finish_reason": reason}]},
                usage if include_usage else None, meta,
                first=(lambda i: {**meta, "choices": [{"index": i, "text": echoed[i],
                                                       "logprobs": None,
                                                       "finish_reason": None}]})
                if echo else None)
        choices = await _finished(request, choices)
    out = []
    for i, c in enumerate(choices):
        prompt, prompt_text = prompts[i // n], prompt_texts[i // n]
        logprobs = None
        if v["logprobs"] is not None:
            logprobs = await _completion_logprobs(engine, texts, prompt, prompt_text, c, echo,
                                                  v["logprobs"])
        out.append({"index": i, "text": (prompt_text if echo else "") + (c.text if c else ""),
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason if c else "length"})
    return web.json_response({**meta, "choices": out,
                              "usage": _usage(usage, [c for c in choices if c])})


def _chat_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages as a template reads them: content given as parts ([{"type":
    "text", "text"}]) joined into one string; a 400 for other parts."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role", f"messages[{i}] needs a role (a string: "
                             "system, user, assistant, ...)")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise Unsupported(f"messages[{i}].content", f"messages[{i}].content: only "
                                  "text parts ({\"type\": \"text\", \"text\": ...}) are "
                                  "supported")
            m = {**m, "content": "".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content", f"messages[{i}].content must be a "
                             "string or a list of text parts")
        out.append(m)
    return out


def _chat_logprobs(texts: Texts, prompt: list[int], c: Choice, scored) -> dict:
    """OpenAI's chat logprobs: per new token its text, log p, UTF-8 bytes and the most
    likely tokens at its position."""
    entry = lambda text, logp: {"token": text, "logprob": logp, "bytes": list(text.encode())}
    pieces = texts.new_segments(prompt, c.new)
    return {"content": [
        {**entry(piece, logp), "top_logprobs": [entry(texts.text([t]), lp) for t, lp in top]}
        for piece, (logp, top) in zip(pieces, scored[len(prompt) - 1:])]}


async def chat_completions(request: web.Request):
    engine, texts, limits = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    v = await _parse(request, CHAT, CHAT_NOT_IMPLEMENTED, null_is_absent=True)
    include_usage = _stream_fields(v)
    if v["top_logprobs"] is not None and not v["logprobs"]:
        raise BadRequest("top_logprobs", "top_logprobs needs logprobs=true")
    template: ChatTemplate | None = request.app[CHAT_TEMPLATE]
    if template is None:
        raise BadRequest("messages", "this model has no chat template: start the server with "
                         "--chat-template FILE (a Jinja template), or add a chat_template to "
                         "the model's tokenizer_config.json (or a chat_template.jinja beside "
                         "it)", "no_chat_template")
    name = "max_completion_tokens" if v["max_completion_tokens"] is not None else "max_tokens"
    max_new = v[name] if v[name] is not None else limits.max_new_tokens
    _check_new_tokens(name, max_new, limits)
    try:
        ids = template.encode(texts.tokenizer, _chat_messages(v["messages"]),
                              add_generation_prompt=True)
    except ChatTemplateError as error:
        raise BadRequest("messages", str(error)) from None
    _check_ids(texts, ids, "messages", limits)
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"] or []
    # The template's end of turn ends a reply where it is one token other than eos
    end = texts.single_token(template.special_tokens.get("eos_token"))
    n = v["n"]
    params = [_sampling(texts, v, max_new, _choice_seed(v["seed"], j)) for j in range(n)]
    if end is not None and end != texts.eos:
        params = [dataclasses.replace(p, stop_token_ids=(end,)) for p in params]
    choices = _submit(request, [ids] * n, params, "messages" if n == 1 else "n", stops)
    meta = _meta("chat.completion", request, v["model"])
    usage = {"prompt_tokens": len(ids)}
    if v["stream"]:
        meta["object"] = "chat.completion.chunk"
        delta = lambda i, d, reason: {**meta, "choices": [
            {"index": i, "delta": d, "logprobs": None, "finish_reason": reason}]}
        return await _stream(
            request, choices,
            lambda i, text, reason: delta(i, {} if text is None else {"content": text}, reason),
            usage if include_usage else None, meta,
            first=lambda i: delta(i, {"role": "assistant", "content": ""}, None))
    choices = await _finished(request, choices)
    scored = [None] * n
    if v["logprobs"]:
        scored = await _score(engine, [ids + c.new for c in choices], v["top_logprobs"] or 0)
    return web.json_response({**meta, "choices": [
        {"index": i, "message": {"role": "assistant", "content": c.text},
         "logprobs": _chat_logprobs(texts, ids, c, s) if v["logprobs"] else None,
         "finish_reason": c.finish_reason}
        for i, (c, s) in enumerate(zip(choices, scored))], "usage": _usage(usage, choices)})


def _line_end(texts: Texts, prompt: list[int], new: list[int], double: bool) -> list[int]:
    """new up to and with its first token that completes a newline (double: two newlines in
    a row, the prompt's last character counting): Megatron's stop_on_eol and
    stop_on_double_eol, on the tokens' text."""
    text = texts.text(prompt)[-1:] if double else ""
    for j, piece in enumerate(texts.new_segments(prompt, new)):
        text += piece
        if ("\n\n" if double else "\n") in text:
            return new[:j + 1]
    return new


async def megatron_api(request: web.Request):
    engine, texts, limits = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    v = await _parse(request, MEGATRON, renamed=MEGATRON_RENAMED)
    if not v["no_log"]:  # Megatron's server logs each request unless no_log
        log.info("PUT /api from %s: %s", request.remote, _shown(v["prompts"]))
    _check_new_tokens("tokens_to_generate", v["tokens_to_generate"], limits, least=0)
    if v["beam_width"] is not None:
        raise Unsupported("beam_width", BEAM_SEARCH)
    if v["tokens_to_generate"] == 0 and not v["logprobs"]:
        raise BadRequest("tokens_to_generate", "tokens_to_generate=0 generates nothing: it "
                         "scores the prompts, and needs logprobs=true")
    for name in ("top_p_decay", "top_p_bound"):
        if v[name] and not v["top_p"]:
            raise BadRequest(name, f"{name}={v[name]} needs top_p > 0: it changes top_p")
    if v["top_p_bound"] > v["top_p"]:
        raise BadRequest("top_p_bound", f"top_p_bound={v['top_p_bound']} must be at most "
                         f"top_p={v['top_p']} (top_p decays down to it)")
    _check_top_k(texts, v["top_k"])
    stop_token = v["stop_token"]
    if stop_token is not None and not 0 <= stop_token < texts.vocab_size:
        raise BadRequest("stop_token", f"stop_token={stop_token} is not a token id of this "
                         f"model (0 to {texts.vocab_size - 1})")
    _check_prompts(limits, len(v["prompts"]), "prompts")
    bos = special_token_ids(texts.tokenizer)["bos_token_id"]
    if v["add_BOS"] and bos is None:
        raise BadRequest("add_BOS", "add_BOS: this server's tokenizer has no BOS token; leave "
                         "add_BOS out")
    names = [f"prompts[{i}]" if len(v["prompts"]) > 1 else "prompts"
             for i in range(len(v["prompts"]))]
    ids = [_check_ids(texts, [bos] * v["add_BOS"] + texts.encode(p), name, limits)
           for p, name in zip(v["prompts"], names)]
    new = [[] for _ in ids]
    if v["tokens_to_generate"]:
        params = SamplingParams(
            v["tokens_to_generate"], float(v["temperature"]), v["top_k"],
            float(v["top_p"] or 1.0), float(v["top_p_decay"]), float(v["top_p_bound"]),
            seed=v["random_seed"],
            banned_after=(texts.token_of(":"), texts.token_of("\n"))
            if v["prevent_newline_after_colon"] else None,
            stop_token_ids=() if stop_token is None else (stop_token,))
        choices = await _finished(request, _submit(request, ids, [params] * len(ids),
                                                   "prompts", []))
        new = [c.new for c in choices]
        if v["stop_on_eol"] or v["stop_on_double_eol"]:
            new = [_line_end(texts, i, n, v["stop_on_double_eol"]) for i, n in zip(ids, new)]
    tokens = [i + n for i, n in zip(ids, new)]
    response = {"text": [p + texts.continuation(i, n)
                         for p, i, n in zip(v["prompts"], ids, new)],
                "segments": [texts.segments(t) for t in tokens], "tokens": tokens}
    if v["logprobs"]:
        response["logprobs"] = [[lp for lp, _ in s] for s in await _score(engine, tokens, 0)]
    return web.json_response(response)


async def models(request: web.Request):
    return web.json_response({"object": "list", "data": [
        {"id": request.app[MODEL_NAME], "object": "model", "created": request.app[STARTED],
         "owned_by": "mamba-jax"}]})


async def health(request: web.Request):
    stats = request.app[ENGINE].stats()
    return web.json_response({"status": "ok", "model": request.app[MODEL_NAME],
                              **{k: stats[k] for k in ("queued", "slots_busy", "slots",
                                                       "tokens_generated")}})


# ------------------------------------------------------------------------------ metrics


class EngineMetrics:
    """The engine's stats() at each scrape, as Prometheus metrics."""

    def __init__(self, app: web.Application):
        self.app = app

    def collect(self):
        s = self.app[ENGINE].stats()
        yield GaugeMetricFamily("mamba_queued_requests", "Sequences waiting for a slot",
                                value=s["queued"])
        yield GaugeMetricFamily("mamba_busy_slots", "Decode slots in use",
                                value=s["slots_busy"])
        yield GaugeMetricFamily("mamba_slots", "Decode slots", value=s["slots"])
        yield CounterMetricFamily("mamba_generated_tokens", "New tokens generated",
                                  value=s["tokens_generated"])
        yield GaugeMetricFamily("mamba_tokens_per_second", "New tokens a second, lately",
                                value=s["tokens_per_second"])
        finished = CounterMetricFamily("mamba_finished_requests", "Sequences ended, by why",
                                       labels=["reason"])
        for reason, count in s["requests_finished"].items():
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily("mamba_prefix_cache_hits", "Prompts that started from a "
                                  "cached prefix's states", value=s["prefix_cache_hits"])
        yield CounterMetricFamily("mamba_prefix_cache_lookups", "Prompts looked up in the "
                                  "prefix cache", value=s["prefix_cache_lookups"])
        for name, what in (("ttft", "Time to first token, from submission"),
                           ("tpot", "Time per output token after the first")):
            h = s[f"{name}_seconds"]
            yield HistogramMetricFamily(
                f"mamba_{'time_to_first_token' if name == 'ttft' else 'time_per_output_token'}"
                "_seconds", what, sum_value=h["sum"],
                buckets=[("+Inf" if math.isinf(le) else repr(float(le)), count)
                         for le, count in h["buckets"]])


async def metrics(request: web.Request):
    return web.Response(body=prometheus_client.generate_latest(request.app[METRICS]),
                        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


# ------------------------------------------------------------------------------ the app


ENGINE = web.AppKey("engine", Engine)
TEXTS = web.AppKey("texts", Texts)
LIMITS = web.AppKey("limits", Limits)
METRICS = web.AppKey("metrics", prometheus_client.CollectorRegistry)
CHAT_TEMPLATE = web.AppKey("chat_template", object)  # a ChatTemplate, or None
MODEL_NAME = web.AppKey("model_name", str)
STARTED = web.AppKey("started", int)  # the server's start, seconds since the epoch
ROUTES = {"POST /v1/completions": completions, "POST /v1/chat/completions": chat_completions,
          "PUT /api": megatron_api, "GET /v1/models": models, "GET /metrics": metrics,
          "GET /health": health}


def make_app(model, tokenizer, limits: Limits = Limits(), eos_token_id=None,
             model_name: str = "mamba2", generate_options=None,
             chat_template: ChatTemplate | None = None) -> web.Application:
    """The aiohttp application; its engine runs while the app does. generate_options:
    keyword arguments of every generate call (ssm_state_dtype, step_implementation);
    chat_template: what /v1/chat/completions renders conversations with (None: it answers
    a 400 that says how to give one)."""
    # A client that disconnects cancels its handler, which cancels its sequences.
    app = web.Application(handler_args={"handler_cancellation": True},
                          client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    app[MODEL_NAME] = model_name
    app[STARTED] = int(time.time())
    app[LIMITS] = limits
    app[TEXTS] = Texts(tokenizer, model.config.vocab_size, eos_token_id)
    app[CHAT_TEMPLATE] = chat_template
    app[METRICS] = prometheus_client.CollectorRegistry()
    app[METRICS].register(EngineMetrics(app))

    async def engine_task(app):
        app[ENGINE] = Engine(model, tokenizer, limits, eos_token_id, generate_options)
        task = asyncio.create_task(app[ENGINE].run())
        yield
        task.cancel()

    app.cleanup_ctx.append(engine_task)
    for route, handler in ROUTES.items():
        method, path = route.split()
        app.router.add_route(method, path, handler)
    return app


def _check_serving_flags(args):
    """Refuse a checkpoint that is not there, a chat template that does not compile, limits
    the server could not serve under and an address it cannot listen on, in that order,
    before the model loads (minutes for a large one). -> the chat template given, or None."""
    try:
        checkpoint_dir(args.checkpoint)
        template = None if args.chat_template is None else ChatTemplate.from_file(
            args.chat_template)
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None
    except ChatTemplateError as error:
        raise SystemExit(f"--chat-template {str(error).removeprefix('chat template ')}"
                         ) from None
    require_at_least(args, ("max_prompt_tokens", "max_new_tokens", "max_batch", "max_prompts",
                            "max_queued_tokens"))
    if args.max_new_tokens > MOST_NEW_TOKENS:  # generate's bound: each request would fail
        raise SystemExit(f"--max-new-tokens={args.max_new_tokens} must be at most "
                         f"{MOST_NEW_TOKENS} (generate allocates the output whole up front)")
    if not (math.isfinite(args.batch_window_ms) and args.batch_window_ms >= 0):
        raise SystemExit(f"--batch-window-ms={args.batch_window_ms} must be a number >= 0")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"--port={args.port} must be in [0, 65535]")
    try:  # the listening socket is made again once the model is loaded
        socket.create_server((args.host, args.port)).close()
    except OSError as error:
        raise SystemExit(f"--host {args.host} --port {args.port}: cannot listen there "
                         f"({error.strerror or error}); give a free --port, or an address of "
                         "this machine as --host") from None
    return template


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
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template for /v1/chat/completions (default: the "
                             "checkpoint's tokenizer_config.json chat_template or "
                             "chat_template.jinja)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-prompt-tokens", type=int, default=Limits.max_prompt_tokens)
    parser.add_argument("--max-new-tokens", type=int, default=Limits.max_new_tokens)
    parser.add_argument("--max-batch", type=int, default=Limits.max_batch)
    parser.add_argument("--batch-window-ms", type=float, default=1e3 * Limits.batch_window_s)
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts,
                        help="prompts in one request")
    parser.add_argument("--max-queued-tokens", type=int, default=Limits.max_queued_tokens,
                        help="prompt and new tokens of all waiting prompts: a request "
                             "that needs more alone is a 400, one that finds the queue too "
                             "full a 503")
    add_decode_arguments(parser)
    compilation_cache.add_argument(parser)
    args = parser.parse_args(argv)
    template = _check_serving_flags(args)

    compilation_cache.use(args.compilation_cache)
    model, tokenizer, eos = load_for_generation(args.checkpoint, args.tokenizer, args.dtype)
    if learned_state(model):  # every prompt is left-padded to its batch's bucket
        raise SystemExit(f"{args.checkpoint}: its Mamba2 layers start from a learnable "
                         "initial state (mamba2.learnable_init_state), which enters a row's "
                         "first document, and the server left-pads every prompt, so each "
                         "would start from zeros: generate with python -m mamba_jax.generate, "
                         "a prompt at a time")
    if template is None:
        try:
            template = ChatTemplate.from_model_dir(args.checkpoint)
        except ChatTemplateError as error:
            raise SystemExit(str(error)) from None
    limits = Limits(args.max_prompt_tokens, args.max_new_tokens, args.max_batch,
                    args.batch_window_ms / 1e3, args.max_prompts, args.max_queued_tokens)
    web.run_app(make_app(model, tokenizer, limits, eos, Path(args.checkpoint).resolve().name,
                         decode_options(args), template),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
