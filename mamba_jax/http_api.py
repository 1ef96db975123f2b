"""What the server's protocols share (mamba_jax.openai_api, mamba_jax.megatron_api; the app
and its CLI are mamba_jax.serve): OpenAI's error shape, request bodies checked against a
schema, the tokenizer's side of the text, a sequence's text as its tokens come (stop
strings, characters not yet whole), handing prompts to the engine and server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import numpy as np
from aiohttp import web

from mamba_jax.engine import Busy, Engine, GenerationError, Limits, SamplingParams

log = logging.getLogger("mamba_jax.serve")

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


def generation_failed(err: GenerationError) -> ApiError:
    return ApiError(500, f"generation failed: {err}", None, "generation_failed")


# ------------------------------------------------------------------------------ text


class Texts:
    """The API's side of the tokenizer: prompts to ids, ids to text, each token's text."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text's ids; add_special_tokens: with those the tokenizer adds to a text (a BOS its
        post-processor puts first), as a prompt is encoded."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

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
        SentencePiece model the word-start piece): without the special tokens the tokenizer
        adds to a whole text (an EOS it appends would end "a" but not "a:")."""
        before = self.encode("a", add_special_tokens=False)
        ids = self.encode("a" + text, add_special_tokens=False)
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
        """The id of a special token's text where it is one token, else None (encoded without
        the tokens the tokenizer adds to a text: a BOS put first made two)."""
        ids = self.encode(text, add_special_tokens=False) if text else []
        return ids[0] if len(ids) == 1 else None


# The application's shared objects, set by mamba_jax.serve.make_app
ENGINE = web.AppKey("engine", Engine)
TEXTS = web.AppKey("texts", Texts)
LIMITS = web.AppKey("limits", Limits)
CHAT_TEMPLATE = web.AppKey("chat_template", object)  # a ChatTemplate, or None
MODEL_NAME = web.AppKey("model_name", str)
STARTED = web.AppKey("started", int)  # the server's start, seconds since the epoch


UTF8_LONGEST = 4  # bytes of the longest UTF-8 character


class TextStream:
    """A continuation's text as its tokens come, each token decoded once beside the few
    before it (linear in the tokens, where decoding the whole text at each token is
    quadratic): `add` gives the text a token completes, holding back the bytes of a
    character not yet whole; `rest` what is held back at the end."""

    CONTEXT = 4  # prompt tokens decoded before the first new one (a SentencePiece model's
    # word-start space reads as it does after them)

    def __init__(self, texts: Texts, prompt: list[int]):
        self.texts = texts
        self.ids = list(prompt[-self.CONTEXT:])
        self.read = len(self.ids)  # ids[:read] are text given out, ids[read:] held back

    def _pending(self) -> tuple[str, str]:
        """(the text of ids[:read], of all ids): the new text is what the second adds."""
        return self.texts.text(self.ids[:self.read]), self.texts.text(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        before, after = self._pending()
        if len(after) <= len(before):
            return ""  # a token of no text (yet): wait
        cut = len(self.ids)
        if after.endswith("\ufffd"):  # maybe a character not yet whole: wait for it, but
            # no longer than one can take (4 bytes, so 4 tokens): bytes that begin no
            # character (a model's invalid UTF-8) go out as U+FFFD, not all at the end
            held = cut - self.read
            if held < UTF8_LONGEST:
                return ""
            cut -= UTF8_LONGEST - 1
            after = self.texts.text(self.ids[:cut])
        # The text given out ends on a token's end: decoding restarts there.
        self.ids, self.read = self.ids[self.read:], cut - self.read
        return after[len(before):]

    def rest(self) -> str:
        before, after = self._pending()
        return after[len(before):]


def first_stop(text: str, stops) -> int | None:
    """Where the earliest of the stop strings begins in text (whatever their order in the
    list), or None."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return min(found) if found else None


class Choice:
    """One sequence's continuation as text: the text before the first stop string (a
    stream holds back the characters that may begin one, and a character not yet whole),
    the tokens that text needs, and why it ended."""

    def __init__(self, texts: Texts, seq, prompt: list[int], stops: list[str]):
        self.texts, self.seq, self.prompt, self.stops = texts, seq, prompt, stops
        self.new: list[int] = []  # the tokens kept
        self.text = ""  # the whole text, once `deltas` ends
        self.finish_reason: str | None = None
        self.at_stop_string = False

    async def deltas(self):
        """The continuation's text in pieces, as its tokens arrive; at its end,
        finish_reason ("stop": eos, a stop token or a stop string; "length") and the tokens
        kept. Each token's text is decoded once, and only the text held back (at most the
        longest stop string less a character) and the new piece are searched for a stop."""
        hold = max(map(len, self.stops), default=1) - 1
        stream = TextStream(self.texts, self.prompt)
        tokens, ends = [], []  # the new tokens, the text's length after each
        sent, pending, cut = [], "", None  # pieces given out; text decoded, not given out
        async for event in self.seq:
            piece = stream.add(event.token_id)
            tokens.append(event.token_id)
            ends.append((ends[-1] if ends else 0) + len(piece))
            if not piece:
                continue
            pending += piece
            cut = first_stop(pending, self.stops)
            ready = pending[:cut] if cut is not None else pending[:max(len(pending) - hold, 0)]
            if ready:
                sent.append(ready)
                pending = pending[len(ready):]
                yield ready
            if cut is not None:
                self.seq.cancel("stop")  # frees its slot
                break
        if cut is None:
            self.finish_reason, self.new = self.seq.finish_reason, tokens
            pending += stream.rest()
            if pending:
                sent.append(pending)
                yield pending
        else:  # the tokens that the text before the stop needs
            self.finish_reason, self.at_stop_string = "stop", True
            at = sum(map(len, sent))
            self.new = tokens[:int(np.searchsorted(ends, at)) + 1 if at else 0]
        self.text = "".join(sent)

    async def run(self) -> Choice:
        async for _ in self.deltas():
            pass
        return self


# ------------------------------------------------------------------------------ schemas


def float32_or_none(value) -> float | None:
    """value as the float32 that generation computes with, or None where that is not a
    finite number (NaN, Infinity, 1e39, a 400-digit integer)."""
    try:
        with np.errstate(over="ignore"):  # 1e39 becomes inf, refused below
            f = float(np.float32(value))
    except (OverflowError, ValueError, TypeError):
        return None
    return f if math.isfinite(f) else None


def within(low: float, high: float):
    """A check: a finite float32 in [low, high]."""
    return lambda v: (f := float32_or_none(v)) is not None and low <= f <= high


# Request schemas: field -> (accepted types, default, check or None, what it must be). A
# default of REQUIRED makes the field required; OPTIONAL leaves it None when absent.
# Settings are checked as the float32 they become: a top_p of 1e-300 is 0 there.
REQUIRED, OPTIONAL = object(), object()
NUMBER = (int, float)
BOOL = (bool, False, None, "true or false")


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


def shown(value) -> str:
    """A value as JSON, cut to 60 characters (for a message)."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


async def parse(request: web.Request, schema: dict, not_implemented: dict | None = None,
                renamed: dict | None = None, null_is_absent: bool = False) -> dict:
    """The request's JSON object checked against schema, defaults filled in.
    not_implemented: {field: (accepts(value), what it asks for)}, fields refused unless they
    ask for nothing; renamed: {old field: its replacement}, named in the refusal.
    null_is_absent: a null field takes its default, as OpenAI's API reads its optional
    fields (its clients may send them as null)."""
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("body", "the request body must be a JSON object")
    not_implemented = not_implemented or {}
    for name, (accepted, what) in not_implemented.items():
        if name in body and not accepted(body[name]):
            raise Unsupported(name, f"{name}={shown(body[name])}: this server does not "
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
            raise BadRequest(name, f"{name}={shown(value)} must be {must}")
        values[name] = value
    return values


def check_new_tokens(name: str, n: int, limits: Limits, least: int = 1):
    if not least <= n <= limits.max_new_tokens:
        raise BadRequest(name, f"{name}={n} must be in [{least}, {limits.max_new_tokens}] (the "
                         "server's limit)")


def check_prompts(limits: Limits, count: int, field: str) -> None:
    """Refuse a request of more than the server's --max-prompts prompts (rows)."""
    if count > limits.max_prompts:
        raise BadRequest(field, f"{field}: {count} prompts; at most {limits.max_prompts} per "
                         "request (the server's limit)")


def check_ids(texts: Texts, ids: list[int], field: str, limits: Limits) -> list[int]:
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


def check_top_k(texts: Texts, top_k: int):
    if top_k > texts.vocab_size:
        raise BadRequest("top_k", f"top_k={top_k} is more than the model's {texts.vocab_size} "
                         "tokens; give at most that (0 is off)")


# ------------------------------------------------------------------------------ decoding


def row_seed(seed: int | None, j: int) -> int | None:
    """The seed of a seeded request's j-th sequence (OpenAI's j-th choice of a prompt,
    Megatron's j-th prompt): the sequences of one request differ, and each repeats with the
    request (seed + j, wrapped to 64 bits); None: each a random seed."""
    return None if seed is None else (seed + j + 2**63) % 2**64 - 2**63


def submit(request: web.Request, prompts: list[list[int]], params: list[SamplingParams],
           field: str, stops: list[str]) -> list[Choice]:
    """Queue every (prompt, settings) pair, the queue's room checked first, so that a 400
    or 503 leaves nothing running."""
    engine, texts, lim = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    check_prompts(lim, len(prompts), field)
    tokens = sum(len(i) + p.max_new_tokens for i, p in zip(prompts, params))
    if tokens > lim.max_queued_tokens:
        raise BadRequest(field, f"{field}: the request needs {tokens} prompt and new tokens, "
                         f"more than the server queues at once ({lim.max_queued_tokens}); "
                         "split it")
    busy = ApiError(503, f"the server is busy ({engine.queued_tokens} tokens queued, at most "
                    f"{lim.max_queued_tokens}); retry shortly", None, "server_busy",
                    {"Retry-After": "1"})
    if engine.queued_tokens + tokens > lim.max_queued_tokens:
        raise busy
    choices = []
    try:
        for ids, p in zip(prompts, params):
            choices.append(Choice(texts, engine.submit(ids, p), ids, stops))
    except (Busy, ValueError) as error:  # ValueError: what the engine cannot hold (a
        for c in choices:                # hybrid's attention keys a slot)
            c.seq.cancel()
        raise busy if isinstance(error, Busy) else BadRequest(field, f"{field}: {error}") \
            from None
    return choices


async def finished(request: web.Request, choices: list[Choice]) -> list[Choice]:
    """Every choice run to its end; all are cancelled if the client leaves, and a failed
    generation is a 500 naming the error (the other choices cancelled too)."""
    try:
        return await asyncio.gather(*(c.run() for c in choices))
    except asyncio.CancelledError:
        left(request, choices)
        raise
    except GenerationError as err:  # logged by the engine
        for c in choices:
            c.seq.cancel()
        raise generation_failed(err) from None


def left(request: web.Request, choices: list[Choice]):
    """The client left: cancel its sequences, log one line."""
    for c in choices:
        c.seq.cancel()
    log.warning("client %s left: %d sequence(s) cancelled", request.remote, len(choices))


async def score(engine: Engine, sequences: list[list[int]], top_n: int):
    """engine.score, a failure (NaN logits: the model's, not the request's) a 500."""
    try:
        return await engine.score(sequences, top_n)
    except Exception as err:  # noqa: BLE001
        log.error("scoring failed for %d sequence(s): %s: %s", len(sequences),
                  type(err).__name__, err)
        raise ApiError(500, f"scoring failed: {type(err).__name__}: {err}", None,
                       "scoring_failed") from None


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
