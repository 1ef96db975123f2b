"""The serving engine (mamba_jax.engine), driven step by step: continuous batching over its
slots equals generate, per-slot sampling, the prefix cache, a hybrid's attention keys."""

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax import engine as engine_module
from mamba_jax.engine import Engine, GenerationError, Limits, SamplingParams, _PrefixCache
from mamba_jax.generate import token_logprobs

FIXTURE = "tests/fixtures/trained_tiny"
LIMITS = Limits(max_prompt_tokens=64, max_new_tokens=12)
# Small chunks, few rows and slots: prompts longer than a chunk, and sequences that wait
OPTIONS = dict(slots=4, steps_per_dispatch=2, prefill_chunk=32, prefill_rows=2,
               prefill_interval_ms=0)


@pytest.fixture(scope="module")
def model():
    return mamba_jax.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, None, LIMITS, **OPTIONS)


def drain(engine):
    while engine.step():
        pass


def generated(model, requests):
    """generate's new tokens for each (prompt, SamplingParams) of requests, from one call:
    the prompts left-padded, the settings and seeds one a row (each row as if alone)."""
    l, ps = max(len(prompt) for prompt, _ in requests), [p for _, p in requests]
    ids = np.asarray([[0] * (l - len(prompt)) + list(prompt) for prompt, _ in requests])
    row = lambda name: [getattr(p, name) for p in ps]
    out = mamba_jax.generate(
        model, ids, max(row("max_new_tokens")), row("temperature"), row("top_k"),
        row("top_p"), [p.seed or 0 for p in ps], prompt_lengths=[len(r[0]) for r in requests],
        max_new_tokens_per_row=row("max_new_tokens"), presence_penalty=row("presence_penalty"),
        frequency_penalty=row("frequency_penalty"),
        logit_bias=[dict(p.logit_bias) for p in ps])
    return [new[:p.max_new_tokens].tolist() for new, p in zip(np.asarray(out)[:, l:], ps)]


def test_requests_joining_a_running_batch_equal_generate_with_their_own_settings(model,
                                                                                engine):
    """Greedy and sampled sequences with different settings, submitted while others decode
    (one longer than a prefill chunk, one of a single token): each gets generate's tokens
    for its prompt, settings and seed; the later ones start before the first one ends."""
    rng = np.random.default_rng(0)
    requests = [(list(b"Hello world"), SamplingParams(12)),
                (rng.integers(0, 256, 50).tolist(),  # a chunk of 32, 16, a token to the steps
                 SamplingParams(9, temperature=1.0, seed=7, presence_penalty=0.5,
                                frequency_penalty=0.3)),
                ([65], SamplingParams(6, temperature=0.8, top_k=5, top_p=0.9, seed=3)),
                (list(b"This License"), SamplingParams(8, logit_bias=((32, -4.0), (116, 2.5))))]
    first = engine.submit(*requests[0])
    engine.step()
    engine.step()
    assert first.tokens and first.finish_reason is None  # decoding
    later = [engine.submit(*r) for r in requests[1:]]
    while first.finish_reason is None:
        engine.step()
    assert all(s.tokens for s in later)  # they joined before the first sequence ended
    drain(engine)
    for seq, want in zip([first, *later], generated(model, requests)):
        assert (seq.tokens, seq.finish_reason) == (want, "length")


def test_a_stopped_sequence_frees_its_slot_for_a_waiting_one(model, engine):
    """Four slots busy and a fifth request waiting: the sequence that meets its stop token
    leaves (the stop token not given), and the waiting one decodes before the others end."""
    prompts = [list(f"slot {i}".encode()) for i in range(5)]
    free, fifth = generated(model, [(prompts[0], SamplingParams(4)),
                                    (prompts[4], SamplingParams(12))])
    seqs = [engine.submit(prompts[0], SamplingParams(12, stop_token_ids=(free[2],)))]
    seqs += [engine.submit(p, SamplingParams(12)) for p in prompts[1:]]
    while seqs[0].finish_reason is None:
        engine.step()
        assert engine.stats()["slots_busy"] <= 4
    assert (seqs[0].tokens, seqs[0].finish_reason) == (free[:free.index(free[2])], "stop")
    while not seqs[4].tokens:
        engine.step()
    assert all(s.finish_reason is None for s in seqs[1:4])
    drain(engine)
    assert [s.finish_reason for s in seqs] == ["stop"] + ["length"] * 4
    assert seqs[4].tokens == fifth


def test_requests_cancelled_while_they_wait_give_back_the_queues_room_at_once(model):
    """The one slot decoding and a request waiting before them: requests whose clients left
    leave the queue at the engine's next step, their tokens no longer counted as queued nor
    against max_queued_tokens (a new request was refused as busy until they reached the
    queue's front)."""
    engine = Engine(model, None, Limits(64, 12, max_queued_tokens=60),
                    **{**OPTIONS, "slots": 1, "prefill_rows": 1})
    decoding = engine.submit(list(b"decoding"), SamplingParams(12))
    engine.step()
    waiting = engine.submit(list(b"waiting"), SamplingParams(12))
    for seq in [engine.submit(list(b"left"), SamplingParams(12)) for _ in range(2)]:
        seq.cancel()
    engine.step()
    assert decoding.finish_reason is None
    assert (engine.queued_tokens, engine.stats()["queued"]) == (waiting.cost, 1)
    engine.submit(list(b"a new one"), SamplingParams(12))  # 19 + 21 tokens of 60: not Busy
    drain(engine)


def test_the_batch_shrinks_while_a_sequence_freed_at_its_last_dispatch_is_read(model,
                                                                               monkeypatch):
    """Six sequences in a batch of 8: four end at the first dispatch, the last one (slot 5)
    as the second goes out, and the batch then shrinks to the one left before that dispatch
    is read (its slot index past the new batch was an IndexError that failed every sequence
    held); each equals generate."""
    monkeypatch.setattr(engine_module, "SHRINK_AFTER_S", 0.0)
    engine = Engine(model, None, LIMITS, **{**OPTIONS, "slots": 8, "prefill_rows": 8})
    requests = [(list(b"long one"), SamplingParams(12))]
    requests += [(list(f"short {i}".encode()), SamplingParams(2)) for i in range(4)]
    requests += [(list(b"ends later"), SamplingParams(4))]
    seqs = [engine.submit(*r) for r in requests]
    for capacity in (8, 8, 1):
        engine.step()
        assert len(engine._slot) == capacity
    drain(engine)
    assert [(s.tokens, s.finish_reason) for s in seqs] == [
        (want, "length") for want in generated(model, requests)]


def test_a_prompt_whose_prefill_fails_fails_only_its_own_sequence(model, engine,
                                                                monkeypatch):
    """Should a prefill program fail (here a prompt holding "~" before its last token), each
    prompt of its batch runs again alone: the one at fault ends with a GenerationError, the
    one prefilled beside it and the one decoding meanwhile equal generate."""
    prefill = engine_module._prefill_chunk

    def failing(params, staging, rows, ids, *args, **kwargs):
        if (np.asarray(ids) == ord("~")).any():
            raise ValueError("a prompt the model cannot run")
        return prefill(params, staging, rows, ids, *args, **kwargs)

    monkeypatch.setattr(engine_module, "_prefill_chunk", failing)
    requests = [(list(b"decoding"), SamplingParams(8)), (list(b"good"), SamplingParams(4))]
    decoding = engine.submit(*requests[0])
    engine.step()
    bad, good = engine.submit(list(b"b~ad"), SamplingParams(4)), engine.submit(*requests[1])
    engine.step()  # the two prompts prefill as one batch (two staging rows), which fails
    assert bad.finish_reason == "error" and isinstance(bad.error, GenerationError)
    assert str(bad.error) == ("its prompt's prefill failed: ValueError: a prompt the model "
                              "cannot run")
    drain(engine)
    assert [(s.tokens, s.finish_reason) for s in (decoding, good)] == [
        (want, "length") for want in generated(model, requests)]
    assert engine.stats()["requests_finished"]["error"] == 1


def test_while_sequences_decode_prompts_wait_for_the_interval_or_a_full_staging(model):
    """A prefill stalls the decoding slots: while one decodes, a new prompt waits for
    prefill_interval_ms, unless prefill_rows prompts wait (a full batch)."""
    engine = Engine(model, None, LIMITS, **{**OPTIONS, "prefill_interval_ms": 60e3})
    first = engine.submit(list(b"first"), SamplingParams(12))
    engine.step()
    second = engine.submit(list(b"second"), SamplingParams(2))
    for _ in range(3):
        engine.step()
    assert first.tokens and not second.tokens and engine.stats()["prefill_tokens"] == 4
    third = engine.submit(list(b"third"), SamplingParams(2))  # two staging rows: full
    engine.step()
    engine.step()
    assert second.tokens and third.tokens and first.finish_reason is None
    drain(engine)


def test_penalties_and_logit_bias_follow_openais_rule(model, engine):
    """Greedy with penalties and a bias: each token is the argmax of the model's logits
    (its full forward, float32) less presence * (count > 0) + frequency * count over the
    new tokens so far, plus the bias (a NumPy reference of the rule)."""
    prompt = list(b"aaaa bbbb aaaa")
    presence, frequency, bias = 0.7, 0.4, {ord("a"): 1.5, ord(" "): -2.0}
    seq = engine.submit(prompt, SamplingParams(10, presence_penalty=presence,
                                               frequency_penalty=frequency,
                                               logit_bias=tuple(bias.items())))
    drain(engine)
    # The forward is causal: one pass gives the logits before every new token.
    logits = np.asarray(model(jnp.asarray([prompt + seq.tokens]))[0, len(prompt) - 1:-1, :256],
                        np.float64)
    counts = np.zeros(256)
    for token, row in zip(seq.tokens, logits):
        row = row - presence * (counts > 0) - frequency * counts
        for t, b in bias.items():
            row[t] += b
        assert token == int(np.argmax(row))
        counts[token] += 1
    [unbiased] = generated(model, [(prompt, SamplingParams(10))])
    assert seq.tokens != unbiased  # the rule changed the tokens


def test_a_prefix_cache_hit_prefills_only_the_rest_and_equals_a_full_prefill(model):
    """Two prompts sharing 70 tokens: the second starts from the first's state after 64
    (two chunks) and prefills only its own tokens; its tokens and logprobs equal those of
    an engine without the cache."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 256, 70).tolist()
    prompts = [shared + [1, 2, 3], shared + rng.integers(0, 256, 20).tolist()]
    params = SamplingParams(6, temperature=0.9, seed=11, logprobs=3)
    out = {}
    for cache_mb in (1.0, 0.0):
        engine = Engine(model, None, Limits(max_prompt_tokens=96, max_new_tokens=12),
                        **{**OPTIONS, "prefix_cache_mb": cache_mb})
        seqs = []
        for prompt in prompts:
            seqs.append(engine.submit(prompt, params))
            drain(engine)
        out[cache_mb] = seqs, engine.stats()
    (cached, stats), (full, no_cache) = out[1.0], out[0.0]
    assert (stats["prefix_cache_hits"], stats["prefix_cache_lookups"]) == (1, 2)
    assert stats["prefix_cache_entries"] == 2  # after 32 and 64 of the shared tokens
    # the second prompt's 89 tokens before its last: a chunk of 16 from 64 on (the 9 after
    # it go to the decode steps), not chunks of 32, 32 and 16
    assert (stats["prefill_tokens"], no_cache["prefill_tokens"]) == (64 + 16, 64 + 80)
    for seq, reference, prompt in zip(cached, full, prompts):
        assert seq.tokens == reference.tokens
        lp = lambda s: np.asarray([[e.logprob, *(p for _, p in e.top_logprobs)]
                                   for e in s.events])
        np.testing.assert_allclose(lp(seq), lp(reference), atol=1e-5)
        assert [[i for i, _ in e.top_logprobs] for e in seq.events] == \
            [[i for i, _ in e.top_logprobs] for e in reference.events]
    # the raw logits' log-probabilities of the tokens, as scoring gives them
    chosen, _ = token_logprobs(model, np.asarray([prompts[1] + cached[1].tokens]))
    np.testing.assert_allclose([e.logprob for e in cached[1].events],
                               np.asarray(chosen)[0, len(prompts[1]) - 1:], atol=1e-4)


def test_the_prefix_cache_evicts_the_least_recently_used_past_its_bound():
    entry = lambda: (np.zeros(256, np.float32),)  # 1 KiB
    cache = _PrefixCache(max_bytes=3 * 1024, chunk=2)
    ids = [[i, i, i, i] for i in range(4)]
    for i in range(3):
        cache.put(ids[i], 2, entry())
    assert cache.find(ids[0] + [9], 4)[0] == 2  # used: now the most recent
    cache.put(ids[3], 2, entry())
    assert cache.bytes == 3 * 1024 and len(cache.entries) == 3
    assert [cache.find(i, 4)[0] for i in ids] == [2, 0, 2, 2]  # ids[1] evicted
    assert cache.find([0, 0, 7, 7], 4)[0] == 2 and cache.find([0, 7], 2)[0] == 0


def test_a_hybrids_attention_keys_are_bounded_and_continue_across_chunks():
    """A hybrid with attention: a prompt longer than a chunk and one from a cached prefix
    equal generate (their keys moved into the slot), and a request whose prompt and new
    tokens pass the keys a slot holds is refused, naming the bound."""
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, chunk_size=16,
                              vocab_size=256, layer_pattern="M*-", n_layer=3, **{
                                  "attention.num_heads": 2, "attention.num_heads_kv": 1,
                                  "attention.head_dim": 16, "attention.rotary_emb_dim": 8,
                                  "mlp.d_intermediate": 32})
    hybrid = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    engine = Engine(hybrid, None, LIMITS, **{**OPTIONS, "kv_tokens": 60})
    assert engine.memory()["kv_tokens"] == 60
    with pytest.raises(ValueError, match="need 61 attention key slots; this server holds 60"):
        engine.submit(list(range(50)), SamplingParams(11))
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [shared + [5, 6], list(b"Hi"), shared + [7, 8, 9]]
    seqs = []
    for prompt in prompts:
        seqs.append(engine.submit(prompt, SamplingParams(8)))
        engine.step()
    drain(engine)
    assert engine.stats()["prefix_cache_hits"] == 1
    assert [s.tokens for s in seqs] == generated(hybrid, [(p, SamplingParams(8))
                                                          for p in prompts])


def test_a_learned_initial_state_starts_every_prompt_unpadded():
    """A model whose Mamba layers start from a learned state: its prompts are never
    left-padded (the state would enter the padding), so each equals generate alone; nor are
    the sequences it scores (echo's and Megatron's logprobs: every such request was a 500),
    each scored as token_logprobs scores it alone."""
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, chunk_size=16,
                              vocab_size=256, **{"mamba2.learnable_init_state": True})
    learned = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    learned.layers[0].mixer.init_states[...] += 0.5
    engine = Engine(learned, None, LIMITS, **OPTIONS)
    prompts = [list(b"a prompt of 20 tokens"), list(b"Hi")]
    seqs = [engine.submit(p, SamplingParams(5)) for p in prompts]
    drain(engine)
    for prompt, seq in zip(prompts, seqs):  # each alone: generate would pad the shorter
        assert seq.tokens == generated(learned, [(prompt, SamplingParams(5))])[0]
    scored = asyncio.run(engine.score([p + s.tokens for p, s in zip(prompts, seqs)] + [[7]],
                                      top_n=2))
    assert scored[-1] == []  # one token: nothing to score
    for prompt, seq, got in zip(prompts, seqs, scored):
        chosen, (top_logp, top_ids) = token_logprobs(learned, np.asarray([prompt + seq.tokens]),
                                                     top_n=2)
        np.testing.assert_allclose([lp for lp, _ in got], np.asarray(chosen)[0], atol=1e-5)
        assert [[i for i, _ in top] for _, top in got] == np.asarray(top_ids)[0].tolist()


def test_layers_that_cannot_continue_a_state_prefill_each_prompt_as_one_chunk():
    """Mamba-1 layers take no initial state: a prompt longer than a chunk is prefilled in
    one (left-padded), and there is no prefix cache; the tokens equal generate's."""
    mamba1 = Mamba2LM(Mamba2Config.preset("tiny-mamba1", d_model=64), rngs=nnx.Rngs(0))
    engine = Engine(mamba1, None, LIMITS, **OPTIONS)
    assert not engine.continuable and engine.prefix is None
    requests = [(list(range(40)), SamplingParams(5)), ([7, 8, 9], SamplingParams(5))]
    seqs = [engine.submit(*r) for r in requests]
    drain(engine)
    assert engine.stats()["prefill_tokens"] == 39 + 2
    assert [s.tokens for s in seqs] == generated(mamba1, requests)
