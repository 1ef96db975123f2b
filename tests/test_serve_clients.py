"""The server answering what real clients send: the requests of the `openai` package and of
lm-eval 0.4 (recorded by tests/fixtures/record_client_requests.py, replayed here), and the
OpenAI and Megatron fields and errors those clients meet. The model is
tests/fixtures/trained_tiny (the byte tokenizer, vocabulary 256); references come from
mamba_jax.generate and token_logprobs, not from the server."""

import asyncio
import dataclasses
import json
import logging
import re
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import mamba_jax
from mamba_jax import engine as engine_module
from mamba_jax.chat import ChatTemplate
from mamba_jax.engine import Limits
from mamba_jax.generate import token_logprobs
from mamba_jax import http_api
from mamba_jax.serve import make_app
from mamba_jax.tokenizer import byte_tokenizer
from tests.test_serve import serving

FIXTURES = Path(__file__).parent / "fixtures"
REQUESTS = sorted((FIXTURES / "client_requests").glob("*.json"))
LIMITS = Limits(max_prompt_tokens=64, max_new_tokens=16)
ENGINE = dict(slots=8, prefill_chunk=32, prefill_rows=4)
# A ChatML-like template: the tests render with ChatTemplate themselves for the reference
TEMPLATE = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model():
    return mamba_jax.from_pretrained(FIXTURES / "trained_tiny")


@pytest.fixture(scope="module")
def app(model):
    return make_app(model, byte_tokenizer(), LIMITS, model_name="tiny", engine_options=ENGINE,
                    chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def url(app):
    with serving(app) as address:
        yield address


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def send(url, method, path, body, headers=None):
    """(status, the JSON answer, or the JSON chunks of a stream and whether [DONE] ended
    it)."""
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body, headers=headers) as r:
            if not r.headers["Content-Type"].startswith("text/event-stream"):
                return r.status, await r.json()
            events = [line.decode().removeprefix("data: ").strip()
                      async for line in r.content if line.strip()]
            return r.status, ([json.loads(e) for e in events[:-1]], events[-1] == "[DONE]")


async def scrape(url):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            return r.status, r.headers["Content-Type"], await r.text()


def finished_requests(url) -> dict:
    """/metrics' mamba_finished_requests_total: {reason: count}."""
    _, _, text = run(scrape(url))
    [family] = [f for f in text_string_to_metric_families(text)
                if f.name == "mamba_finished_requests"]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def greedy(model, ids, n):
    """The greedy continuation's ids of a prompt's ids."""
    return np.asarray(mamba_jax.generate(model, np.asarray([ids]), n))[0, len(ids):].tolist()


def reference_logprobs(model, ids, top_n=1):
    """log p of each token after the first and the top_n most likely ids there."""
    chosen, (_, top) = token_logprobs(model, np.asarray([ids]), None, top_n)
    return np.asarray(chosen)[0], np.asarray(top)[0]


def cut(text, stops):
    found = [i for i in (text.find(s) for s in stops or []) if i >= 0]
    return text[:min(found)] if found else text


def prompt_ids(prompt):
    """The recorded prompt as a list of id lists (the byte tokenizer: a text's bytes)."""
    if isinstance(prompt, str):
        return [list(prompt.encode())]
    if isinstance(prompt[0], int):
        return [prompt]
    return [list(p.encode()) if isinstance(p, str) else p for p in prompt]


def check_completion(model, body, answer):
    prompts = prompt_ids(body["prompt"])
    n = body.get("n") or 1
    assert answer["object"] == "text_completion" and answer["model"] == body["model"]
    assert [c["index"] for c in answer["choices"]] == list(range(len(prompts) * n))
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for choice, ids in zip(answer["choices"], [p for p in prompts for _ in range(n)]):
        prompt_text = bytes(ids).decode()
        if body.get("temperature") == 0:
            want = bytes(greedy(model, ids, body["max_tokens"])).decode(errors="replace")
            assert choice["text"] == prompt_text * bool(body.get("echo")) + cut(
                want, body.get("stop"))
        if body.get("logprobs") is None:
            assert choice["logprobs"] is None
            continue
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert len(lp["top_logprobs"]) == len(lp["tokens"])
        chosen, top = reference_logprobs(model, ids)
        if body.get("echo"):
            # What lm-eval reads: token_logprobs[ctxlen:-1] are the continuation's log p
            # (the first has none), top_logprobs there the most likely token's.
            assert "".join(lp["tokens"]) == choice["text"]
            assert lp["text_offset"] == np.cumsum([0] + [len(t) for t in lp["tokens"]])[
                :-1].tolist()
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            if choice["finish_reason"] == "length":  # lm-eval drops the last: the new token
                assert len(lp["tokens"]) == len(ids) + body["max_tokens"]
            np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)],
                                       chosen[:len(ids) - 1], atol=1e-4)
            for position, entry in enumerate(lp["top_logprobs"][1:len(ids)]):
                assert list(entry) == [chr(top[position, 0])]
        else:
            assert lp["text_offset"][0] == len(prompt_text)


def check_chat(model, body, answer, stream):
    ids = TEMPLATE.encode(byte_tokenizer(), body["messages"], add_generation_prompt=True)
    n = body.get("n") or 1
    new = body.get("max_completion_tokens") or body.get("max_tokens")
    want = cut(bytes(greedy(model, ids, new)).decode(errors="replace"), body.get("stop"))
    if stream:
        chunks, done = answer
        assert done and all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        if (body.get("stream_options") or {}).get("include_usage"):
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == len(ids)
            chunks = chunks[:-1]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        # at most a byte a token (the byte tokenizer); a sampled byte that completes no
        # character reads as U+FFFD, which stands for at least one byte
        assert len(text.replace("\ufffd", "?").encode()) <= new
        if body.get("temperature") == 0:
            assert text == want
        return
    assert answer["object"] == "chat.completion" and len(answer["choices"]) == n
    assert answer["usage"]["prompt_tokens"] == len(ids)
    for choice in answer["choices"]:
        assert choice["message"]["role"] == "assistant"
        if body.get("temperature") == 0:
            assert choice["message"]["content"] == want
        if body.get("logprobs"):
            content = choice["logprobs"]["content"]
            assert "".join(e["token"] for e in content) == choice["message"]["content"]
            chosen, _ = reference_logprobs(model, ids + [b for e in content for b in e["bytes"]])
            np.testing.assert_allclose([e["logprob"] for e in content],
                                       chosen[len(ids) - 1:], atol=1e-4)
            assert all(len(e["top_logprobs"]) == body["top_logprobs"] for e in content)


@pytest.mark.parametrize("fixture", REQUESTS, ids=[p.stem for p in REQUESTS])
def test_recorded_client_requests_are_answered_as_the_client_reads_them(url, model, fixture):
    for request in json.loads(fixture.read_text()):
        body = request["body"]
        status, answer = run(send(url, request["method"], request["path"], body,
                                  request["headers"]))
        assert status == 200, answer
        stream = bool(body.get("stream"))
        if request["path"].endswith("/chat/completions"):
            check_chat(model, body, answer, stream)
        elif stream:
            chunks, done = answer
            assert done and all(c["object"] == "text_completion" for c in chunks)
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == (
                chunks[-1]["usage"]["prompt_tokens"] + chunks[-1]["usage"]["completion_tokens"])
            assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            check_completion(model, body, answer)
        if body.get("seed") is not None and not stream:  # a seeded request repeats
            again = run(send(url, request["method"], request["path"], body))[1]
            assert [c.get("text", c.get("message")) for c in again["choices"]] == \
                [c.get("text", c.get("message")) for c in answer["choices"]]


def test_echo_with_max_tokens_0_scores_the_prompt(url, model):
    body = {"prompt": "Hello world", "echo": True, "max_tokens": 0, "logprobs": 2}
    status, answer = run(send(url, "POST", "/v1/completions", body))
    assert status == 200
    [choice] = answer["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == "Hello world" and lp["tokens"] == list("Hello world")
    assert lp["text_offset"] == list(range(11)) and answer["usage"]["completion_tokens"] == 0
    chosen, top = reference_logprobs(model, list(b"Hello world"), 2)
    assert lp["token_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], chosen, atol=1e-4)
    assert [list(t) for t in lp["top_logprobs"][1:]] == [[chr(a), chr(b)] for a, b in top]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_stop_string_earliest_in_the_text_cuts_whatever_its_place_in_the_list(
        url, model, stream):
    text = bytes(greedy(model, list(b"Once upon"), 16)).decode()
    # Two stops that the same token completes (a stream checks after each token): the
    # list names first the one that begins later in the text.
    j = next(j for j in range(2, len(text)) if text.find(text[j]) == j)
    early, late = text[j - 2:j + 1], text[j]
    assert text.find(early) == j - 2 < text.find(late) == j
    before = finished_requests(url)
    status, answer = run(send(url, "POST", "/v1/completions", {
        "prompt": "Once upon", "max_tokens": 16, "temperature": 0, "stop": [late, early],
        "stream": stream}))
    assert status == 200
    after = finished_requests(url)  # the stop string ended it: /metrics counts a "stop"
    assert {r: after[r] - before[r] for r in after} == {
        "stop": 1, "length": 0, "cancelled": 0, "error": 0}
    if stream:
        chunks, _ = answer
        got = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        got, reason = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
    assert (got, reason) == (text[:j - 2], "stop")


def test_seed_penalties_and_logit_bias_sample_as_generate_does(url, model, monkeypatch):
    """seed, the penalties, logit_bias and top_k go into the engine's SamplingParams, n
    seeded choices with seeds of their own, and the replies are generate's tokens with those
    settings and seeds (without the penalties and the bias, generate gives other tokens)."""
    seen = []
    submit = engine_module.Engine.submit

    def spy(self, ids, params):
        seen.append(params)
        return submit(self, ids, params)

    monkeypatch.setattr(engine_module.Engine, "submit", spy)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    status, answer = run(send(url, "POST", "/v1/chat/completions", {
        "messages": messages, "max_completion_tokens": 4, "seed": 11, "n": 2,
        "presence_penalty": 1.5, "frequency_penalty": -0.5,
        "logit_bias": {"65": 5, "66": -100}, "top_k": 40, "temperature": 0.3}))
    assert status == 200
    assert [p.seed for p in seen] == [11, 12]
    for p in seen:
        assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.max_new_tokens) == \
            (1.5, -0.5, 40, 4)
        assert p.logit_bias == ((65, 5.0), (66, -100.0))
        assert p.temperature == pytest.approx(0.3)
    ids = TEMPLATE.encode(byte_tokenizer(), [{"role": "user", "content": "Hi"}],
                          add_generation_prompt=True)

    out = mamba_jax.generate(model, np.asarray([ids, ids]), 4, 0.3, 40, 1.0, [11, 12],
                             presence_penalty=1.5, frequency_penalty=-0.5,
                             logit_bias={65: 5.0, 66: -100.0})
    assert [c["message"]["content"] for c in answer["choices"]] == [
        byte_tokenizer().decode(row[len(ids):].tolist()) for row in np.asarray(out)]


@pytest.mark.parametrize("method,path,body,status,param,code,says", [
    ("post", "/v1/nope", {}, 404, None, "not_found", "no such endpoint"),
    ("get", "/v1/completions", None, 405, None, "method_not_allowed", "takes POST"),
    ("post", "/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix",
     "unsupported_parameter", "does not implement"),
    ("post", "/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of",
     "unsupported_parameter", "best_of=2 with n=1"),
    ("post", "/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate",
     "unknown_parameter", "unknown field"),
    ("post", "/v1/completions", {"prompt": [[72, 300]]}, 400, "prompt[1]", "invalid_value",
     "300 is not a token id"),
    ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     "invalid_value", r"max_tokens=0 must be in \[1,"),
    ("post", "/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400,
     "presence_penalty", "invalid_value", r"in \[-2, 2\]"),
    ("post", "/v1/completions", {"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias",
     "invalid_value", "'999' is not a token id"),
    # A key of other digits than ASCII's: "²" was a 500, "٣" read as token 3
    ("post", "/v1/completions", {"prompt": "hi", "logit_bias": {"²": 1}}, 400, "logit_bias",
     "invalid_value", "'²' is not a token id"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "logit_bias": {"٣": 1}}, 400, "logit_bias",
     "invalid_value", "'٣' is not a token id"),
    ("post", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options", "invalid_value", "stream=true"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "tools": [{"type": "function"}]}, 400, "tools",
     "unsupported_parameter", "tool calls"),
    ("put", "/api", {"prompts": ["hi"], "tokens_to_generate": 4, "top_k": 257}, 400, "top_k",
     "invalid_value", "more than the model's 256 tokens"),
    ("put", "/api", {"prompts": ["hi"], "max_len": 4}, 400, "max_len", "unknown_parameter",
     "use tokens_to_generate"),
])
def test_every_refusal_has_openais_error_shape(url, method, path, body, status, param, code,
                                               says):
    got, answer = run(send(url, method.upper(), path, body))
    assert got == status
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param",
                                                                 "code"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert (answer["error"]["param"], answer["error"]["code"]) == (param, code)
    assert re.search(says, answer["error"]["message"])


def test_the_get_endpoints_answer_head_as_http_asks(url):
    """HEAD, which HTTP servers must take wherever they take GET (health probes send it): the
    GET answer's status and headers without its body (it was a 405)."""
    async def head(path):
        async with aiohttp.ClientSession() as s:
            async with s.head(url + path) as r:
                return r.status, r.headers["Content-Type"].split(";")[0], await r.read()

    for path, kind in (("/health", "application/json"), ("/v1/models", "application/json"),
                       ("/metrics", "text/plain")):
        assert run(head(path)) == (200, kind, b"")
    status, answer = run(send(url, "POST", "/health", {}))
    assert status == 405 and "takes GET or HEAD" in answer["error"]["message"]


def test_a_model_without_a_chat_template_names_both_ways_to_give_one(model):
    with serving(make_app(model, byte_tokenizer(), LIMITS, engine_options=ENGINE)) as address:
        status, answer = run(send(address, "POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "hi"}]}))
    assert status == 400 and answer["error"]["param"] == "messages"
    assert "--chat-template FILE" in answer["error"]["message"]
    assert "chat_template to the model's tokenizer_config.json" in answer["error"]["message"]


def test_megatron_stop_token_ends_the_continuation_and_no_log_is_taken(url, model, caplog):
    caplog.set_level(logging.INFO, logger="mamba_jax.serve")
    new = greedy(model, list(b"Hi"), 8)
    body = {"prompts": ["Hi"], "tokens_to_generate": 8, "temperature": 0}
    status, answer = run(send(url, "PUT", "/api", {**body, "stop_token": new[3],
                                                   "no_log": True}))
    assert status == 200
    assert answer["tokens"] == [list(b"Hi") + new[:new.index(new[3])]]
    assert "PUT /api" not in caplog.text
    assert run(send(url, "PUT", "/api", body))[0] == 200
    assert "PUT /api" in caplog.text  # logged as Megatron's server does, unless no_log


def test_metrics_render_the_engine_and_the_latencies(url):
    assert run(send(url, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4}))[0] \
        == 200
    status, kind, text = run(scrape(url))
    assert status == 200 and kind.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("mamba_queued_requests", "mamba_queued_tokens", "mamba_busy_slots",
                 "mamba_slots", "mamba_tokens_per_second", "mamba_generated_tokens",
                 "mamba_prefill_tokens", "mamba_prefix_cache_hits",
                 "mamba_prefix_cache_lookups", "mamba_prefix_cache_bytes",
                 "mamba_prefix_cache_entries"):
        assert name in families, name
    for name in ("mamba_time_to_first_token_seconds", "mamba_time_per_output_token_seconds"):
        count = next(s.value for s in families[name].samples if s.name == name + "_count")
        assert count >= 1, name


def test_a_chat_template_file_that_cannot_be_read_is_refused_before_the_model_loads(
        tmp_path, capsys):
    from mamba_jax.serve import main

    with pytest.raises(SystemExit, match=f"--chat-template {tmp_path / 'none.jinja'}: cannot "
                                         "read it") as no:
        main(["--checkpoint", str(FIXTURES / "trained_tiny"), "--chat-template",
              str(tmp_path / "none.jinja")])
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(SystemExit, match="--chat-template .*bad.jinja: not a Jinja") as bad:
        main(["--checkpoint", str(FIXTURES / "trained_tiny"), "--chat-template",
              str(tmp_path / "bad.jinja")])
    assert no.value.code == bad.value.code == 2
    assert capsys.readouterr().err.count("\n") == 2


def test_a_tokenizer_that_adds_special_tokens_finds_the_end_of_turn_and_the_colon():
    """A tokenizer whose post-processor adds BOS and EOS to every text (as many tokenizer.json
    files do): the chat template's eos_token still reads as one token, the one that ends a
    reply (with the BOS it was two, and no reply ended at it), and Megatron's
    prevent_newline_after_colon bans the tokens of ":" and "\\n" (the EOS was taken for
    ":")."""
    from tokenizers import processors

    tokenizer = byte_tokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="Ā $A ā", special_tokens=[("Ā", 0), ("ā", 1)])  # bytes 0 and 1 as BOS, EOS
    assert tokenizer.encode("|").ids == [0, ord("|"), 1]
    texts = http_api.Texts(tokenizer, 256, None)
    assert (texts.single_token("|"), texts.token_of(":"), texts.token_of("\n")) == (
        ord("|"), ord(":"), ord("\n"))


def test_a_chat_without_max_tokens_gets_what_fits_in_the_keys_a_slot_holds(app, url, model,
                                                                           monkeypatch):
    """OpenAI's default max_tokens is what fits after the prompt: in a model with attention
    layers the keys a slot holds (--kv-tokens) bound it below the server's limit (the request
    was a 400 for tokens it did not ask for); one that asks for more is still refused."""
    messages = [{"role": "user", "content": "Hi"}]
    ids = TEMPLATE.encode(byte_tokenizer(), messages, add_generation_prompt=True)
    monkeypatch.setattr(app[http_api.ENGINE], "kv_tokens", len(ids) + 9)  # below 16, the limit
    status, answer = run(send(url, "POST", "/v1/chat/completions",
                              {"messages": messages, "temperature": 0}))
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == bytes(greedy(model, ids, 9)).decode(
        errors="replace")
    assert (answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]) == (
        "length", 9)
    status, answer = run(send(url, "POST", "/v1/chat/completions",
                              {"messages": messages, "max_tokens": 10}))
    assert status == 400 and "attention key slots" in answer["error"]["message"]
