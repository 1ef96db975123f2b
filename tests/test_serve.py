"""The generation server, started for real on 127.0.0.1 and driven by aiohttp's client."""

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import aiohttp
import jax.numpy as jnp
import numpy as np
import pytest
from aiohttp import web
from flax import nnx

from bench.harness import ROOT
import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.tokenizer import byte_tokenizer
from mamba_jax.generate import token_logprobs
from mamba_jax import engine as slot_engine
from mamba_jax.engine import Limits
from mamba_jax.openai_api import TOP_LOGPROBS
from mamba_jax.serve import make_app

LIMITS = Limits(max_prompt_tokens=32, max_new_tokens=16)
# Fewer slots than the 32 concurrent clients below: some wait for a slot
ENGINE = dict(slots=8, steps_per_dispatch=2, prefill_chunk=16, prefill_rows=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = Mamba2LM(Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16,
                                         chunk_size=16), rngs=nnx.Rngs(0))
    mamba_jax.save_pretrained(model, path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return mamba_jax.from_pretrained(checkpoint)


@contextlib.contextmanager
def serving(app):
    """app on a free loopback port, its event loop on a thread of its own -> its URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def url(model):
    """The server on a free loopback port."""
    with serving(make_app(model, byte_tokenizer(), LIMITS, engine_options=ENGINE)) as address:
        yield address


def expected_tokens(model, prompt: str, n: int) -> list[int]:
    """The prompt's bytes and their greedy continuation of n tokens."""
    return np.asarray(mamba_jax.generate(model, np.asarray([list(prompt.encode())]), n))[0] \
        .tolist()


def expected(model, prompts, n):
    """Greedy continuations of prompts (text), from one left-padded generate call."""
    ids = [list(p.encode()) for p in prompts]
    l = max(map(len, ids))
    padded = np.asarray([[0] * (l - len(i)) + i for i in ids])
    out = mamba_jax.generate(model, padded, n, prompt_lengths=[len(i) for i in ids])
    return [byte_tokenizer().decode(row[l:].tolist()) for row in np.asarray(out)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def complete(session, url, **body):
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def streamed(session, url, **body):
    """The completion chunks a streamed request's events carry (not its [DONE])."""
    chunks = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_greedy_completion_and_megatron_api_equal_generate(url, model):
    async def go():
        async with aiohttp.ClientSession() as s:
            status, body = await complete(s, url, prompt="Hello", max_tokens=8,
                                          temperature=0)
            async with s.put(url + "/api", json={"prompts": ["Hello"], "tokens_to_generate": 8,
                                                 "temperature": 0}) as r:
                megatron = r.status, await r.json()
            # Greedy with a decaying top_p, which greedy rows do not read
            async with s.put(url + "/api", json={"prompts": ["Hello"], "tokens_to_generate": 8,
                                                 "temperature": 0, "top_p": 0.9,
                                                 "top_p_decay": 0.5}) as r:
                decayed = r.status, await r.json()
            async with s.get(url + "/health") as r:
                health = r.status, await r.json()
        return status, body, megatron, health, decayed

    status, body, megatron, health, decayed = run(go())
    assert decayed == megatron
    want = expected(model, ["Hello"], 8)[0]
    assert status == 200 and body["choices"][0]["text"] == want
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert megatron[0] == 200 and megatron[1]["text"] == ["Hello" + want]
    assert megatron[1]["tokens"][0][:5] == list(b"Hello") and len(megatron[1]["tokens"][0]) == 13
    assert health[0] == 200 and health[1]["status"] == "ok"


def test_the_model_list_names_the_model_the_completions_name(url):
    """GET /v1/models, as OpenAI's clients call it before completing: the one model, with
    the id the completions answer with."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models") as r:
                listed = r.status, await r.json()
            _, body = await complete(s, url, prompt="Hi", max_tokens=1, temperature=0)
        return listed, body

    (status, listed), body = run(go())
    assert status == 200 and listed["object"] == "list"
    [entry] = listed["data"]
    assert entry["id"] == body["model"] and entry["object"] == "model"
    assert entry["owned_by"] == "mamba-jax" and abs(entry["created"] - time.time()) < 3600


def test_openai_fields_sent_as_null_take_their_defaults_and_a_null_prompt_is_a_400(url, model):
    """OpenAI's API reads its optional fields' null as unset (its clients may send them so);
    Megatron's PUT /api, like Megatron-LM's server, keeps refusing a null setting."""
    async def go():
        async with aiohttp.ClientSession() as s:
            nulls = await complete(s, url, prompt="Hello", max_tokens=None, temperature=0,
                                   top_p=None, n=None, stop=None, logprobs=None, stream=None,
                                   model=None)
            no_prompt = await complete(s, url, prompt=None, max_tokens=4)
            async with s.put(url + "/api", json={"prompts": ["Hello"],
                                                 "temperature": None}) as r:
                megatron = r.status, await r.json()
        return nulls, no_prompt, megatron

    (status, body), (bad, error), (put_status, put_error) = run(go())
    assert status == 200, body
    assert body["choices"] == [{"index": 0, "text": expected(model, ["Hello"], 16)[0],
                                "finish_reason": "length", "logprobs": None}]
    assert bad == 400 and error["error"]["param"] == "prompt"
    assert put_status == 400 and put_error["error"]["param"] == "temperature"


def test_32_concurrent_clients_share_the_slots_and_are_all_answered_correctly(url, model,
                                                                             monkeypatch):
    prompts = [f"p{i} " + "ab" * (i % 7) for i in range(32)]
    busy, dispatch = [], slot_engine.Engine._dispatch

    def counted(engine):  # the sequences each decode program runs
        busy.append(sum(r is not None for r in engine._slot))
        return dispatch(engine)

    monkeypatch.setattr(slot_engine.Engine, "_dispatch", counted)

    async def go():
        async with aiohttp.ClientSession() as s:
            answers = await asyncio.gather(*(complete(s, url, prompt=p, max_tokens=6,
                                                      temperature=0) for p in prompts))
            async with s.get(url + "/health") as r:
                return answers, await r.json()

    answers, health = run(go())
    assert [status for status, _ in answers] == [200] * 32
    assert [body["choices"][0]["text"] for _, body in answers] == expected(model, prompts, 6)
    assert (health["queued"], health["slots_busy"]) == (0, 0)
    assert max(busy) > 1  # requests shared the decode programs


def test_streamed_tokens_join_to_the_greedy_text(url, model):
    async def go():
        chunks = []
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={
                    "prompt": "Stream", "max_tokens": 10, "temperature": 0,
                    "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    if line.strip():
                        chunks.append(line.decode().removeprefix("data: ").strip())
        return chunks

    chunks = run(go())
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c)["choices"][0] for c in chunks[:-1]]
    assert "".join(e["text"] for e in events) == expected(model, ["Stream"], 10)[0]
    assert events[-1]["finish_reason"] == "length"


class _Tokens:
    """A finished sequence's tokens as the engine's Sequence gives them."""

    def __init__(self, tokens):
        self.tokens, self.finish_reason = tokens, None

    async def __aiter__(self):
        for token in self.tokens:
            yield slot_engine.TokenEvent(token, None, None)
        self.finish_reason = "length"

    def cancel(self, finish_reason="cancelled"):
        self.finish_reason = finish_reason


def test_a_stream_decodes_each_token_once_whole_characters_and_exact_stops():
    """A streamed continuation decodes only its new tokens (a few tokens of context each:
    linear, where decoding the whole text at each token was quadratic), never sends part of
    a multi-byte character, and cuts at a stop string that spans tokens and characters; the
    text kept and its tokens are those before the stop."""
    from mamba_jax.http_api import Choice, Texts

    decoded = []

    class Counting:  # the byte tokenizer, counting the ids it decodes
        def decode(self, ids):
            decoded.append(len(ids))
            return bytes(ids).decode(errors="replace")

    text = "Ünïcödé wörds, " * 8 + "then the stop: ß→€ and after"
    prompt, tokens = list(b"prompt: "), list(text.encode())

    async def go(stops):
        choice = Choice(Texts(Counting(), 256, None), _Tokens(tokens), prompt, stops)
        return [piece async for piece in choice.deltas()], choice

    pieces, choice = run(go(["ß→€", "→€ and"]))
    want = text[:text.index("ß→€")]
    assert "".join(pieces) == choice.text == want and "\ufffd" not in "".join(pieces)
    assert choice.finish_reason == "stop" and choice.seq.finish_reason == "stop"
    assert choice.new == list(want.encode())
    assert sum(decoded) < 16 * len(choice.new)  # each token's decode: its few bytes
    decoded.clear()
    pieces, choice = run(go([]))
    assert pieces == list(text)  # no stop strings to hold back for: a piece a character
    assert choice.finish_reason == "length" and choice.new == tokens
    assert sum(decoded) < 16 * len(tokens)


def test_a_stream_gives_out_bytes_that_begin_no_character_as_they_come():
    """Bytes that are no UTF-8 (a model of random weights writes them) go out as U+FFFD
    within the tokens a character can take, not all at the end (the time to the first
    token was the whole request's); a character split over tokens after them stays whole."""
    from mamba_jax.http_api import TextStream, Texts

    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    tokens = [0xff, 0xfe, 0x80, 0xff, 0xfe, 0xff] + list("€ ok".encode())
    stream = TextStream(Texts(Bytes(), 256, None), list(b"p: "))
    pieces = [stream.add(t) for t in tokens]
    assert "".join(pieces) + stream.rest() == bytes(tokens).decode(errors="replace")
    assert [i for i, p in enumerate(pieces) if p][0] == 3  # the fourth token, not the last
    assert "€" in "".join(pieces)


def test_a_client_that_disconnects_mid_stream_does_not_stall_the_others(url, model):
    async def leaver(s):
        async with s.post(url + "/v1/completions", json={
                "prompt": "Leaving", "max_tokens": 16, "temperature": 0, "stream": True}) as r:
            await r.content.readline()  # the first event, then hang up
        return "left"

    async def go():
        async with aiohttp.ClientSession() as leave_session, aiohttp.ClientSession() as s:
            start = time.perf_counter()
            results = await asyncio.gather(
                leaver(leave_session),
                *(complete(s, url, prompt=p, max_tokens=12, temperature=0)
                  for p in ("stay one", "stay two")))
            await leave_session.close()
            after = await complete(s, url, prompt="stay one", max_tokens=12, temperature=0)
        return results, after, time.perf_counter() - start

    results, after, seconds = run(go())
    want = expected(model, ["stay one", "stay two"], 12)
    assert results[0] == "left"
    assert [body["choices"][0]["text"] for _, body in results[1:]] == want
    assert after == (200, results[1][1] | {"id": after[1]["id"],
                                           "created": after[1]["created"]})
    assert seconds < 30


@pytest.mark.parametrize("method,path,body,field", [
    ("post", "/v1/completions", b"{not json", "body"),
    ("post", "/v1/completions", b"[1, 2]", "body"),
    ("post", "/v1/completions", json.dumps({"prompt": "x" * 33}).encode(), "prompt"),
    ("post", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 17}).encode(),
     "max_tokens"),
    ("post", "/v1/completions", json.dumps({"prompt": "hi", "best_of": 2}).encode(),
     "best_of"),
    ("post", "/v1/completions", json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
     "temperature"),
    ("post", "/v1/completions", json.dumps({"prompt": "hi", "stream": 1}).encode(), "stream"),
    ("put", "/api", json.dumps({"prompts": ["ok", "y" * 40], "tokens_to_generate": 4}
                               ).encode(), "prompts[1]"),
    ("put", "/api", json.dumps({"tokens_to_generate": 4}).encode(), "prompts"),
    ("put", "/api", json.dumps({"prompts": ["hi"], "top_k": -1}).encode(), "top_k"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(
        url, method, path, body, field):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.request(method, url + path, data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                bad = r.status, await r.json()
            async with s.get(url + "/health") as r:
                return bad, r.status

    (status, error), health = run(go())
    assert status == 400 and error["error"]["param"] == field
    assert field.split("[")[0] in error["error"]["message"]
    assert health == 200


def test_bounded_load_reports_requests_per_second_and_latency(url):
    count, concurrency, limit_s = 48, 8, 45.0
    latencies = []

    async def client(s, queue):
        while not queue.empty():
            i = queue.get_nowait()
            start = time.perf_counter()
            status, body = await complete(s, url, prompt=f"load {i}", max_tokens=8,
                                          temperature=0.8, top_p=0.9)
            assert status == 200 and body["choices"][0]["finish_reason"] == "length"
            latencies.append(time.perf_counter() - start)

    async def go():
        queue = asyncio.Queue()
        for i in range(count):
            queue.put_nowait(i)
        async with aiohttp.ClientSession() as s:
            start = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(client(s, queue)
                                                    for _ in range(concurrency))), limit_s)
            return time.perf_counter() - start

    seconds = asyncio.run(go())
    latencies.sort()
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (count - 1))]
    print(f"load: {count} requests, {concurrency} clients: {count / seconds:.1f} requests/s, "
          f"p50 {1e3 * p50:.0f} ms, p99 {1e3 * p99:.0f} ms")
    assert len(latencies) == count and p50 <= p99 < limit_s


def test_generate_cli_streams_from_the_server(url, model, capsys):
    from mamba_jax.generate.__main__ import main

    main(["--server", url, "--prompt", "Hi", "--max-new-tokens", "7", "--temperature", "0"])
    assert capsys.readouterr().out == "Hi" + expected(model, ["Hi"], 7)[0] + "\n"


@pytest.mark.parametrize("ending", ["dropped", "closed"])
def test_generate_cli_says_when_the_stream_stops_before_its_end(ending, capsys):
    # A server that sends one token's event, then drops the connection mid-response or
    # ends the response without the stream's closing [DONE]: the text that came is kept
    # on stdout and one line says that it may be cut short.
    from mamba_jax.generate.__main__ import main

    async def one_token_then_stop(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": " partial"}]}\n\n')
        if ending == "dropped":
            request.transport.close()
        else:
            await response.write_eof()
        return response
    app = web.Application()
    app.router.add_post("/v1/completions", one_token_then_stop)
    with serving(app) as url, pytest.raises(SystemExit) as stopped:
        main(["--server", url, "--prompt", "Hi"])
    captured = capsys.readouterr()
    assert stopped.value.code == 2 and captured.out == "Hi partial\n"
    assert captured.err.startswith(f"python -m mamba_jax.generate: --server {url}: the stream "
                                   "stopped before its end")
    assert captured.err.endswith("the text above is what arrived\n")
    assert captured.err.count("\n") == 1


def test_the_engine_decodes_with_the_servers_decode_options(model):
    """`serve --ssm-state-dtype/--step-implementation` reach the engine's decode steps."""
    import mamba_jax.serve as serve

    options = dict(ssm_state_dtype="bfloat16", step_implementation="triton")
    engine = serve.Engine(model, byte_tokenizer(), LIMITS, generate_options=options, slots=1)
    seq = engine.submit(list(b"Hello"), slot_engine.SamplingParams(6))
    while engine.step():
        pass
    ssm = [c.ssm_state for c in engine._slots.cache]
    assert engine._plan == ("fused",) * len(ssm)  # the kernels, at batch 1
    assert all(s.dtype == jnp.bfloat16 for s in ssm)
    want = mamba_jax.generate(model, np.asarray([list(b"Hello")]), 6, **options)
    assert (seq.tokens, seq.finish_reason) == (np.asarray(want)[0, 5:].tolist(), "length")


def test_a_top_p_that_is_zero_in_float32_is_a_400_and_the_request_beside_it_is_answered(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(
                complete(s, url, prompt="bad", max_tokens=4, temperature=1.0, top_p=1e-300),
                complete(s, url, prompt="good", max_tokens=4, temperature=0))

    (bad_status, bad), (good_status, good) = run(go())
    assert bad_status == 400 and bad["error"]["param"] == "top_p"
    assert good_status == 200 and good["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,content_type,field", [
    ("/v1/completions", b'{"prompt": "hi"}', "application/json; charset=bogus",
     "Content-Type"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "application/json", "body"),
    ("/v1/completions", b'{"prompt": "\xff"}', "application/json", "body"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
     "application/json", "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
     "application/json", "body"),  # over Python's 4300-digit limit for integers
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "application/json",
     "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e39}', "application/json",
     "temperature"),  # inf in float32
    ("/api", b'{"prompts": ["hi"], "top_p": Infinity}', "application/json", "top_p"),
    # half a UTF-16 pair, which JSON's escapes spell and no tokenizer takes (it was a 500)
    ("/v1/completions", b'{"prompt": "\\ud800"}', "application/json", "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udc00b"]}', "application/json", "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud83d"]}', "application/json", "stop"),
    ("/api", b'{"prompts": ["\\ud800"], "tokens_to_generate": 4}', "application/json",
     "prompts"),
])
def test_bodies_that_are_not_plain_json_or_finite_numbers_are_400s(url, path, body,
                                                                   content_type, field):
    async def go():
        async with aiohttp.ClientSession() as s:
            method = s.put if path == "/api" else s.post
            async with method(url + path, data=body,
                              headers={"Content-Type": content_type}) as r:
                return r.status, await r.json()

    status, error = run(go())
    assert (status, error["error"]["param"]) == (400, field)


def test_a_body_over_the_servers_limit_is_a_413_in_json(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            body = json.dumps({"prompt": "a" * (1 << 20)}).encode()
            async with s.post(url + "/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()  # aiohttp's own answer was plain text

    status, error = run(go())
    assert status == 413 and error["error"]["param"] == "body"
    assert error["error"]["message"].startswith("the request body is over 1048576 bytes")


def test_a_whole_surrogate_pair_is_text(url, model):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", data=b'{"prompt": "\\ud83d\\ude00", '
                              b'"max_tokens": 3, "temperature": 0}',
                              headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 200
    assert body["choices"][0]["text"] == expected(model, ["\U0001F600"], 3)[0]


def test_a_negative_temperature_is_a_400_on_both_endpoints(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            completion = await complete(s, url, prompt="hi", temperature=-0.5)
            async with s.put(url + "/api", json={"prompts": ["hi"],
                                                 "temperature": -0.5}) as r:
                return completion, (r.status, await r.json())

    for status, error in run(go()):
        assert status == 400 and error["error"]["param"] == "temperature"
        assert "temperature=-0.5 must be a" in error["error"]["message"]


class _Held:
    """Holds the engine's thread once a sequence is decoding, until `release` is set (a long
    decode); `admitted` records each prompt that the engine took in."""

    def __init__(self, monkeypatch):
        self.release, self.admitted = threading.Event(), []
        step, admit = slot_engine.Engine.step, slot_engine.Engine._start_from_prefix

        def held_step(engine):
            if any(r is not None for r in engine._slot):
                self.release.wait(30)
            return step(engine)

        def spy(engine, request):
            self.admitted.append(bytes(request.ids))
            return admit(engine, request)

        monkeypatch.setattr(slot_engine.Engine, "step", held_step)
        monkeypatch.setattr(slot_engine.Engine, "_start_from_prefix", spy)


async def _until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _server(model, limits=LIMITS):
    """A server run as web.run_app runs it: (its runner, its URL, its engine)."""
    import mamba_jax.serve as serve

    app = make_app(model, byte_tokenizer(), limits, engine_options=ENGINE)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", app[serve.ENGINE]


@contextlib.asynccontextmanager
async def _first_request_decoding(model, limits, monkeypatch):
    """A server whose engine holds (see _Held) once a first request ("first", 3 new tokens)
    decodes, and a client session: yields (session, URL, engine, held, the first request's
    task); the engine is released on the way out."""
    held = _Held(monkeypatch)
    runner, url, engine = await _server(model, limits)
    try:
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(complete(s, url, prompt="first", max_tokens=3,
                                                 temperature=0))
            await _until(lambda: held.admitted)  # the first request is decoding
            yield s, url, engine, held, first
    finally:
        held.release.set()
        await runner.cleanup()


def test_a_client_that_disconnects_cancels_its_queued_prompts(model, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="mamba_jax.serve")

    async def go():
        async with _first_request_decoding(model, LIMITS, monkeypatch) as (s, url, engine,
                                                                          held, first):
            async with aiohttp.ClientSession() as leaver:
                leaving = asyncio.create_task(complete(
                    leaver, url, prompt=["left behind"] * 10, max_tokens=5, temperature=0))
                await _until(lambda: engine.stats()["queued"] == 10)
                leaving.cancel()  # the client hangs up while its prompts wait
            await _until(lambda: "client" in caplog.text)
            held.release.set()
            assert (await first)[0] == 200
            after = await complete(s, url, prompt="after", max_tokens=4, temperature=0)
            return after, held.admitted, engine.stats()

    (status, _), admitted, stats = run(go())
    assert status == 200
    assert admitted == [b"first", b"after"]  # the 10 prompts of the client that left never ran
    assert stats["queued_tokens"] == 0 and stats["requests_finished"]["cancelled"] == 10
    dropped = [r.getMessage() for r in caplog.records if r.name == "mamba_jax.serve"]
    assert len(dropped) == 1 and "10 sequence(s) cancelled" in dropped[0]
    assert not any(r.exc_info for r in caplog.records)


def test_too_many_prompts_is_a_400_and_a_full_queue_a_503(model, monkeypatch):
    limits = dataclasses.replace(LIMITS, max_prompts=4, max_queued_tokens=40)

    async def go():
        async with _first_request_decoding(model, limits, monkeypatch) as (s, url, engine,
                                                                          held, first):
            many = await complete(s, url, prompt=["a"] * 5, max_tokens=2)
            copies = await complete(s, url, prompt=["a"] * 2, max_tokens=2, n=3)
            # refused before its copies are made (they held the server, their memory grew)
            huge = await complete(s, url, prompt="a", max_tokens=2, n=10**12)
            alone_too_big = await complete(s, url, prompt=["aaaaaaaaaa"] * 3, max_tokens=10)
            queued = asyncio.create_task(complete(s, url, prompt=["five!"] * 2,
                                                  max_tokens=10))  # 30 tokens
            await _until(lambda: engine.queued_tokens == 30)
            async with s.post(url + "/v1/completions",
                              json={"prompt": "five!", "max_tokens": 10}) as r:
                busy = r.status, await r.json(), r.headers.get("Retry-After")
            held.release.set()
            return (many, copies, huge, alone_too_big, busy, (await first)[0],
                    (await queued)[0])

    many, copies, huge, alone_too_big, busy, first, queued = run(go())
    assert huge[0] == 400 and huge[1]["error"]["param"] == "n"
    assert f"{10**12} prompts; at most 4 per request" in huge[1]["error"]["message"]
    assert many[0] == 400 and "5 prompts; at most 4 per request" in many[1]["error"]["message"]
    # 2 prompts are within the limit, their 3 completions each not: n is the field named
    assert copies[0] == 400 and copies[1]["error"]["param"] == "n"
    assert "6 prompts; at most 4 per request" in copies[1]["error"]["message"]
    assert alone_too_big[0] == 400 and "needs 60 prompt and new tokens" in \
        alone_too_big[1]["error"]["message"]
    assert busy[0] == 503 and busy[2] == "1" and "busy" in busy[1]["error"]["message"]
    assert (first, queued) == (200, 200)


def test_a_failed_engine_step_is_a_500_naming_it_a_stream_ends_with_done_serving_goes_on(
        model, monkeypatch):
    """A decode program that fails (the device is gone) fails the sequences it held: a
    stream ends with an error event and [DONE], a plain request is a 500 naming the
    failure; the engine starts over from empty slots and answers the next request."""
    dispatch, failures = slot_engine.Engine._dispatch, []

    def failing_twice(engine):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("the device is gone")
        return dispatch(engine)

    monkeypatch.setattr(slot_engine.Engine, "_dispatch", failing_twice)

    async def go():
        runner, url, _ = await _server(model)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={
                        "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
                    events = [line.decode().removeprefix("data: ").strip()
                              async for line in r.content if line.strip()]
                plain = await complete(s, url, prompt="hi", max_tokens=4)
                after = await complete(s, url, prompt="hi", max_tokens=4, temperature=0)
            return events, plain, after
        finally:
            await runner.cleanup()

    events, (status, body), after = run(go())
    failed = "generation failed: RuntimeError: the device is gone"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == failed
    assert status == 500 and body["error"]["message"] == failed
    assert after[0] == 200 and after[1]["choices"][0]["text"] == expected(model, ["hi"], 4)[0]


def test_nan_logits_fail_only_their_request_a_500_naming_them_and_end_a_stream():
    """A model whose logits are NaN after one token ("~", its embedding NaN, its head's row
    not): a completion of a prompt with it is a 500 that says so (argmax gave token 0
    before), its stream ends with an error event and [DONE], the request decoding beside
    it is answered; scoring NaN log-probabilities likewise is a 500, not NaN in the JSON."""
    broken = Mamba2LM(Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16,
                                          chunk_size=16, tie_embeddings=False),
                      rngs=nnx.Rngs(0))
    broken.embedding[...] = broken.embedding[...].at[ord("~")].set(jnp.nan)

    async def go():
        runner, url, _ = await _server(broken)
        try:
            async with aiohttp.ClientSession() as s:
                async def stream():
                    async with s.post(url + "/v1/completions", json={
                            "prompt": "h~", "max_tokens": 4, "stream": True}) as r:
                        return [line.decode().removeprefix("data: ").strip()
                                async for line in r.content if line.strip()]
                plain, good, events = await asyncio.gather(
                    complete(s, url, prompt="hi~", max_tokens=3),
                    complete(s, url, prompt="hi", max_tokens=3, temperature=0), stream())
                async with s.put(url + "/api", json={"prompts": ["h~i"], "logprobs": True,
                                                     "tokens_to_generate": 0}) as r:
                    scoring = r.status, await r.json()
            return plain, good, events, scoring
        finally:
            await runner.cleanup()

    (status, body), good, events, scoring = run(go())
    assert status == 500 and body["error"]["message"].startswith(
        "generation failed: the model's logits are NaN (new token 0)")
    assert good == (200, good[1]) and good[1]["choices"][0]["text"] == expected(
        broken, ["hi"], 3)[0]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"].startswith(
        "generation failed: the model's logits are NaN")
    assert scoring[0] == 500 and scoring[1]["error"]["message"].startswith(
        "scoring failed: ValueError: token_logprobs: the model's logits are NaN (row 0, "
        "position ")


# ------------------------------------------------------------------ Megatron's /api fields


def scored(model, tokens):
    """Reference logprobs of tokens, log p(tokens[j + 1] | tokens[:j + 1]), and the ids of
    the most likely tokens [len - 1]: the server's program (token_logprobs at its [1, 16]
    bucket) run on the tokens right-padded, where the server left-pads them (a causal
    model: the padding after a sequence cannot change it)."""
    ids = np.zeros((1, 16), np.int32)
    ids[0, :len(tokens)] = tokens
    chosen, (_, top) = token_logprobs(model, ids, [16], TOP_LOGPROBS)
    return np.asarray(chosen)[0, :len(tokens) - 1], np.asarray(top)[0, :len(tokens) - 1, 0]


def test_megatron_api_answers_its_documented_examples_in_its_shape(url, model):
    """Megatron-LM's README: curl 'http://localhost:5000/api' -X 'PUT' -d '{"prompts":["Hello
    world"], "tokens_to_generate":1}'; its text_generation_cli.py sends the same fields."""
    async def go():
        async with aiohttp.ClientSession() as s:
            out = []
            for body in ({"prompts": ["Hello world"], "tokens_to_generate": 1},
                         {"prompts": ["Hello"], "tokens_to_generate": 8,
                          "temperature": 0, "logprobs": True},
                         {"prompts": ["Hi"], "tokens_to_generate": 0, "logprobs": True}):
                async with s.put(url + "/api", json=body) as r:
                    out.append((r.status, await r.json()))
            return out

    (s1, doc), (s2, greedy), (s3, scoring) = run(go())
    assert s1 == s2 == s3 == 200
    assert set(doc) == {"text", "segments", "tokens"}  # logprobs only when asked
    assert doc["tokens"][0][:11] == list(b"Hello world") and len(doc["tokens"][0]) == 12
    assert doc["text"][0].startswith("Hello world")
    assert "".join(doc["segments"][0]) == doc["text"][0]
    assert greedy["text"] == ["Hello" + expected(model, ["Hello"], 8)[0]]
    [tokens], [got] = greedy["tokens"], greedy["logprobs"]
    want, most_likely = scored(model, tokens)
    assert len(got) == len(tokens) - 1 == 12
    # Left-padded against right-padded, float32: ~1e-6 apart.
    np.testing.assert_allclose(got, want, atol=1e-4)
    # The decode loop's greedy tokens are the scoring forward's most likely ones.
    assert tokens[5:] == most_likely[4:].tolist()
    assert scoring["text"] == ["Hi"] and scoring["tokens"] == [list(b"Hi")]
    np.testing.assert_allclose(scoring["logprobs"][0], scored(model, list(b"Hi"))[0],
                               atol=1e-4)


def test_random_seed_repeats_a_request_and_beam_search_is_a_400_saying_why(url):
    async def go():
        async with aiohttp.ClientSession() as s:
            out = []
            for body in ({"random_seed": 7}, {"random_seed": 7}, {"random_seed": 8},
                         {"random_seed": 7, "prompts": ["Seed", "Seed"]}, {"beam_width": 2}, {"add_BOS": True}, {"top_p_decay": 0.5},
                         {"tokens_to_generate": 0}):
                async with s.put(url + "/api", json={"prompts": ["Seed"],
                                                     "tokens_to_generate": 8, **body}) as r:
                    out.append((r.status, await r.json()))
            return out

    (s1, a), (s2, b), (s3, c), (s4, twice), *refused = run(go())
    assert s1 == s2 == s3 == s4 == 200 and a["tokens"] == b["tokens"] != c["tokens"]
    # A prompt sent twice: two samples (prompt j seeded random_seed + j), the first as alone
    assert twice["tokens"][0] == a["tokens"][0] != twice["tokens"][1]
    for (status, error), field, says in zip(refused, (
            "beam_width", "add_BOS", "top_p_decay", "tokens_to_generate"), (
            r"beam search is not supported: the compiled decode loop carries one recurrent "
            r"state per row", "tokenizer has no BOS token", "needs top_p > 0",
            "needs logprobs=true")):
        assert status == 400 and error["error"]["param"] == field
        assert re.search(says, error["error"]["message"])


class _Scripted:
    """A stand-in for the engine's decoding: every sequence continues with `text`'s bytes
    (up to its max_new_tokens); records each one's SamplingParams."""

    def __init__(self, text: bytes, monkeypatch):
        self.text, self.params = text, []
        monkeypatch.setattr(slot_engine.Engine, "submit",
                            lambda engine, ids, params: self.submit(engine, ids, params))

    def submit(self, engine, ids, params):
        self.params.append(params)
        seq = slot_engine.Sequence(engine, ids, params)
        for token in np.resize(np.frombuffer(self.text, np.uint8), params.max_new_tokens):
            seq._emit(slot_engine.TokenEvent(int(token), None, None))
        seq._finish("length")
        return seq


def test_megatron_stops_and_sampling_fields_and_openai_stop_n(model, monkeypatch):
    scripted = _Scripted(b"ab:\ncd\n\nef", monkeypatch)

    async def go():
        runner, url, _ = await _server(model)
        try:
            async with aiohttp.ClientSession() as s:
                out = []
                for body in ({"stop_on_eol": True}, {"stop_on_double_eol": True},
                             {"prevent_newline_after_colon": True, "top_p": 0.9,
                              "top_p_decay": 0.5, "top_p_bound": 0.2}):
                    async with s.put(url + "/api", json={"prompts": ["x"],
                                                         "tokens_to_generate": 10,
                                                         **body}) as r:
                        out.append(await r.json())
                out.append(await complete(s, url, prompt=["p", "q"], max_tokens=10, n=2,
                                          stop=["d\n", "zz"]))
                return out, await streamed(s, url, prompt="s", max_tokens=10, stop="\n\n")
        finally:
            await runner.cleanup()

    (eol, double, sampling, (status, openai)), chunks = run(go())
    assert eol["text"] == ["xab:\n"] and eol["tokens"] == [list(b"xab:\n")]
    assert double["text"] == ["xab:\ncd\n\n"]
    params = scripted.params[2]  # the sampling request's
    assert params.banned_after == (ord(":"), ord("\n"))
    assert (params.top_p, params.top_p_decay, params.top_p_bound) == (
        pytest.approx(0.9), 0.5, 0.2)
    assert scripted.params[0].banned_after is None and scripted.params[0].top_p_decay == 0
    assert status == 200 and [c["index"] for c in openai["choices"]] == [0, 1, 2, 3]
    assert {(c["text"], c["finish_reason"]) for c in openai["choices"]} == {("ab:\nc", "stop")}
    assert openai["usage"]["completion_tokens"] == 4 * 5  # the tokens of the text kept
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab:\ncd"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stream_holds_back_a_stop_longer_than_the_text_so_far(model, monkeypatch):
    """A stop string longer than the text streamed so far may still begin in it: the stream
    sends nothing it could cut (a negative hold once sent "ab" where the answer is "a")."""
    _Scripted(b"ab:\ncd\n\nef", monkeypatch)

    async def go():
        runner, url, _ = await _server(model)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "s", "max_tokens": 10, "stop": "b:\ncd\n\nef"}
                return (await complete(s, url, **body))[1], await streamed(s, url, **body)
        finally:
            await runner.cleanup()

    whole, chunks = run(go())
    assert whole["choices"][0]["text"] == "a"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "a"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_openai_logprobs_list_each_new_token_and_the_most_likely(url, model):
    async def go():
        async with aiohttp.ClientSession() as s:
            return (await complete(s, url, prompt="Hello", max_tokens=8, temperature=0,
                                   logprobs=2),
                    await complete(s, url, prompt="Hello", logprobs=1, stream=True))

    (status, body), (refused, error) = run(go())
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == 8
    assert lp["text_offset"][0] == 5  # the first new token begins after the prompt
    greedy = expected_tokens(model, "Hello", 8)
    np.testing.assert_allclose(lp["token_logprobs"], scored(model, greedy)[0][4:], atol=1e-4)
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-4)
    assert refused == 400 and error["error"]["param"] == "logprobs"


@pytest.mark.parametrize("command", [["mamba_jax.serve", "--checkpoint", "runs/x"],
                                     ["mamba_jax.generate", "--server", "http://127.0.0.1:9",
                                      "--prompt", "Hi"]], ids=["serve", "generate"])
def test_without_the_serve_extra_each_command_says_what_to_install(tmp_path, command):
    # An aiohttp that cannot be imported, as where `pip install mamba-jax` left it out.
    (tmp_path / "aiohttp").mkdir()
    (tmp_path / "aiohttp" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'aiohttp'\", name='aiohttp')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    done = subprocess.run([sys.executable, "-m", *command], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    name = command[0].replace("mamba_jax.", "")
    needs = "the server needs" if name == "serve" else "--server needs"
    assert done.stderr == (f"python -m mamba_jax.{name}: {needs} aiohttp: pip install "
                           "'mamba-jax[serve]'\n")
    assert done.stdout == ""


@pytest.mark.parametrize("flags,refusal", [
    (["--port", "99999"], r"--port=99999 must be in \[0, 65535\]"),
    (["--slots", "0"], "--slots=0 must be an integer >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
    (["--prefill-chunk", "100"], "--prefill-chunk=100 must be 16 times a power of two"),
    (["--prefix-cache-mb", "nan"], "--prefix-cache-mb=nan must be a number >= 0"),
    # generate's bound: every request past it was a 500
    (["--max-new-tokens", "2000000"], "--max-new-tokens=2000000 must be at most 1048576"),
])
def test_the_server_refuses_limits_it_could_not_serve_under(flags, refusal, checkpoint,
                                                           capsys):
    from mamba_jax.serve import main

    with pytest.raises(SystemExit, match=refusal) as refused:
        main(["--checkpoint", str(checkpoint), *flags])  # its weights never read
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_server_names_an_address_it_cannot_listen_on_before_loading_the_model(
        checkpoint, tmp_path, capsys):
    """A port in use is refused at once, naming --host and --port (the checkpoint's weights
    are never read); a checkpoint that is not there, or a folder that holds no model or no
    tokenizer, is named first (a busy port hid it)."""
    import socket

    from mamba_jax.serve import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"--host 127.0.0.1 --port {port}: cannot listen "
                                             "there .*give a free --port") as refused:
            main(["--checkpoint", str(checkpoint), "--port", str(port)])
        with pytest.raises(SystemExit, match=f"--checkpoint {tmp_path / 'nope'}: no such "
                                             "directory") as missing:
            main(["--checkpoint", str(tmp_path / "nope"), "--port", str(port)])
        with pytest.raises(SystemExit, match=f"{tmp_path / 'config.json'} not found: a "
                                             "checkpoint dir needs config.json") as empty:
            main(["--checkpoint", str(tmp_path), "--port", str(port)])
        (tmp_path / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
        with pytest.raises(SystemExit, match=f"tokenizer file {tmp_path / 'tokenizer.json'} "
                                             "not found: pass --tokenizer") as untokenized:
            main(["--checkpoint", str(tmp_path), "--port", str(port)])
    assert {e.value.code for e in (refused, missing, empty, untokenized)} == {2}
    assert capsys.readouterr().err.count("\n") == 4


def test_the_server_names_a_checkpoint_it_cannot_load(tmp_path, checkpoint, capsys):
    from mamba_jax.serve import main

    with pytest.raises(SystemExit, match="no such directory") as refused:
        main(["--checkpoint", str(tmp_path / "absent"), "--port", "0"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    # A tokenizer of more tokens than the embedding's rows (every request was a 500)
    sentencepiece = os.path.join(ROOT, "tests", "fixtures", "megatron", "tokenizer.model")
    with pytest.raises(SystemExit, match=rf"the tokenizer has 512 tokens, more than the 256 "
                                         rf"rows of {checkpoint}'s embedding: give the "
                                         "tokenizer the model was trained with"):
        main(["--checkpoint", str(checkpoint), "--tokenizer", str(sentencepiece), "--port",
              "0"])


def test_the_start_line_gives_the_engines_memory_in_mb_or_in_kb_below_one():
    from mamba_jax.serve import _memory_line

    line = _memory_line({"slot": 20 * 2**10, "slots": 64 * 20 * 2**10, "staging": 3 * 2**20,
                         "prefix_cache": 0, "kv_tokens": 128}, 64)
    assert line == ("engine: 64 slots of 20.0 KB each, 1.2 MB in all (attention keys and "
                    "values for 128 tokens a slot: a longer prompt and max_tokens is "
                    "refused); prefill staging 3.0 MB; prefix cache off")


def test_a_checkpoint_given_as_dot_names_the_model_by_its_folder(checkpoint, monkeypatch):
    from mamba_jax import serve

    served = []
    monkeypatch.setattr(serve.web, "run_app", lambda app, **_: served.append(app))
    monkeypatch.chdir(checkpoint)
    serve.main(["--checkpoint", ".", "--port", "0"])
    assert served[0][serve.MODEL_NAME] == checkpoint.name  # it was ""


def test_a_chat_template_file_renders_with_the_models_special_tokens(checkpoint, tmp_path,
                                                                     monkeypatch):
    """serve --chat-template FILE renders as transformers' apply_chat_template(chat_template=
    FILE's text) does: with the model's special tokens from its tokenizer_config.json (they
    rendered as empty text)."""
    import shutil

    from mamba_jax import serve

    model_dir = shutil.copytree(checkpoint, tmp_path / "model")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}))
    (tmp_path / "chat.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}")
    served = []
    monkeypatch.setattr(serve.web, "run_app", lambda app, **_: served.append(app))
    serve.main(["--checkpoint", str(model_dir), "--chat-template", str(tmp_path / "chat.jinja"),
                "--port", "0"])
    assert served[0][serve.CHAT_TEMPLATE].render([{"role": "user", "content": "Hi"}]) == \
        "<s>Hi</s>"
