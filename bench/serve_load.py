"""The server under load: requests/s and p50/p99 latency at 1, 16 and 64 concurrent clients.

    python3 -m bench.serve_load [--preset mamba2-1.3b | --checkpoint DIR] [--dtype bfloat16]
                                [--concurrency 1,16,64] [--seconds 30] [--max-requests 2000]
                                [--prompt-tokens 128] [--new-tokens 128]
                                [--ssm-state-dtype float32] [--step-implementation auto]

Starts the server (mamba_jax.serve's application, its batching as `python -m
mamba_jax.serve` runs it: --max-batch 64, a 5 ms window) in a child process on loopback,
with a preset's random weights and the byte tokenizer, or a checkpoint and its tokenizer;
end of sequence is off, so every request generates exactly --new-tokens. Before timing, one
request of n prompts for each batch the server can form (n = 1, 2, 4, ... up to the largest
concurrency, the bucket sizes it compiles for) compiles what the clients will run. Then, for
each concurrency c: c client threads (the standard library's http.client, one keep-alive
connection each) send greedy POST /v1/completions requests of one prompt, each next one as
soon as its answer is back, until --seconds have passed or --max-requests are answered
(what is in flight then finishes). Prompts: --prompt-tokens bytes of the bundled corpus at
spread offsets (with the byte tokenizer, exactly that many tokens; a checkpoint's tokenizer
makes fewer, and a batch whose prompts fall in another power-of-two bucket compiles during
the timing).

Prints, after a line with the date, the device and jax's version (the server's), one row per
concurrency: requests answered, seconds, requests/s, new tokens/s, p50 and p99 latency (a
request's time from its send to its whole answer), and failed requests (not 200).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import socket
import subprocess
import sys
import threading
import time

from bench.harness import ROOT, child_environment, result, table_header, table_row
from mamba_jax.generate import add_decode_arguments, decode_options

HOST = "127.0.0.1"


def prompts(count: int, tokens: int) -> list[str]:
    """count prompts of at most `tokens` bytes of the bundled corpus (UTF-8 cut to whole
    characters), at offsets spread over it."""
    from mamba_jax.data import DEFAULT_CORPUS

    text = DEFAULT_CORPUS.read_bytes()
    stride = (len(text) - tokens) // count
    return [text[i * stride:i * stride + tokens].decode("utf-8", "ignore")
            for i in range(count)]


def request(connection: http.client.HTTPConnection, prompt, new_tokens: int) -> int:
    """One greedy completion of prompt (a string, or a list of them: one row each) on
    connection; its HTTP status once the whole answer is read."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0})
    connection.request("POST", "/v1/completions", body,
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    return response.status


def load(port: int, clients: int, texts: list[str], new_tokens: int, seconds: float,
         max_requests: int) -> tuple[list[float], int, float]:
    """`clients` threads sending requests back to back until `seconds` have passed or
    max_requests are answered -> (latencies in s of the answered requests, how many failed,
    wall seconds from the first send to the last answer)."""
    latencies, failed, lock = [], [0], threading.Lock()
    start = time.perf_counter()
    deadline = start + seconds

    def client(index):
        connection = http.client.HTTPConnection(HOST, port, timeout=3600)
        try:
            for sent in range(max_requests):
                with lock:
                    if len(latencies) + failed[0] >= max_requests:
                        return
                if time.perf_counter() >= deadline:
                    return
                begin = time.perf_counter()
                status = request(connection, texts[(index + sent * clients) % len(texts)],
                                 new_tokens)
                with lock:
                    if status == 200:
                        latencies.append(time.perf_counter() - begin)
                    else:
                        failed[0] += 1
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, failed[0], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (q in (0, 1]) of values."""
    ranked = sorted(values)
    return ranked[max(math.ceil(q * len(ranked)) - 1, 0)]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def start_server(argv: list[str], port: int, timeout: float) -> tuple[subprocess.Popen, dict]:
    """This module's --serve-child with argv on port: (the process, what it reported once
    its model was built: its device line), after /health answers; exits if it does not
    within timeout seconds."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.serve_load", "--serve-child", "--port", str(port), *argv],
        cwd=ROOT, env=child_environment(), stdout=subprocess.PIPE, text=True)
    line = " "
    while line and not line.startswith("RESULT "):  # its result() line, or '' at its exit
        line = child.stdout.readline()
    if not line:
        child.kill()
        raise SystemExit(f"the server did not start (exit {child.wait()}); its stderr is "
                         "above")
    # Whatever it prints later is read and dropped, so that a full pipe never stalls it.
    threading.Thread(target=child.stdout.read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = http.client.HTTPConnection(HOST, port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return child, json.loads(line[len("RESULT "):])
        except OSError:
            pass
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise SystemExit(f"the server on port {port} did not answer /health")
        time.sleep(0.2)


def serve_child(args):
    """The server process: the model, then mamba_jax.serve's application until terminated."""
    import jax.numpy as jnp
    from aiohttp import web
    from flax import nnx

    from bench.harness import device_line
    from mamba_jax import Mamba2Config, Mamba2LM
    from mamba_jax.generate import load_for_generation
    from mamba_jax.serve import Limits, make_app
    from mamba_jax.tokenizer import byte_tokenizer

    if args.checkpoint:
        model, tokenizer, _ = load_for_generation(args.checkpoint, dtype=args.dtype)
    else:
        model = Mamba2LM(Mamba2Config.preset(args.preset), rngs=nnx.Rngs(0),
                         dtype=jnp.dtype(args.dtype))
        tokenizer = byte_tokenizer()
    result({"device": device_line()})
    # eos off (None): every request generates exactly its max_tokens
    app = make_app(model, tokenizer, Limits(max_prompt_tokens=max(args.prompt_tokens, 2048)),
                   None, args.checkpoint or args.preset, decode_options(args))
    web.run_app(app, host=HOST, port=args.port, print=None, access_log=None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mamba2-1.3b",
                        help="random weights of this preset, byte tokenizer")
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint dir (as mamba_jax.serve's) instead of --preset")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--concurrency", default="1,16,64",
                        help="concurrent clients of each timed run")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="a timed run sends no new request after this")
    parser.add_argument("--max-requests", type=int, default=2000,
                        help="nor once this many are answered")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds the server may take to answer /health")
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    add_decode_arguments(parser)
    args = parser.parse_args(argv)
    if args.serve_child:
        serve_child(args)
        return

    levels = [int(c) for c in args.concurrency.split(",")]
    if max(levels) > 64:
        raise SystemExit(f"--concurrency {args.concurrency}: at most 64 clients, the server's "
                         "largest batch")
    port = free_port()
    forwarded = ["--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens),
                 "--ssm-state-dtype", args.ssm_state_dtype,
                 "--step-implementation", args.step_implementation,
                 *(["--checkpoint", args.checkpoint] if args.checkpoint
                   else ["--preset", args.preset])]
    server, reported = start_server(forwarded, port, args.start_timeout)
    try:
        texts = prompts(64, args.prompt_tokens)
        # What the server compiles: a batch of each power-of-two bucket up to max(levels)
        began, warm = time.perf_counter(), http.client.HTTPConnection(HOST, port)
        for rows in (1 << i for i in range((max(levels) - 1).bit_length() + 1)):
            status = request(warm, texts[:rows], args.new_tokens)
            if status != 200:
                raise SystemExit(f"warm-up request of {rows} prompts: HTTP {status}")
        warm.close()
        print(f"{reported['device']}; {args.checkpoint or args.preset + ' (random weights)'}, "
              f"{args.dtype}, {args.ssm_state_dtype} SSM states, step "
              f"{args.step_implementation}; prompts of {args.prompt_tokens} tokens, "
              f"{args.new_tokens} new, greedy; the server's batching (up to 64 rows, 5 ms "
              f"window); warm-up {time.perf_counter() - began:.0f} s")
        print(table_header(("clients", "requests", "seconds", "requests/s", "new tokens/s",
                            "p50 ms", "p99 ms", "failed")))
        for clients in levels:
            latencies, failed, wall = load(port, clients, texts, args.new_tokens, args.seconds,
                                           args.max_requests)
            answered = len(latencies)
            print(table_row((clients, answered, f"{wall:.2f}", f"{answered / wall:.2f}",
                             f"{answered * args.new_tokens / wall:.0f}",
                             f"{1e3 * percentile(latencies, 0.5):.1f}" if latencies else "-",
                             f"{1e3 * percentile(latencies, 0.99):.1f}" if latencies else "-",
                             failed)), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
