"""The server under load: requests/s, time to first token and latency at 1, 16, 64 and 256
concurrent clients, the engine of a commit before ("before") against this one's ("after"),
and prompts that share a system prompt, with and without the prefix cache.

    git archive REV | (mkdir -p .before && tar -x -C .before)     # the code before, once
    python3 -m bench.serve_load [--preset mamba2-1.3b | --checkpoint DIR] [--dtype bfloat16]
                                [--before .before] [--concurrency 1,16,64,256] [--seconds 10]
                                [--max-requests 2000] [--prompt-tokens 128]
                                [--new-tokens 128] [--shared-prefix-tokens 512]
                                [--shared-concurrency 64] [--runs levels,shared]
                                [--compilation-cache DIR] [--no-stream] [--slots 64 ...]
                                [--ssm-state-dtype float32] [--step-implementation auto]

Each engine runs in a server child of its own on loopback (mamba_jax.serve's application,
as `python -m mamba_jax.serve` runs it), with a preset's random weights and the byte
tokenizer, or a checkpoint and its tokenizer; end of sequence is off, so every request
generates exactly --new-tokens. "before" is the code in --before (an extracted copy of an
earlier commit, e.g. main before a change; git-ignored): its child runs `python -m
bench.serve_load --serve-child` from that folder, with that code first on PYTHONPATH, and
takes the flags that code took. "after" is this checkout, with the engine's flags given
here (--slots, --steps-per-dispatch, --prefill-chunk, --prefill-rows, --prefix-cache-mb).

Before timing a server, one request of n prompts for each n = 1, 2, 4, ... up to the most
clients (at most 64) compiles the batches they form, and each level runs --warmup-seconds
untimed first. Then, for each concurrency c: c client threads (the standard library's
http.client, one keep-alive connection each) send greedy POST /v1/completions requests of
one prompt, streamed (unless --no-stream), each next one as soon as its answer is whole,
until --seconds have passed or --max-requests are answered (what is in flight then
finishes). Prompts: --prompt-tokens bytes of the bundled corpus at spread offsets (with the
byte tokenizer, exactly that many tokens). The shared-prefix run prepends the same
--shared-prefix-tokens bytes of the corpus to each, at --shared-concurrency clients, on
"after" with its prefix cache (the same server, after its levels) and without
(--prefix-cache-mb 0, a server of its own). --runs picks the levels, the shared-prefix run
or both. The servers keep their compiled programs in --compilation-cache (default: a
temporary folder of this call), so that a second server of the same code compiles little,
and a later call with the same folder neither.

Prints, after a line with the date, the device and jax's version (the server's) and the
settings, a table with one row per engine and concurrency: requests answered, seconds,
requests/s, new tokens/s, p50 and p99 of the time to first token (a request's send to its
first streamed text: a character that a token completes) and of the latency (to its whole
answer), and failed requests (not 200); then the ratios after/before per concurrency; then
the shared-prefix rows with the prefix cache's hits and lookups over the timed run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from bench.harness import ROOT, child_environment, result, table_header, table_row
from mamba_jax.engine import add_engine_arguments, engine_options
from mamba_jax.generate import add_decode_arguments, decode_options

HOST = "127.0.0.1"
COLUMNS = ("engine", "clients", "requests", "seconds", "requests/s", "new tokens/s",
           "TTFT p50 ms", "TTFT p99 ms", "p50 ms", "p99 ms", "failed")


def prompts(count: int, tokens: int, prefix: int = 0) -> list[str]:
    """count prompts of at most `tokens` bytes of the bundled corpus (UTF-8 cut to whole
    characters), at offsets spread over it after its first `prefix` bytes, each after those
    `prefix` bytes (the same for all)."""
    from mamba_jax.data import DEFAULT_CORPUS

    text = DEFAULT_CORPUS.read_bytes()
    shared = text[:prefix].decode("utf-8", "ignore")
    stride = (len(text) - prefix - tokens) // count
    return [shared + text[prefix + i * stride:prefix + i * stride + tokens].decode(
        "utf-8", "ignore") for i in range(count)]


def request(connection: http.client.HTTPConnection, prompt, new_tokens: int,
            stream: bool) -> tuple[int, float | None]:
    """One greedy completion of prompt (a string, or a list of them: one row each) on
    connection -> (its HTTP status once the whole answer is read, seconds to its first
    streamed text or None)."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
                       "stream": stream})
    begin = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    first = None
    if stream and response.status == 200:
        while line := response.readline():
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - begin
    response.read()
    return response.status, first


def load(port: int, clients: int, texts: list[str], new_tokens: int, seconds: float,
         max_requests: int, stream: bool) -> tuple[list[float], list[float], int, float]:
    """`clients` threads sending requests back to back until `seconds` have passed or
    max_requests are answered -> (latencies and times to first token in s of the answered
    requests, how many failed, wall seconds from the first send to the last answer)."""
    latencies, firsts, failed, lock = [], [], [0], threading.Lock()
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
                status, first = request(connection, texts[(index + sent * clients) % len(texts)],
                                        new_tokens, stream)
                with lock:
                    if status == 200:
                        latencies.append(time.perf_counter() - begin)
                        if first is not None:
                            firsts.append(first)
                    else:
                        failed[0] += 1
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, firsts, failed[0], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (q in (0, 1]) of values."""
    ranked = sorted(values)
    return ranked[max(math.ceil(q * len(ranked)) - 1, 0)]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def start_server(argv: list[str], port: int, timeout: float, code: str,
                 cache: str) -> tuple[subprocess.Popen, dict]:
    """The --serve-child of the bench module in `code` (a checkout) with argv on port, its
    compiled programs kept in the folder `cache`: (the process, what it reported once its
    model was built: its device line), after /health answers; exits if it does not within
    timeout seconds."""
    env = child_environment()
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    if code != ROOT:  # that checkout's code first
        env["PYTHONPATH"] = os.pathsep.join([code, env["PYTHONPATH"]])
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.serve_load", "--serve-child", "--port", str(port), *argv],
        cwd=code, env=env, stdout=subprocess.PIPE, text=True)
    line = " "
    while line and not line.startswith("RESULT "):  # its result() line, or '' at its exit
        line = child.stdout.readline()
    if not line:
        child.kill()
        raise SystemExit(f"the server in {code} did not start (exit {child.wait()}); its "
                         "stderr is above")
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


def stop_server(server: subprocess.Popen):
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def engine_stats(port: int) -> dict | None:
    """The after child's Engine.stats() (its /bench/stats route), or None (a before child)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    connection.request("GET", "/bench/stats")
    response = connection.getresponse()
    body = response.read()
    return json.loads(body) if response.status == 200 else None


def serve_child(args):
    """The server process: the model, then mamba_jax.serve's application until terminated;
    a route /bench/stats answers the engine's statistics."""
    import jax.numpy as jnp
    from aiohttp import web
    from flax import nnx

    from bench.harness import device_line
    from mamba_jax import Mamba2Config, Mamba2LM
    from mamba_jax.engine import Limits
    from mamba_jax.generate import load_for_generation
    from mamba_jax.serve import ENGINE, make_app
    from mamba_jax.tokenizer import byte_tokenizer

    if args.checkpoint:
        model, tokenizer, _ = load_for_generation(args.checkpoint, dtype=args.dtype)
    else:
        model = Mamba2LM(Mamba2Config.preset(args.preset), rngs=nnx.Rngs(0),
                         dtype=jnp.dtype(args.dtype))
        tokenizer = byte_tokenizer()
    # eos off (None): every request generates exactly its max_tokens
    app = make_app(model, tokenizer, Limits(max_prompt_tokens=max(args.prompt_tokens, 2048)),
                   None, args.checkpoint or args.preset, decode_options(args),
                   engine_options(args))
    memory = app[ENGINE].memory()
    result({"device": device_line(), "slot_mb": memory["slot"] / 2**20})

    async def stats(request):
        found = app[ENGINE].stats()
        return web.json_response({k: v for k, v in found.items() if not k.endswith("seconds")})

    app.router.add_get("/bench/stats", stats)
    web.run_app(app, host=HOST, port=args.port, print=None, access_log=None)


def measure(name: str, argv: list[str], code: str, args, runs: list, started) -> list:
    """Start a server of `code` with argv (started(its report) once it answers), then for
    each (levels, prompts) of runs warm it and time each level -> per run its table rows
    (engine, clients, ..., failed, and the prefix cache's (hits, lookups) over the level,
    or None for a before child)."""
    port = free_port()
    most = args.shared_prefix_tokens + args.prompt_tokens
    server, reported = start_server([*argv, "--prompt-tokens", str(most)], port,
                                    args.start_timeout, code, args.compilation_cache)
    started(reported)
    stream = not args.no_stream
    tables = []
    try:
        for levels, texts in runs:
            warm, rows = http.client.HTTPConnection(HOST, port), []
            for n in (1 << i for i in range((min(max(levels), 64) - 1).bit_length() + 1)):
                status, _ = request(warm, texts[:n], args.new_tokens, stream)
                if status != 200:
                    raise SystemExit(f"{name}: the warm-up request of {n} prompts: HTTP "
                                     f"{status}")
            warm.close()
            for clients in levels:
                load(port, clients, texts, args.new_tokens, args.warmup_seconds,
                     args.max_requests, stream)
                before = engine_stats(port) if code == ROOT else None
                latencies, firsts, failed, wall = load(port, clients, texts, args.new_tokens,
                                                       args.seconds, args.max_requests,
                                                       stream)
                after = engine_stats(port) if code == ROOT else None
                hits = None if after is None else (
                    after["prefix_cache_hits"] - before["prefix_cache_hits"],
                    after["prefix_cache_lookups"] - before["prefix_cache_lookups"])
                ms = lambda values, q: f"{1e3 * percentile(values, q):.1f}" if values else "-"
                rows.append((name, clients, len(latencies), f"{wall:.2f}",
                             f"{len(latencies) / wall:.2f}",
                             f"{len(latencies) * args.new_tokens / wall:.0f}",
                             ms(firsts, 0.5), ms(firsts, 0.99), ms(latencies, 0.5),
                             ms(latencies, 0.99), failed, hits))
            tables.append(rows)
    finally:
        stop_server(server)
    return tables


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="mamba2-1.3b",
                        help="random weights of this preset, byte tokenizer")
    parser.add_argument("--checkpoint", default=None,
                        help="a checkpoint dir (as mamba_jax.serve's) instead of --preset")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--before", default=None,
                        help="a folder holding the code to compare with (git archive REV | "
                             "tar -x -C DIR); none: this checkout alone")
    parser.add_argument("--concurrency", default="1,16,64,256",
                        help="concurrent clients of each timed run")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="a timed run sends no new request after this")
    parser.add_argument("--warmup-seconds", type=float, default=3.0,
                        help="an untimed run of each level before its timed one")
    parser.add_argument("--max-requests", type=int, default=2000,
                        help="nor once this many are answered")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--shared-prefix-tokens", type=int, default=512,
                        help="the shared system prompt of the prefix-cache run; 0: no such "
                             "run")
    parser.add_argument("--shared-concurrency", type=int, default=64,
                        help="clients of the shared-prefix run")
    parser.add_argument("--no-stream", action="store_true",
                        help="whole answers only (no time to first token)")
    parser.add_argument("--runs", default="levels,shared",
                        help="levels: each engine at --concurrency; shared: the shared-prefix "
                             "run, with and without the prefix cache")
    parser.add_argument("--compilation-cache", default=None,
                        help="the servers' persistent compilation cache (a folder kept "
                             "between calls; default: a temporary one for this call, which "
                             "the second server of this code reads)")
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds a server may take to answer /health")
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    add_engine_arguments(parser)
    add_decode_arguments(parser)
    args = parser.parse_args(argv)
    if args.serve_child:
        serve_child(args)
        return

    if args.compilation_cache is not None:
        compare(args)
        return
    with tempfile.TemporaryDirectory(prefix="serve_load_cache_") as cache:
        compare(argparse.Namespace(**{**vars(args), "compilation_cache": cache}))


def compare(args):
    """The servers of main's runs, and their tables."""
    levels = [int(c) for c in args.concurrency.split(",")]
    common = ["--dtype", args.dtype, "--ssm-state-dtype", args.ssm_state_dtype,
              "--step-implementation", args.step_implementation,
              *(["--checkpoint", args.checkpoint] if args.checkpoint
                else ["--preset", args.preset])]
    mine = [*common, *(f"--{k.replace('_', '-')}={v}" for k, v in engine_options(args).items()
                       if v is not None)]
    no_cache = [*mine, "--prefix-cache-mb=0"]
    before = None if args.before is None else os.path.abspath(args.before)
    texts = prompts(64, args.prompt_tokens)
    settings = (f"{args.checkpoint or args.preset + ' (random weights)'}, {args.dtype}, "
                f"{args.ssm_state_dtype} SSM states, step {args.step_implementation}; prompts "
                f"of {args.prompt_tokens} tokens, {args.new_tokens} new, greedy, "
                f"{'whole answers' if args.no_stream else 'streamed'}; after: {args.slots} "
                f"slots, {args.steps_per_dispatch} steps a dispatch")

    shown = []

    def started(reported):
        if not shown:  # the device line, from the first server that starts
            shown.append(reported)
            print(f"{reported['device']}; {settings}")
            print(table_header(COLUMNS), flush=True)

    parts = set(args.runs.split(","))
    if not parts <= {"levels", "shared"}:
        raise SystemExit(f"--runs {args.runs}: give levels, shared or both")
    timed = [(levels, texts)] if "levels" in parts else []
    shared = []
    if "shared" in parts and args.shared_prefix_tokens:
        shared = [([args.shared_concurrency],
                   prompts(64, args.prompt_tokens, args.shared_prefix_tokens))]
    servers = ([("before", common, before, timed)] if before and timed else []) + (
        [("after", mine, ROOT, timed + shared)] if timed + shared else []) + (
        [("after, no prefix cache", no_cache, ROOT, shared)] if shared else [])
    tables = {name: measure(name, argv_, code, args, runs, started)
              for name, argv_, code, runs in servers}
    for name in ("before", "after"):
        for row in tables.get(name, [[]])[0] if timed else []:
            print(table_row(row[:-1]), flush=True)
    if before and timed:
        print(table_header(("clients", "requests/s after/before", "TTFT p99 after/before",
                            "p99 latency after/before")))
        for b, a in zip(tables["before"][0], tables["after"][0]):
            ratio = lambda i: (f"{float(a[i]) / float(b[i]):.2f}x" if "-" not in (a[i], b[i])
                               and float(b[i]) else "-")
            print(table_row((a[1], ratio(4), ratio(7), ratio(9))), flush=True)
    if shared:
        print(f"shared prefix: {args.shared_prefix_tokens} tokens the same in every prompt, "
              f"then {args.prompt_tokens} of its own")
        print(table_header((*COLUMNS, "prefix cache hits/lookups")))
        for (row,), label in ((tables["after"][-1], "after, prefix cache"),
                              (tables["after, no prefix cache"][0], "after, no prefix cache")):
            print(table_row((label, *row[1:-1], f"{row[-1][0]}/{row[-1][1]}")), flush=True)


if __name__ == "__main__":
    main()
