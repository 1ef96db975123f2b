"""`python -m mamba_jax.serve --checkpoint DIR [--port 6000] [--host 127.0.0.1]`: a text
generation server (aiohttp) speaking the APIs that clients already use. DIR is a model dir
(HF or mamba_ssm) or a trainer's --checkpoint-dir (its newest step).

Endpoints (docs/serving.md lists every field):
  POST /v1/completions       OpenAI's completions, as the `openai` package and lm-eval's
                             local-completions send them (mamba_jax.openai_api)
  POST /v1/chat/completions  OpenAI's chat completions, the conversation rendered with the
                             model's chat template (or serve --chat-template FILE)
  PUT  /api                  Megatron-LM's text-generation request, every field its server
                             reads (mamba_jax.megatron_api)
  GET  /v1/models            the one model served
  GET  /metrics              Prometheus's text format: queue, slots, tokens, latencies
  GET  /health               {"status": "ok", ...}

This module is the application and its command line. The protocol modules parse and check
requests, tokenize, cut at stop strings, assemble echo and logprobs and write the JSON
(what they share: mamba_jax.http_api); mamba_jax.engine decodes token ids in its slots
(continuous batching: a request joins the running batch at its next step and leaves it when
done, each prompt with its own sampling settings and token limit). Every answer that is not
a 200 has OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, aiohttp's
own 404, 405 and 413 included: a bad request is a 400 naming the field (`param`), never a
500; a request that would queue more than --max-queued-tokens is a 503 to retry; a failure
fails the request it is in (a stream then ends with an error event and [DONE]), and the
server keeps serving. A client that disconnects cancels its sequences: those still queued
never run, those decoding leave their slots at the engine's next step.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import socket
import sys
import time
from pathlib import Path

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
from mamba_jax.chat import ChatTemplate, ChatTemplateError, model_special_tokens
from mamba_jax.cli import HelpFormatter, command, require_at_least
from mamba_jax.convert import is_training_checkpoint, load_config
from mamba_jax.engine import (Engine, EngineOptions, Limits, add_engine_arguments,
                              check_options, engine_options)
from mamba_jax.generate import (MOST_NEW_TOKENS, add_decode_arguments, checkpoint_dir,
                                decode_options, load_for_generation)
from mamba_jax.http_api import (CHAT_TEMPLATE, ENGINE, LIMITS, MODEL_NAME, STARTED, TEXTS,
                                ApiError, Texts)
from mamba_jax.megatron_api import megatron_api
from mamba_jax.openai_api import chat_completions, completions
from mamba_jax.tokenizer import find_tokenizer, load_tokenizer

log = logging.getLogger("mamba_jax.serve")

MAX_BODY_BYTES = 1 << 20  # a request's body (aiohttp's default)
# aiohttp's own refusals, in our words
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _http_error(request: web.Request, error: web.HTTPException) -> ApiError:
    """aiohttp's refusal (an unknown path, a method the path does not take, a body over the
    limit) in OpenAI's error shape."""
    if error.status == 404:
        message = (f"{request.method} {request.path}: no such endpoint; this server serves "
                   f"{', '.join(ROUTES)}")
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
                    _HTTP_CODES.get(error.status), headers)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every non-200 answer in OpenAI's error shape: ours (ApiError), aiohttp's, and a
    failure of our own (a 500 that names it; the server keeps serving)."""
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _http_error(request, error).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:  # noqa: BLE001 - a bug: answer, log
        log.exception("%s %s failed", request.method, request.path)
        return ApiError(500, f"{type(error).__name__}: {error}", None,
                        "internal_error").response()


async def models(request: web.Request):
    return web.json_response({"object": "list", "data": [
        {"id": request.app[MODEL_NAME], "object": "model", "created": request.app[STARTED],
         "owned_by": "mamba-jax"}]})


async def health(request: web.Request):
    stats = request.app[ENGINE].stats()
    return web.json_response({"status": "ok", "model": request.app[MODEL_NAME],
                              **{k: stats[k] for k in ("queued", "slots_busy", "slots",
                                                       "tokens_generated")}})


class EngineMetrics:
    """The engine's stats() at each scrape, as Prometheus metrics."""

    GAUGES = (("queued_requests", "queued", "Sequences waiting for a slot"),
              ("queued_tokens", "queued_tokens", "Prompt and new tokens of the sequences "
               "waiting to prefill"),
              ("busy_slots", "slots_busy", "Decode slots in use"),
              ("slots", "slots", "Decode slots"),
              ("tokens_per_second", "tokens_per_second", "New tokens a second, lately"),
              ("prefix_cache_bytes", "prefix_cache_bytes", "Bytes the prefix cache holds"),
              ("prefix_cache_entries", "prefix_cache_entries", "Prefixes the cache holds"))
    COUNTERS = (("generated_tokens", "tokens_generated", "New tokens generated"),
                ("prefill_tokens", "prefill_tokens", "Prompt tokens prefilled (a cached "
                 "prefix's are not)"),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompts that started from a "
                 "cached prefix's states"),
                ("prefix_cache_lookups", "prefix_cache_lookups", "Prompts looked up in the "
                 "prefix cache"))
    HISTOGRAMS = (("time_to_first_token_seconds", "ttft_seconds",
                   "Time to first token, from submission"),
                  ("time_per_output_token_seconds", "tpot_seconds",
                   "Time per output token after the first"))

    def __init__(self, app: web.Application):
        self.app = app

    def collect(self):
        s = self.app[ENGINE].stats()
        for name, key, what in self.GAUGES:
            yield GaugeMetricFamily(f"mamba_{name}", what, value=s[key])
        for name, key, what in self.COUNTERS:
            yield CounterMetricFamily(f"mamba_{name}", what, value=s[key])
        finished = CounterMetricFamily("mamba_finished_requests", "Sequences ended, by why",
                                       labels=["reason"])
        for reason, count in s["requests_finished"].items():
            finished.add_metric([reason], count)
        yield finished
        for name, key, what in self.HISTOGRAMS:
            h = s[key]
            yield HistogramMetricFamily(
                f"mamba_{name}", what, sum_value=h["sum"],
                buckets=[("+Inf" if math.isinf(le) else repr(float(le)), count)
                         for le, count in h["buckets"]])


METRICS = web.AppKey("metrics", prometheus_client.CollectorRegistry)


async def metrics(request: web.Request):
    return web.Response(body=prometheus_client.generate_latest(request.app[METRICS]),
                        headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


ROUTES = {"POST /v1/completions": completions, "POST /v1/chat/completions": chat_completions,
          "PUT /api": megatron_api, "GET /v1/models": models, "GET /metrics": metrics,
          "GET /health": health}


def make_app(model, tokenizer, limits: Limits = Limits(), eos_token_id=None,
             model_name: str = "mamba2", generate_options=None, engine_options=None,
             chat_template: ChatTemplate | None = None) -> web.Application:
    """The aiohttp application; its engine runs while the app does. generate_options: how
    the decode steps run (ssm_state_dtype, step_implementation); engine_options:
    mamba_jax.engine.EngineOptions' fields (slots, prefix_cache_mb, ...); chat_template:
    what /v1/chat/completions renders conversations with (None: it answers a 400 that says
    how to give one). A ValueError for a model or options the engine cannot serve."""
    # A client that disconnects cancels its handler, which cancels its sequences.
    app = web.Application(handler_args={"handler_cancellation": True},
                          client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    app[MODEL_NAME] = model_name
    app[STARTED] = int(time.time())
    app[LIMITS] = limits
    app[TEXTS] = Texts(tokenizer, model.config.vocab_size, eos_token_id)
    app[CHAT_TEMPLATE] = chat_template
    app[ENGINE] = Engine(model, tokenizer, limits, eos_token_id, generate_options,
                         **(engine_options or {}))
    app[METRICS] = prometheus_client.CollectorRegistry()
    app[METRICS].register(EngineMetrics(app))

    async def engine_task(app):
        task = asyncio.create_task(app[ENGINE].run())
        yield
        task.cancel()
        app[ENGINE].executor.shutdown(wait=False, cancel_futures=True)

    app.cleanup_ctx.append(engine_task)
    for route, handler in ROUTES.items():
        method, path = route.split()
        app.router.add_route(method, path, handler)
        if method == "GET":  # and HEAD, as HTTP asks of a server (probes send it)
            app.router.add_route("HEAD", path, handler)
    return app


def _check_serving_flags(args):
    """Refuse a checkpoint that is not there or holds no model or tokenizer, a chat template
    that does not compile, limits and engine options the server could not serve under and
    an address it cannot listen on, in that order, before the model loads (minutes for a
    large one). -> the chat template given, or None."""
    try:
        checkpoint = checkpoint_dir(args.checkpoint)
        # A folder that holds no model (no config.json, or none of a known layout) or no
        # tokenizer is named here, before a busy port, which hid it until the model loaded
        # (both are read again then, in a moment)
        if not is_training_checkpoint(checkpoint):
            load_config(checkpoint)
            load_tokenizer(args.tokenizer or find_tokenizer(checkpoint)
                           or checkpoint / "tokenizer.json")
        # The model's special tokens (its tokenizer_config.json's), which transformers hands a
        # template given apart from the tokenizer too: its bos_token and eos_token were ""
        special = model_special_tokens(checkpoint)
    except (FileNotFoundError, ValueError) as error:  # ChatTemplateError among the latter
        raise SystemExit(str(error)) from None
    try:
        template = None if args.chat_template is None else ChatTemplate.from_file(
            args.chat_template, special)
    except ChatTemplateError as error:
        raise SystemExit(f"--chat-template {str(error).removeprefix('chat template ')}"
                         ) from None
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
    return template


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts,
                        help="prompts in one request")
    parser.add_argument("--max-queued-tokens", type=int, default=Limits.max_queued_tokens,
                        help="prompt and new tokens of all waiting prompts: a request "
                             "that needs more alone is a 400, one that finds the queue too "
                             "full a 503")
    add_engine_arguments(parser)
    add_decode_arguments(parser)
    compilation_cache.add_argument(parser)
    return parser


@command("python -m mamba_jax.serve")
def main(argv=None):
    args = _parser().parse_args(argv)
    template = _check_serving_flags(args)

    compilation_cache.use(args.compilation_cache)
    model, tokenizer, eos = load_for_generation(args.checkpoint, args.tokenizer, args.dtype)
    if template is None:
        try:
            template = ChatTemplate.from_model_dir(args.checkpoint)
        except ChatTemplateError as error:
            raise SystemExit(str(error)) from None
    limits = Limits(args.max_prompt_tokens, args.max_new_tokens, args.max_prompts,
                    args.max_queued_tokens)
    try:
        app = make_app(model, tokenizer, limits, eos, Path(args.checkpoint).resolve().name,
                       decode_options(args), engine_options(args), template)
    except ValueError as error:
        raise SystemExit(f"{args.checkpoint}: {error}") from None
    print(_memory_line(app[ENGINE].memory(), args.slots), flush=True)
    web.run_app(app, host=args.host, port=args.port)


def _memory_line(memory: dict, slots: int) -> str:
    """What the engine holds on the device, as serve reports it at start."""
    size = lambda n: f"{n / 2**20:,.1f} MB" if n >= 2**20 else f"{n / 2**10:,.1f} KB"
    keys = (f" (attention keys and values for {memory['kv_tokens']} tokens a slot: "
            "a longer prompt and max_tokens is refused)" if memory["kv_tokens"] else "")
    prefix = size(memory["prefix_cache"]) if memory["prefix_cache"] else "off"
    return (f"engine: {slots} slots of {size(memory['slot'])} each, {size(memory['slots'])} "
            f"in all{keys}; prefill staging {size(memory['staging'])}; prefix cache {prefix}")


if __name__ == "__main__":
    main()
