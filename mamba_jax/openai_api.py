"""OpenAI's completions and chat completions, as the `openai` package and lm-eval send them:
POST /v1/completions (prompts as text or token ids, echo, logprobs, seed, penalties,
logit_bias, stop strings, streaming with stream_options) and POST /v1/chat/completions (the
conversation rendered with the model's chat template). docs/serving.md lists every field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import numpy as np
from aiohttp import web

from mamba_jax.chat import ChatTemplate, ChatTemplateError
from mamba_jax.engine import Engine, GenerationError, Limits, SamplingParams
from mamba_jax.http_api import (BOOL, CHAT_TEMPLATE, ENGINE, LIMITS, MODEL_NAME, NUMBER,
                                OPTIONAL, REQUIRED, TEXTS, BadRequest, Choice, EventStream,
                                Texts, Unsupported, check_ids, check_new_tokens, check_prompts,
                                check_top_k, finished, float32_or_none, generation_failed, left,
                                parse, row_seed, score, shown, submit, within)


def _token_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in v)


# The most likely tokens listed per position at most: OpenAI's bounds (completions' logprobs,
# chat's top_logprobs); each count asked for is a scoring program of its own
TOP_LOGPROBS, TOP_LOGPROBS_CHAT = 5, 20
_INT64 = lambda v: -2**63 <= v < 2**63
_PENALTY = (NUMBER, 0.0, within(-2, 2), "a number in [-2, 2]")
_TOP_P = (NUMBER, 1.0, lambda v: 0 < (float32_or_none(v) or 0) <= 1,
          "a number in (0, 1] that stays above 0 in float32")
_STOP = ((str, list), OPTIONAL, lambda v: (isinstance(v, str) and v) or (
    isinstance(v, list) and 1 <= len(v) <= 16 and all(isinstance(s, str) and s for s in v)),
    "a non-empty string or a list of 1 to 16 of them")
# The fields both endpoints read alike
SAMPLING = {
    "model": (str, "", None, "a string"),
    "temperature": (NUMBER, 1.0, within(0, 2), "a number in [0, 2] (0 is greedy)"),
    "top_p": _TOP_P,
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0 (0 is off)"),
    "n": (int, 1, lambda v: v >= 1, "an integer >= 1 (completions per prompt)"),
    "stop": _STOP,
    "stream": BOOL,
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
    "echo": BOOL,
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
    "logprobs": BOOL,
    "top_logprobs": (int, OPTIONAL, lambda v: 0 <= v <= TOP_LOGPROBS_CHAT,
                     f"an integer in [0, {TOP_LOGPROBS_CHAT}]"),
}
# OpenAI's fields that this server does not implement: accepted only at the value that asks
# for nothing (null, or the value named), else a 400 that says so.
_NONE = lambda v: v is None
COMPLETIONS_NOT_IMPLEMENTED = {"suffix": (lambda v: v in (None, ""),
                                          "text after the insertion point")}
CHAT_NOT_IMPLEMENTED = {
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


def _logit_bias(texts: Texts, value: dict | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as (id, bias) pairs."""
    pairs = []
    for key, bias in (value or {}).items():
        # An id as OpenAI's clients write it, ASCII decimals without leading zeros (one key an
        # id): int() also reads other scripts' digits ("٣" is 3), and str.isdigit() passes
        # superscripts ("²") that int() refuses
        token = int(key) if key.isascii() and key.isdigit() else -1
        if str(token) != key or not 0 <= token < texts.vocab_size:
            raise BadRequest("logit_bias", f"logit_bias: {key!r} is not a token id of this "
                             f"model (0 to {texts.vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, NUMBER) \
                or not within(-100, 100)(bias):
            raise BadRequest("logit_bias", f"logit_bias[{key!r}]={shown(bias)} must be a "
                             "number in [-100, 100]")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _sampling(texts: Texts, v: dict, max_new: int, seed: int | None) -> SamplingParams:
    """The settings of an OpenAI request for one choice."""
    check_top_k(texts, v["top_k"])
    return SamplingParams(
        max_new, float(v["temperature"]), v["top_k"], float(v["top_p"]), seed=seed,
        presence_penalty=float(v["presence_penalty"]),
        frequency_penalty=float(v["frequency_penalty"]),
        logit_bias=_logit_bias(texts, v["logit_bias"]))


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
                await stream.send(generation_failed(err).body())
                return await stream.close()
            await stream.send(chunk(i, None, c.finish_reason))
        if usage is not None:
            await stream.send({**usage_chunk, "choices": [], "usage": _usage(usage, choices)})
        return await stream.close()
    except (asyncio.CancelledError, ConnectionResetError) as gone:
        left(request, choices)
        if isinstance(gone, asyncio.CancelledError):
            raise
        return stream.response


def _usage(prompt_tokens: dict, choices: list[Choice]) -> dict:
    """OpenAI's usage: the prompts' tokens (each prompt once, whatever n), the completions'
    tokens as the stops cut them, and their sum."""
    completion = sum(len(c.new) for c in choices)
    prompt = prompt_tokens["prompt_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _prompts(texts: Texts, prompt, limits: Limits) -> tuple[list[list[int]], list[str]]:
    """OpenAI's prompt (a string, strings, token ids, or lists of them) as each prompt's
    ids and text."""
    if isinstance(prompt, str) or _token_ids(prompt):
        prompt = [prompt]
    check_prompts(limits, len(prompt), "prompt")
    names = [f"prompt[{i}]" if len(prompt) > 1 else "prompt" for i in range(len(prompt))]
    ids = [check_ids(texts, texts.encode(p) if isinstance(p, str) else p, name, limits)
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
    [scored] = await score(engine, [scored_ids], top_n) if len(scored_ids) > 1 else [[]]
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


def _stream_fields(v: dict) -> bool:
    """Whether the stream's last chunk carries the usage (stream_options.include_usage); a
    400 for stream_options without stream or logprobs with it."""
    if v["stream_options"] is not None and not v["stream"]:
        raise BadRequest("stream_options", "stream_options is for streamed answers: send it "
                         "with stream=true, or leave it out")
    if v["stream"] and v["logprobs"] is not None and v["logprobs"] is not False:
        raise BadRequest("logprobs", "logprobs are not streamed; ask for them without stream")
    return bool((v["stream_options"] or {}).get("include_usage"))


def _completion_fields(v: dict, limits: Limits):
    """A 400 for the completion fields that do not go together or pass the limits."""
    n, echo = v["n"], v["echo"]
    if v["best_of"] is not None and v["best_of"] != n:
        raise Unsupported("best_of", f"best_of={v['best_of']} with n={n}: this server does not "
                          "rank several samples; leave best_of out or equal to n")
    check_new_tokens("max_tokens", v["max_tokens"], limits, least=0 if echo else 1)
    if v["stream"] and echo and v["max_tokens"] == 0:
        raise BadRequest("stream", "max_tokens=0 with echo scores the prompt: ask for it "
                         "without stream")
    # n copies of each prompt: where they pass a limit the prompts alone do not, n is named
    # (checked before they are made: a huge n held the server while it built them)
    single = isinstance(v["prompt"], str) or _token_ids(v["prompt"])
    check_prompts(limits, (1 if single else len(v["prompt"])) * n, "prompt" if n == 1 else "n")


async def completions(request: web.Request):
    engine, texts, limits = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    v = await parse(request, COMPLETIONS, COMPLETIONS_NOT_IMPLEMENTED, null_is_absent=True)
    include_usage = _stream_fields(v)
    _completion_fields(v, limits)
    n, echo = v["n"], v["echo"]
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"] or []
    prompts, prompt_texts = _prompts(texts, v["prompt"], limits)
    meta = _meta("text_completion", request, v["model"])
    usage = {"prompt_tokens": sum(map(len, prompts))}
    if v["max_tokens"] == 0:  # echo: the prompts scored, nothing generated
        choices = [None] * len(prompts) * n
    else:
        params = [_sampling(texts, v, v["max_tokens"], row_seed(v["seed"], j))
                  for _ in prompts for j in range(n)]
        choices = submit(request, [p for p in prompts for _ in range(n)], params,
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
        choices = await finished(request, choices)
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


def _chat_prompt(request: web.Request, v: dict) -> tuple[list[int], int | None]:
    """The conversation's ids as the chat template renders it, and the template's end of
    turn where it is one token other than eos (it ends a reply), or None."""
    texts, limits = request.app[TEXTS], request.app[LIMITS]
    template: ChatTemplate | None = request.app[CHAT_TEMPLATE]
    if template is None:
        raise BadRequest("messages", "this model has no chat template: start the server with "
                         "--chat-template FILE (a Jinja template), or add a chat_template to "
                         "the model's tokenizer_config.json (or a chat_template.jinja beside "
                         "it)", "no_chat_template")
    try:
        ids = template.encode(texts.tokenizer, _chat_messages(v["messages"]),
                              add_generation_prompt=True)
    except ChatTemplateError as error:
        raise BadRequest("messages", str(error)) from None
    check_ids(texts, ids, "messages", limits)
    end = texts.single_token(template.special_tokens.get("eos_token"))
    return ids, end if end != texts.eos else None


async def chat_completions(request: web.Request):
    engine, texts, limits = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    v = await parse(request, CHAT, CHAT_NOT_IMPLEMENTED, null_is_absent=True)
    include_usage = _stream_fields(v)
    if v["top_logprobs"] is not None and not v["logprobs"]:
        raise BadRequest("top_logprobs", "top_logprobs needs logprobs=true")
    name = "max_completion_tokens" if v["max_completion_tokens"] is not None else "max_tokens"
    if v[name] is not None:
        check_new_tokens(name, v[name], limits)
    ids, end = _chat_prompt(request, v)
    # OpenAI's default is what fits after the prompt: here the server's limit, and in a model
    # with attention layers the keys a slot holds (a request that set neither was a 400)
    room = engine.kv_tokens - len(ids) if engine.kv_tokens else limits.max_new_tokens
    max_new = v[name] if v[name] is not None else max(1, min(limits.max_new_tokens, room))
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"] or []
    n = v["n"]
    params = [dataclasses.replace(_sampling(texts, v, max_new, row_seed(v["seed"], j)),
                                  stop_token_ids=() if end is None else (end,))
              for j in range(n)]
    choices = submit(request, [ids] * n, params, "messages" if n == 1 else "n", stops)
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
    choices = await finished(request, choices)
    scored = [None] * n
    if v["logprobs"]:
        scored = await score(engine, [ids + c.new for c in choices], v["top_logprobs"] or 0)
    return web.json_response({**meta, "choices": [
        {"index": i, "message": {"role": "assistant", "content": c.text},
         "logprobs": _chat_logprobs(texts, ids, c, s) if v["logprobs"] else None,
         "finish_reason": c.finish_reason}
        for i, (c, s) in enumerate(zip(choices, scored))], "usage": _usage(usage, choices)})
