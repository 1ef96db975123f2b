"""Megatron-LM's text-generation request, PUT /api, with every field its server reads:
{"prompts": [str], "tokens_to_generate", "temperature", "top_k", "top_p", "logprobs",
"random_seed", "add_BOS", "stop_on_eol", "stop_on_double_eol",
"prevent_newline_after_colon", "top_p_decay", "top_p_bound", "length_penalty",
"stop_token", "no_log"} -> Megatron's {"text": [prompt + continuation], "segments": [[each
token's text]], "tokens": [[prompt and new ids]], "logprobs": [[log p of each token after
the first]] (with "logprobs": true)}. "beam_width" is a 400 (BEAM_SEARCH says why).

The fields as Megatron's server reads them: stop_on_eol ends a continuation at its first
token whose text holds a newline, stop_on_double_eol at two newlines in a row (the prompt's
last newline counts), the ending token kept (Megatron stops at GPT-2's newline ids; here
the tokens' text decides, for any tokenizer); prevent_newline_after_colon bans the token of
"\n" right after the token of ":" (each as it reads after other text); top_p decays to
max(top_p * top_p_decay**i, top_p_bound) at new token i; random_seed makes a request's
samples reproducible (prompt j samples with random_seed + j, whatever decodes beside it);
add_BOS puts the tokenizer's BOS token first; stop_token ends a continuation too (not
returned); the request is logged unless no_log. The line stops end the text after the
decode loop, which runs to the token limit or eos. length_penalty is accepted and unused,
as Megatron's sampling path does (it weighs beam search's hypotheses). logprobs come from
one forward pass over the prompt and continuation (Engine.score): the raw logits'
log-softmax, as Megatron's. Like Megatron's server, a null setting is refused.
"""

from __future__ import annotations

import dataclasses
import logging

from aiohttp import web

from mamba_jax.engine import SamplingParams
from mamba_jax.http_api import (BOOL, ENGINE, LIMITS, NUMBER, OPTIONAL, REQUIRED, TEXTS,
                                BadRequest, Texts, Unsupported, check_ids, check_new_tokens,
                                check_prompts, check_top_k, finished, float32_or_none, parse,
                                row_seed, score, shown, submit, within)
from mamba_jax.tokenizer import special_token_ids

log = logging.getLogger("mamba_jax.serve")

MEGATRON = {
    "prompts": (list, REQUIRED, lambda v: v and all(isinstance(p, str) for p in v),
                "a non-empty list of strings"),
    "tokens_to_generate": (int, 64, None, "an integer"),
    "temperature": (NUMBER, 1.0, within(0, float("inf")), "a finite number >= 0 (0 is greedy)"),
    "top_k": (int, 0, lambda v: v >= 0, "an integer >= 0 (0 is off)"),
    "top_p": (NUMBER, 0.0, lambda v: v == 0 or 0 < (float32_or_none(v) or 0) <= 1,
              "0 (off) or a number in (0, 1] that stays above 0 in float32"),
    "logprobs": BOOL,
    # A jax PRNG key takes 32 bits of a seed: larger ones would collide.
    "random_seed": (int, OPTIONAL, lambda v: 0 <= v < 1 << 32, "an integer in [0, 2**32)"),
    "add_BOS": BOOL,
    "stop_on_eol": BOOL,
    "stop_on_double_eol": BOOL,
    "prevent_newline_after_colon": BOOL,
    "top_p_decay": (NUMBER, 0.0, within(0, 1), "a number in [0, 1] (0 is off)"),
    "top_p_bound": (NUMBER, 0.0, within(0, 1), "a number in [0, 1] (0 is off)"),
    "length_penalty": (NUMBER, 1.0, lambda v: float32_or_none(v) is not None,
                       "a finite number"),
    "beam_width": (int, OPTIONAL, None, "an integer"),
    "stop_token": (int, OPTIONAL, None, "an integer (a token id)"),
    "no_log": BOOL,
}
# Fields Megatron-LM's server names a replacement for
MEGATRON_RENAMED = {"max_len": "tokens_to_generate", "sentences": "prompts"}
# Why PUT /api answers a beam_width with a 400 (Megatron-LM's own server now refuses it too:
# "Beam search is no longer supported").
BEAM_SEARCH = ("beam_width: beam search is not supported: the compiled decode loop carries "
               "one recurrent state per row (every Mamba layer's conv window and SSM state), "
               "and beam search would have to copy those states between beams at every "
               "token; sample instead (temperature, top_k, top_p), or send several prompts")


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


def _check(v: dict, texts: Texts, limits):
    """A 400 for the settings that do not go together or that the model cannot take."""
    check_new_tokens("tokens_to_generate", v["tokens_to_generate"], limits, least=0)
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
    check_top_k(texts, v["top_k"])
    stop_token = v["stop_token"]
    if stop_token is not None and not 0 <= stop_token < texts.vocab_size:
        raise BadRequest("stop_token", f"stop_token={stop_token} is not a token id of this "
                         f"model (0 to {texts.vocab_size - 1})")
    check_prompts(limits, len(v["prompts"]), "prompts")


def _prompt_ids(v: dict, texts: Texts, limits) -> list[list[int]]:
    """Each prompt's ids, after the tokenizer's BOS token with add_BOS."""
    bos = special_token_ids(texts.tokenizer)["bos_token_id"]
    if v["add_BOS"] and bos is None:
        raise BadRequest("add_BOS", "add_BOS: this server's tokenizer has no BOS token; leave "
                         "add_BOS out")
    names = [f"prompts[{i}]" if len(v["prompts"]) > 1 else "prompts"
             for i in range(len(v["prompts"]))]
    return [check_ids(texts, [bos] * v["add_BOS"] + texts.encode(p), name, limits)
            for p, name in zip(v["prompts"], names)]


async def megatron_api(request: web.Request):
    engine, texts, limits = request.app[ENGINE], request.app[TEXTS], request.app[LIMITS]
    v = await parse(request, MEGATRON, renamed=MEGATRON_RENAMED)
    if not v["no_log"]:  # Megatron's server logs each request unless no_log
        log.info("PUT /api from %s: %s", request.remote, shown(v["prompts"]))
    _check(v, texts, limits)
    ids = _prompt_ids(v, texts, limits)
    new = [[] for _ in ids]
    if v["tokens_to_generate"]:
        params = SamplingParams(
            v["tokens_to_generate"], float(v["temperature"]), v["top_k"],
            float(v["top_p"] or 1.0), float(v["top_p_decay"]), float(v["top_p_bound"]),
            banned_after=(texts.token_of(":"), texts.token_of("\n"))
            if v["prevent_newline_after_colon"] else None,
            stop_token_ids=() if v["stop_token"] is None else (v["stop_token"],))
        # Prompt j samples with random_seed + j: the same prompt twice in a request gives two
        # samples, as from Megatron's one generator seeded for the batch (they were the same)
        choices = await finished(request, submit(
            request, ids, [dataclasses.replace(params, seed=row_seed(v["random_seed"], j))
                           for j in range(len(ids))], "prompts", []))
        new = [c.new for c in choices]
        if v["stop_on_eol"] or v["stop_on_double_eol"]:
            new = [_line_end(texts, i, n, v["stop_on_double_eol"]) for i, n in zip(ids, new)]
    tokens = [i + n for i, n in zip(ids, new)]
    response = {"text": [p + texts.continuation(i, n)
                         for p, i, n in zip(v["prompts"], ids, new)],
                "segments": [texts.segments(t) for t in tokens], "tokens": tokens}
    if v["logprobs"]:
        response["logprobs"] = [[lp for lp, _ in s] for s in await score(engine, tokens, 0)]
    return web.json_response(response)
