"""`python -m mamba_jax.generate --checkpoint DIR --prompt TEXT`: generate from a checkpoint.

DIR is a model dir (HF or mamba_ssm layout, as the trainer's --out or convert write) or a
trainer's --checkpoint-dir (its newest step). Uses the checkpoint's tokenizer.json or
tokenizer.model (or --tokenizer PATH|bytes). With `--server URL` instead of --checkpoint it
is the client of `python -m mamba_jax.serve`: it streams the continuation from
URL/v1/completions and prints it as it arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import urllib.parse

import jax.numpy as jnp

from mamba_jax import compilation_cache
from mamba_jax.cli import HelpFormatter, command
from mamba_jax.generate import (MOST_NEW_TOKENS, add_decode_arguments, decode_options,
                                generate, load_for_generation)


# What the server's model and its serve flags decide: --server takes none of them.
_NOT_WITH_SERVER = ("tokenizer", "top_k", "seed", "dtype", "ssm_state_dtype",
                    "step_implementation", "compilation_cache")


def _parser():
    parser = argparse.ArgumentParser(prog="python -m mamba_jax.generate",
                                     description="Generate text from a Mamba2 checkpoint.",
                                     formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="checkpoint dir (HF or mamba_ssm), or a "
                                             "trainer's --checkpoint-dir (its newest step)")
    source.add_argument("--server", help="a mamba_jax.serve URL, e.g. http://127.0.0.1:6000")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json or tokenizer.model path, or 'bytes' (default: "
                             "the checkpoint's tokenizer.json or tokenizer.model)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help=f"at most {MOST_NEW_TOKENS}: the output is allocated whole up "
                             "front")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k most likely tokens (default or 0: off)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample among the most likely tokens whose probability reaches p "
                             "(default or 1: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_decode_arguments(parser)
    compilation_cache.add_argument(parser)
    return parser


@command("python -m mamba_jax.generate")
def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    _check_sampling(args)
    try:  # bytes of another encoding in the command line arrive as lone surrogates
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = args.prompt[error.start:error.end].encode("utf-8", "surrogateescape")
        raise SystemExit(f"--prompt holds bytes that are not UTF-8 text ({bad!r}); give it "
                         "in UTF-8") from None
    if args.server and urllib.parse.urlsplit(args.server).scheme not in ("http", "https"):
        raise SystemExit(f"--server {args.server}: no http:// or https:// before the address; "
                         "give e.g. http://127.0.0.1:6000")
    if args.server:
        given = _parser()  # the command line alone: no option defaulted
        for action in given._actions:
            action.default = argparse.SUPPRESS
        ignored = [f"--{name.replace('_', '-')}" for name in _NOT_WITH_SERVER
                   if name in vars(given.parse_args(argv))]
        if ignored:
            raise SystemExit(f"{', '.join(ignored)}: not part of /v1/completions (the "
                             "server's model and its serve flags decide them); leave "
                             f"{'them' if len(ignored) > 1 else 'it'} out with --server")
        asyncio.run(stream_from_server(args.server, args.prompt, args.max_new_tokens,
                                       args.temperature, args.top_p))
        print()
        return

    compilation_cache.use(args.compilation_cache)
    model, tokenizer, eos = load_for_generation(args.checkpoint, args.tokenizer, args.dtype)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise SystemExit("--prompt encodes to no tokens; give some text")
    if args.top_k is not None and args.top_k > model.config.vocab_size:
        raise SystemExit(f"--top-k={args.top_k} must be at most the vocabulary, "
                         f"{model.config.vocab_size} (0 is off)")
    out = generate(model, jnp.asarray([ids]), args.max_new_tokens, args.temperature,
                   args.top_k, args.top_p, args.seed, eos, **decode_options(args))
    new = [int(t) for t in out[0, len(ids):]]
    if eos in new:  # what follows it is the output's filling, not text
        new = new[:new.index(eos)]
    print(tokenizer.decode(ids + new))


def _check_sampling(args):
    """Refuse a decoding flag's value before a model loads, naming the flag (generate()
    checks the values again for callers of the API, naming its arguments)."""
    checks = {
        "max_new_tokens": (1 <= args.max_new_tokens <= MOST_NEW_TOKENS,
                           f"an integer in [1, {MOST_NEW_TOKENS}] (the output is allocated "
                           "whole up front)"),
        "temperature": (math.isfinite(args.temperature) and args.temperature >= 0,
                        "a finite number >= 0 (0 is greedy)"),
        "top_k": (args.top_k is None or 0 <= args.top_k < 1 << 31,
                  "an integer >= 0, at most the vocabulary (0 is off)"),
        "top_p": (args.top_p is None or 0 < args.top_p <= 1, "a number in (0, 1] (1 is off)"),
    }
    for name, (ok, must) in checks.items():
        if not ok:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be {must}")


async def stream_from_server(url, prompt, max_tokens, temperature, top_p):
    """Print prompt, then the server's streamed completion of it as it arrives."""
    try:
        import aiohttp
    except ImportError as missing:
        raise SystemExit(f"--server needs {missing.name}: pip install 'mamba-jax[serve]'") \
            from None

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, **({} if top_p is None else {"top_p": top_p})}
    async with aiohttp.ClientSession() as session:
        try:
            response = await session.post(url.rstrip("/") + "/v1/completions", json=body)
        except (aiohttp.ClientError, OSError) as error:  # no URL, refused, unknown host
            why = "not an http URL" if isinstance(error, aiohttp.InvalidURL) else \
                f"cannot reach it ({error})"
            raise SystemExit(f"--server {url}: {why}; give the address a `python -m "
                             "mamba_jax.serve` listens on, e.g. http://127.0.0.1:6000") from None
        async with response:
            if response.status != 200:
                raise SystemExit(f"--server {url} answered {response.status}: "
                                 f"{await response.text()}")
            print(prompt, end="", flush=True)
            done, broken = False, ""
            try:
                async for line in response.content:
                    data = line.decode().removeprefix("data: ").strip()
                    done = done or data == "[DONE]"
                    if data and data != "[DONE]":
                        event = json.loads(data)
                        if "error" in event:
                            raise SystemExit(f"--server {url} failed the request: "
                                             f"{event['error']['message']}")
                        print(event["choices"][0]["text"], end="", flush=True)
            except aiohttp.ClientError as error:  # the connection dropped mid-stream
                broken = f" ({error})"
            if not done:  # the server's stream ends with [DONE]: what came may be cut short
                print(flush=True)
                raise SystemExit(f"--server {url}: the stream stopped before its end{broken}; "
                                 "the text above is what arrived")


if __name__ == "__main__":
    main()
