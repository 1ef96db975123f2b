import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mamba_jax
from mamba_jax import Mamba2Config, Mamba2LM
from mamba_jax.data import DEFAULT_CORPUS
from mamba_jax.generate import (DECODE_COMPILER_OPTIONS, _jit_decode, _prefill, prefill,
                                prepare, sample_logits, token_logprobs)
from mamba_jax.generate.plan import decode_plan, resolve_implementation
from pallas_kernels import fallback
from pallas_kernels.ssd.step import Int8State


def compiled():
    """How many programs generate's prefill and decode loop have compiled."""
    decode = _jit_decode(tuple(sorted(DECODE_COMPILER_OPTIONS.items())))
    return _prefill._cache_size(), decode._cache_size()


@pytest.fixture(scope="module")
def model():
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, chunk_size=16,
                              vocab_size=250)  # 6 padding rows in the vocabulary
    return Mamba2LM(cfg, rngs=nnx.Rngs(0))


def test_greedy_equals_repeated_argmax_of_the_full_forward(model):
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 250, (2, 7)))
    out = mamba_jax.generate(model, prompt, max_new_tokens=9)
    assert out.shape == (2, 16) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :7], prompt)
    # The forward is causal: one pass over the output gives every prefix's next token.
    np.testing.assert_array_equal(jnp.argmax(model(out[:, :-1])[:, 6:, :250], axis=-1),
                                  out[:, 7:])


def test_decoding_compiles_once_for_any_prompt_content(model):
    prompt = jnp.zeros((1, 5), jnp.int32)
    mamba_jax.generate(model, prompt, max_new_tokens=6, temperature=0.7, seed=1)
    before = compiled()
    for seed in range(3):
        mamba_jax.generate(model, prompt + seed, max_new_tokens=6, temperature=0.7 + seed,
                           seed=seed)
    assert compiled() == before


def test_another_model_of_the_same_structure_reuses_the_programs_and_stays_as_it_was(model):
    # The model reaches both programs as a pytree: its treedef keys their compile caches,
    # and the decode loop's casts act on the traced copy only.
    prompt = jnp.zeros((1, 5), jnp.int32)
    mamba_jax.generate(model, prompt, max_new_tokens=4)
    before = compiled()
    other = Mamba2LM(model.config, rngs=nnx.Rngs(1))
    params = [(np.asarray(v), v.dtype) for v in jax.tree_util.tree_leaves(nnx.state(other))]
    out = mamba_jax.generate(other, prompt, max_new_tokens=4)
    assert compiled() == before
    after = jax.tree_util.tree_leaves(nnx.state(other))
    assert all(v.dtype == dtype and np.array_equal(np.asarray(v), value)
               for (value, dtype), v in zip(params, after))
    np.testing.assert_array_equal(  # and it generated with its own weights
        jnp.argmax(other(out[:, :-1])[:, 4:, :250], axis=-1), out[:, 5:])


def test_sampling_is_seeded_and_never_picks_padding_rows(model):
    prompt = jnp.zeros((4, 3), jnp.int32)
    a = mamba_jax.generate(model, prompt, max_new_tokens=20, temperature=5.0, seed=3)
    b = mamba_jax.generate(model, prompt, max_new_tokens=20, temperature=5.0, seed=3)
    c = mamba_jax.generate(model, prompt, max_new_tokens=20, temperature=5.0, seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert int(a.max()) < 250


def test_a_model_loaded_to_generate_samples_only_its_tokenizers_ids(tmp_path):
    """An HF export keeps the embedding's padded rows as its vocab_size (250 ids padded to
    256 say 256); loaded with a tokenizer of 250 ids, generation never samples the 6 it
    cannot decode, and the weights keep their rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mamba_jax.generate import load_for_generation
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, vocab_size=256)
    mamba_jax.save_pretrained(Mamba2LM(cfg, rngs=nnx.Rngs(0)), tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(250)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded, tokenizer, _ = load_for_generation(tmp_path)
    assert tokenizer.get_vocab_size() == 250 and loaded.config.vocab_size == 250
    assert loaded.config.padded_vocab_size == 256 and loaded.embedding.shape == (256, 64)
    new = mamba_jax.generate(loaded, jnp.zeros((8, 3), jnp.int32), max_new_tokens=64,
                             temperature=1e4, seed=0)
    assert int(np.asarray(new).max()) < 250
    assert int(np.asarray(new).max()) > 200  # the temperature reaches the top ids


def test_eos_stops_each_row_and_pads_with_eos(model):
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 250, (2, 4)))
    free = np.asarray(mamba_jax.generate(model, prompt, max_new_tokens=8))
    eos = int(free[0, 6])  # the third generated token of row 0
    out = np.asarray(mamba_jax.generate(model, prompt, max_new_tokens=8, eos_token_id=eos))
    stop = 4 + list(free[0, 4:]).index(eos)
    np.testing.assert_array_equal(out[0, :stop + 1], free[0, :stop + 1])
    assert np.all(out[0, stop:] == eos)


def test_top_k_keeps_only_the_k_most_likely():
    logits = jnp.asarray([[0.0, 5.0, 4.0, -1.0, 4.5]])
    draws = {int(sample_logits(logits, jax.random.key(s), 1.0, top_k=2)[0]) for s in range(64)}
    assert draws == {1, 4}


def test_extreme_temperatures_keep_the_order_of_the_logits():
    # The filters ran on logits / temperature: at 1e38 every one rounded to 0 (top_k kept
    # all), and at 2e-38 the two largest overflowed to inf (their tie drew the first).
    logits = jnp.asarray([[1.0, 9.0, 3.0, 8.0, 2.0]])
    huge = {int(sample_logits(logits, jax.random.key(s), 1e38, top_k=2)[0]) for s in range(64)}
    assert huge == {1, 3}
    tiny = {int(sample_logits(logits, jax.random.key(s), 2e-38)[0]) for s in range(16)}
    assert tiny == {1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = jnp.asarray([[0.5, 0.3, 0.15, 0.05]])
    logits = jnp.log(probs)
    draws = {int(sample_logits(logits, jax.random.key(s), 1.0, top_p=0.75)[0])
             for s in range(128)}
    assert draws == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75
    only_best = {int(sample_logits(logits, jax.random.key(s), 1.0, top_p=0.1)[0])
                 for s in range(16)}
    assert only_best == {0}


def test_a_top_p_below_float32s_normal_range_keeps_the_most_likely_token():
    # 1e-40 is a float32 denormal, which XLA flushes to zero: the filter must still keep the
    # most likely token (it kept none, and the draw fell to token 0)
    logits = jnp.asarray([[0.0, 5.0, 4.0, -1.0], [1.0, 0.0, 3.0, 2.0]])
    draws = {tuple(np.asarray(sample_logits(logits, jax.random.key(s), 1.0, top_p=1e-40)))
             for s in range(16)}
    assert draws == {(1, 2)}


def test_megatrons_top_p_decay_and_banned_token_after_another():
    """The sampler as the decode loop calls it at new token `step` after `previous`: top_p
    shrinks to max(top_p * decay**step, bound); the banned token never follows `after`."""
    from mamba_jax.generate import Sampling, Settings, _sample

    sample = jax.jit(_sample, static_argnums=3)
    rows = 256  # one row per draw: each row samples on its own
    logits = jnp.log(jnp.tile(jnp.asarray([[0.4, 0.35, 0.25]]), (rows, 1)))
    off = np.full(rows, -1, np.int32)
    settings = Settings(np.ones(rows, np.float32), np.zeros(rows, np.int32),
                        np.full(rows, 0.9, np.float32), np.full(rows, 0.5, np.float32),
                        np.full(rows, 0.2, np.float32), off, off)
    sampling = Sampling(greedy=False, top_k=False, top_p=True, top_p_decay=True)
    draws = [set(np.asarray(sample(logits, jax.random.key(step), settings, sampling, step,
                                   off)).tolist()) for step in range(3)]
    # top_p 0.9, then 0.45 (0.4 < 0.45 keeps two), then max(0.225, 0.2) (one).
    assert draws == [{0, 1, 2}, {0, 1}, {0}]
    ban = settings._replace(ban_after=np.full(rows, 7, np.int32),
                            ban_token=np.zeros(rows, np.int32))
    greedy = Sampling(greedy=True, top_k=False, top_p=False, banned_after=True)
    after = lambda previous: set(np.asarray(sample(
        logits, jax.random.key(0), ban, greedy, 0, np.full(rows, previous))).tolist())
    assert after(7) == {1} and after(6) == {0}  # token 0 is banned only after token 7


def test_penalties_and_logit_bias_and_a_seed_per_row(model):
    """Greedy rows with OpenAI's penalties and a logit bias take the argmax of the logits
    less presence * (count > 0) + frequency * count over their new tokens so far, plus the
    bias (a NumPy reference); a row with a seed of its own samples as it does alone."""
    prompt = np.asarray([[5, 6, 7, 5, 6, 7], [9, 9, 9, 9, 9, 9]])
    presence, frequency, bias = [0.0, 0.8], [0.0, 0.5], [None, {9: 2.0, 3: -1.0}]
    out = np.asarray(mamba_jax.generate(model, prompt, 8, presence_penalty=presence,
                                        frequency_penalty=frequency, logit_bias=bias))
    logits = np.asarray(model(jnp.asarray(out[:, :-1]))[:, 5:, :250], np.float64)
    np.testing.assert_array_equal(out[0, 6:], logits[0].argmax(-1))  # row 0: no rule
    counts = np.zeros(250)
    for token, row in zip(out[1, 6:], logits[1]):
        row = row - presence[1] * (counts > 0) - frequency[1] * counts
        row[9] += 2.0
        row[3] -= 1.0
        assert token == row.argmax()
        counts[token] += 1
    both = mamba_jax.generate(model, prompt, 6, temperature=2.0, seed=[3, 4])
    alone = mamba_jax.generate(model, prompt[1:], 6, temperature=2.0, seed=4)
    np.testing.assert_array_equal(both[1], alone[0])


def test_left_padded_batch_equals_each_row_generated_alone(model):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 250, n) for n in (9, 2, 5)]  # 2 < d_conv - 1 pads to read
    padded = np.full((3, 9), 7, np.int32)  # a pad id that would change the state if read
    for row, prompt in zip(padded, prompts):
        row[9 - len(prompt):] = prompt
    out = np.asarray(mamba_jax.generate(model, padded, max_new_tokens=8,
                                        prompt_lengths=[len(p) for p in prompts]))
    for row, prompt in zip(out, prompts):
        alone = mamba_jax.generate(model, jnp.asarray(prompt)[None], max_new_tokens=8)
        np.testing.assert_array_equal(row[9:], np.asarray(alone)[0, len(prompt):])


def test_per_row_settings_and_limits_match_separate_calls(model):
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, 250, (2, 5)))
    out = mamba_jax.generate(model, prompt, max_new_tokens=6, temperature=[0.0, 0.0],
                             top_k=[3, 250], max_new_tokens_per_row=[6, 2])
    greedy = mamba_jax.generate(model, prompt, max_new_tokens=6)
    np.testing.assert_array_equal(out[0], greedy[0])
    np.testing.assert_array_equal(out[1, :7], greedy[1, :7])
    assert np.all(np.asarray(out[1, 7:]) == 0)  # past its limit: the pad id


def test_streaming_delivers_every_step_in_order(model):
    prompt = jnp.asarray(np.random.default_rng(4).integers(0, 250, (2, 4)))
    seen = []
    out = mamba_jax.generate(model, prompt, max_new_tokens=7, temperature=1.0, seed=5,
                             on_token=lambda step, tokens: seen.append((step, tokens.tolist())))
    assert [step for step, _ in seen] == list(range(7))
    np.testing.assert_array_equal(np.asarray([t for _, t in seen]).T, out[:, 4:])

    def on_token(step, tokens):  # a caller's stream that fails at its third token
        seen.append(step)
        if step == 2:
            raise ConnectionResetError("client gone")
    seen = []
    with pytest.raises(ConnectionResetError, match="client gone"):
        mamba_jax.generate(model, prompt, max_new_tokens=7, on_token=on_token)
    assert seen == [0, 1, 2]  # and none after it
    seen = []  # the next stream is its own
    mamba_jax.generate(model, prompt, max_new_tokens=3, on_token=lambda step, _: seen.append(step))
    assert seen == [0, 1, 2]


def test_nan_logits_are_an_error_naming_the_row_and_token_never_a_token():
    """A row whose logits are NaN (here: once it has read a token whose embedding is NaN)
    ends generate with a ValueError naming the row and new token, where argmax picked token
    0 from them; its stream gets padding from there; token_logprobs names the position."""
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, chunk_size=16,
                              vocab_size=250, tie_embeddings=False)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(3).integers(0, 250, (2, 5))
    new = np.asarray(mamba_jax.generate(model, prompt, max_new_tokens=8))[:, 5:]
    # a token that row 1 samples as new token j, and neither prompt holds nor row 0 samples
    j, k = next((j, int(t)) for j, t in enumerate(new[1][:6])
                if t not in prompt and t not in new[0])
    model.embedding.value = model.embedding.value.at[k].set(jnp.nan)
    seen = []
    with pytest.raises(ValueError, match=rf"generate: the model's logits are NaN \(row 1, "
                                         rf"new token {j + 1}\): .* --dtype float32"):
        mamba_jax.generate(model, prompt, 8, on_token=lambda _, tokens: seen.append(tokens))
    np.testing.assert_array_equal(np.asarray(seen).T, [new[0], [*new[1][:j + 1], *[0] * (7 - j)]])
    # in both prompts: the prefill's logits, both rows
    both = np.concatenate([prompt, [[k], [k]]], axis=1)
    with pytest.raises(ValueError, match=r"NaN \(row 0, new token 0, and 1 more row\(s\)\)"):
        mamba_jax.generate(model, both, 4, temperature=1.0, top_p=0.9)
    # row 1 reads k at position 5 + j (a NaN reaches the chunk's earlier positions too:
    # 0 x NaN in the chunk's masked products)
    ids = np.concatenate([prompt, new], axis=1)
    with pytest.raises(ValueError, match=r"token_logprobs: .*NaN \(row 1, position \d+\)"):
        token_logprobs(model, ids)
    assert np.all(np.isfinite(token_logprobs(model, ids[:1])[0]))  # row 0 never reads k


def test_bfloat16_state_cache_keeps_its_dtype_and_follows_the_float32_one(model):
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 250, (2, 14)))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).step(t, c))
    _, cache32 = model.prefill(ids[:, :4])
    cache16 = tuple(c._replace(ssm_state=c.ssm_state.astype(jnp.bfloat16)) for c in cache32)
    worst = 0.0
    for t in range(4, 14):  # the same tokens into both caches
        logits32, cache32 = step(state, ids[:, t], cache32)
        logits16, cache16 = step(state, ids[:, t], cache16)
        assert all(c.ssm_state.dtype == jnp.bfloat16 for c in cache16)
        assert np.all(np.isfinite(logits16))
        worst = max(worst, float(jnp.max(jnp.abs(logits16 - logits32))))
    # bf16 rounds the state to 2**-9 relative at every token; logits of about 0.5 moved by
    # at most 3.7e-5 here (nonzero: the cache is really rounded).
    assert 0.0 < worst < 1e-3, worst
    out = mamba_jax.generate(model, ids[:, :4], max_new_tokens=5, ssm_state_dtype="bfloat16")
    assert out.shape == (2, 9)


TRAINED = Path(__file__).parent / "fixtures" / "trained_tiny"  # make_trained_tiny.py


def test_int8_states_generate_what_float32_states_do_on_a_trained_model():
    """A byte-level model trained on the bundled corpus (fixtures/trained_tiny), greedy from
    four 32-byte prompts of that corpus: 64 new tokens with int8 states equal float32's.
    Along them, each step's logits with the int8 cache are within 0.15 of float32's (about
    1.5% of the largest logit, 10; measured 0.033 worst, bf16 states 0.009), and not equal
    (the cache is really quantised)."""
    model = mamba_jax.from_pretrained(TRAINED)
    text = DEFAULT_CORPUS.read_bytes()
    prompts = np.stack([np.frombuffer(text[at:at + 32], np.uint8)
                        for at in (1000, 30000, 60000, 90000)]).astype(np.int32)
    ours = mamba_jax.generate(model, prompts, 64, ssm_state_dtype="int8")
    np.testing.assert_array_equal(ours, mamba_jax.generate(model, prompts, 64))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).step(t, c))
    _, cache32 = jax.jit(lambda s, ids: nnx.merge(graphdef, s).prefill(ids))(state, prompts)
    cache8 = model.cache_for_decoding(cache32, ("xla",) * len(model.layers), "int8")
    worst = 0.0
    for t in range(32, 32 + 63):  # the generated tokens into both caches
        logits32, cache32 = step(state, ours[:, t], cache32)
        logits8, cache8 = step(state, ours[:, t], cache8)
        assert all(c.ssm_state.dtype == jnp.int8 for c in cache8)
        assert np.all(np.isfinite(logits8))
        worst = max(worst, float(jnp.max(jnp.abs(logits8 - logits32))))
    assert 0.0 < worst < 0.15, worst


def test_the_prefill_hands_over_the_cache_as_the_plan_and_state_dtype_ask(model):
    # generate's two programs, one at a time: the cache leaves the prefill with its SSM
    # states in the asked dtype (int8: values and a float32 scale per headdim channel), and
    # with the cooperative kernel's counter where a layer's step is "fused", which an int8
    # cache never is.
    ids = jnp.zeros((1, 5), jnp.int32)
    for implementation, dtype, how in (("xla", "bfloat16", "xla"),
                                       ("triton", "float32", "fused"),
                                       ("triton", "int8", "kernel")):
        prepared = prepare(model, ids, 4, ssm_state_dtype=dtype,
                           step_implementation=implementation)
        _, cache = prefill(model, ids, prepared)
        assert prepared.plan.steps == (how,) * len(model.layers)
        for c in cache:
            assert c.ssm_state.dtype == jnp.dtype(dtype)
            assert (c.sync is not None) == (how == "fused")
        if dtype == "int8":
            assert all(isinstance(c.ssm_state, Int8State) for c in cache)
            assert cache[0].ssm_state.scale.shape == cache[0].ssm_state.shape[:3]


# batch 1: the fused step (plan.FUSED_STEP_MAX_BATCH); batch 2: the step kernel alone
@pytest.mark.parametrize("batch", [1, 2])
def test_the_step_kernels_generate_what_the_xla_step_does(model, batch):
    prompt = jnp.asarray(np.random.default_rng(7).integers(0, 250, (batch, 5)))
    ours = mamba_jax.generate(model, prompt, max_new_tokens=6, step_implementation="triton")
    np.testing.assert_array_equal(ours, mamba_jax.generate(model, prompt, max_new_tokens=6))


@pytest.mark.parametrize("ngroups,dtype", [(1, jnp.float32), (2, jnp.float32),
                                            (1, jnp.bfloat16)])
def test_the_step_kernel_normalises_after_out_proj_as_the_xla_step_before_it(ngroups, dtype):
    """The "kernel" step (batch 3) takes the gated norm's rstd from the kernel's sums of
    squares and multiplies out_proj's product by it, per norm group (ngroups 2: two groups'
    products scaled apart, then summed). Each step from the XLA step's cache: float32 logits
    within 1e-4 of the XLA step's (the same products in another order); bf16 within 2e-2
    (the normed y rounded to bf16 before out_proj, against y times the weight rounded)."""
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, chunk_size=16,
                              ngroups=ngroups, vocab_size=250)
    model = Mamba2LM(cfg, rngs=nnx.Rngs(4), dtype=dtype)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 250, (3, 11)))
    assert decode_plan(model, 3, "triton").steps == ("kernel",) * len(model.layers)
    _, cache = nnx.jit(lambda model, ids: model.prefill(ids, cache_len=11))(model, ids[:, :8])
    step = nnx.jit(lambda model, token, cache, steps: model.step(token, cache, steps=steps),
                   static_argnums=3)
    for t in range(8, 11):
        logits, new_cache = step(model, ids[:, t], cache, ("xla",) * len(model.layers))
        logits_k, _ = step(model, ids[:, t], cache, ("kernel",) * len(model.layers))
        assert np.all(np.isfinite(logits_k))
        np.testing.assert_allclose(logits_k, logits, rtol=0,
                                   atol=1e-4 if dtype == jnp.float32 else 2e-2)
        cache = new_cache


def test_auto_takes_the_step_kernels_on_a_gpu_only(monkeypatch, caplog):
    model = nnx.eval_shape(lambda: Mamba2LM(Mamba2Config.preset("tiny"), rngs=nnx.Rngs(0)))
    assert resolve_implementation("auto", model, backend="gpu") == "triton"
    assert resolve_implementation("auto", model, backend="cpu") == "xla"
    # Headdim 80 (Nemotron Nano 2's) runs in blocks of 16: the kernels.
    nano = nnx.eval_shape(lambda: Mamba2LM(Mamba2Config.preset("tiny", d_model=80, headdim=80),
                                           rngs=nnx.Rngs(0)))
    assert resolve_implementation("auto", nano, backend="gpu") == "triton"
    # A headdim the step kernel cannot take (not a multiple of 16): XLA's step, said once.
    odd = nnx.eval_shape(lambda: Mamba2LM(Mamba2Config.preset("tiny", d_model=48, headdim=24),
                                          rngs=nnx.Rngs(0)))
    monkeypatch.setattr(fallback, "_said", set())  # what earlier tests had said
    with caplog.at_level("WARNING", logger="pallas_kernels.fallback"):
        assert resolve_implementation("auto", odd, backend="gpu") == "xla"
        assert resolve_implementation("auto", odd, backend="gpu") == "xla"
    said = [r.getMessage() for r in caplog.records if r.name == "pallas_kernels.fallback"]
    assert len(said) == 1 and all("mamba2 step kernels" in m and "headdim=24" in m
                                  for m in said)
    assert resolve_implementation("triton", model, backend="cpu") == "triton"
    # The plan: every layer fused at batch 1, the step kernel at batch 2, XLA under "xla".
    assert decode_plan(model, 1, "triton").steps == ("fused", "fused")
    assert decode_plan(model, 2, "triton").steps == ("kernel", "kernel")
    assert decode_plan(model, 1, "triton", ssm_state_dtype="int8").steps == ("kernel",
                                                                             "kernel")
    assert decode_plan(model, 1, "auto", backend="cpu").steps == ("xla", "xla")


def test_the_plan_takes_a_kinds_step_kernel_up_to_its_batch_only():
    # Mamba-3's step kernel was slower than XLA's step above batch 8 on an H200
    # (Mamba3Mixer.step_kernel_max_batch): its layers take XLA's step there, where a Mamba-2
    # layer of the same model keeps its kernel.
    model = nnx.eval_shape(lambda: Mamba2LM(Mamba2Config.preset("mamba3-tiny",
                                                                 layer_pattern="3M"),
                                            rngs=nnx.Rngs(0)))
    assert decode_plan(model, 1, "triton").steps == ("fused", "fused")
    assert decode_plan(model, 8, "triton").steps == ("kernel", "kernel")
    assert decode_plan(model, 9, "triton").steps == ("xla", "kernel")


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=-1), "top_k=-1"), (dict(top_p=1.5), "top_p=1.5"),
    (dict(prompt_lengths=[4]), "prompt_lengths=\\[4\\]"),
    (dict(temperature=[1.0, 1.0]), "temperature has shape \\(2,\\)"),
    (dict(ssm_state_dtype="float16"), "ssm_state_dtype='float16'"),
    (dict(step_implementation="cuda"), "step_implementation='cuda'"),
    (dict(temperature=1.0, top_p_decay=0.5), "top_p_decay=0.5 and top_p_bound=None change "
                                              "top_p, which is None"),
    (dict(temperature=1.0, top_p_bound=0.1), "top_p_bound=0.1 change top_p")])
def test_bad_arguments_are_named(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mamba_jax.generate(model, jnp.zeros((1, 3), jnp.int32), **{"max_new_tokens": 2,
                                                                      **kwargs})


def test_token_ids_outside_the_vocabulary_are_refused_but_left_padding_is_not_read(model):
    rows = model.config.padded_vocab_size
    for ids in ([[1, rows, 2]], [[1, -1, 2]]):
        with pytest.raises(ValueError, match=f"input_ids hold \\[{ids[0][1]}\\], outside the "
                                             f"model's token ids \\[0, {rows}\\)"):
            mamba_jax.generate(model, jnp.asarray(ids, jnp.int32), 2)
    with pytest.raises(ValueError, match="input_ids must be integer token ids, got float32"):
        mamba_jax.generate(model, jnp.asarray([[1.0, 2.0]]), 2)
    # Scoring too (its NaN check blamed the weights), and its other arguments (errors of
    # numpy, jax's top_k or the conv, or truncated lengths)
    with pytest.raises(ValueError, match=f"token_logprobs: input_ids hold \\[{rows}\\]"):
        token_logprobs(model, jnp.asarray([[1, rows, 2]], jnp.int32))
    ids = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    for args, match in [((ids[:, :1],), r"input_ids must be \[batch, seqlen >= 2\]"),
                        ((ids[0],), r"input_ids must be \[batch, seqlen >= 2\]"),
                        ((ids, [3, 2, 1]), r"lengths=\[3, 2, 1\] must be 2 integers in "
                                           r"\[1, seqlen=3\]"),
                        ((ids, [2.5, 3]), r"lengths=\[2.5, 3.0\] must be 2 integers"),
                        ((ids, [0, 3]), r"lengths=\[0, 3\] must be"),
                        ((ids, None, -1), r"top_n=-1 must be in \[0, vocab_size=")]:
        with pytest.raises(ValueError, match=f"token_logprobs: {match}"):
            token_logprobs(model, *args)
    # Left padding before each row's prompt is never read, whatever it holds.
    padded = mamba_jax.generate(model, jnp.asarray([[-1, 5, 6], [4, 5, 6]], jnp.int32), 2,
                                prompt_lengths=[2, 3])
    alone = mamba_jax.generate(model, jnp.asarray([[5, 6]], jnp.int32), 2)
    np.testing.assert_array_equal(padded[0, -2:], alone[0, -2:])


def test_generate_cli_prints_the_prompt_and_its_continuation(tmp_path, capsys):
    from mamba_jax.tokenizer import byte_tokenizer
    from mamba_jax.generate.__main__ import main

    byte_model = Mamba2LM(Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16),
                          rngs=nnx.Rngs(0))
    mamba_jax.save_pretrained(byte_model, tmp_path)
    with pytest.raises(SystemExit, match="--tokenizer bytes"):
        main(["--checkpoint", str(tmp_path), "--prompt", "Hi"])
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    main(["--checkpoint", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "5"])
    expected = mamba_jax.generate(byte_model, jnp.asarray([list(b"Hello")]), 5)
    printed = capsys.readouterr().out
    assert printed == byte_tokenizer().decode(expected[0].tolist()) + "\n"
    options = dict(ssm_state_dtype="bfloat16", step_implementation="triton")
    main(["--checkpoint", str(tmp_path), "--prompt", "Hello", "--max-new-tokens", "5",
          "--ssm-state-dtype", "bfloat16", "--step-implementation", "triton"])
    expected = mamba_jax.generate(byte_model, jnp.asarray([list(b"Hello")]), 5, **options)
    assert capsys.readouterr().out == byte_tokenizer().decode(expected[0].tolist()) + "\n"


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    """A tiny byte-level model dir and the model in it."""
    from mamba_jax.tokenizer import byte_tokenizer

    path = tmp_path_factory.mktemp("bytes")
    byte_model = Mamba2LM(Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16),
                          rngs=nnx.Rngs(0))
    mamba_jax.save_pretrained(byte_model, path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("flags,refusal", [
    (["--max-new-tokens", "1000000000"],
     r"--max-new-tokens=1000000000 must be an integer in \[1, 1048576\]"),
    (["--max-new-tokens", "0"], r"--max-new-tokens=0 must be an integer in \[1, 1048576\]"),
    (["--temperature", "nan"], r"--temperature=nan must be a finite number >= 0"),
    (["--temperature", "inf"], r"--temperature=inf must be a finite number >= 0"),
    (["--top-k", "99999999999"], r"--top-k=99999999999 must be an integer >= 0, at most the "
                                 r"vocabulary"),
    (["--top-k", "257"], r"--top-k=257 must be at most the vocabulary, 256 \(0 is off\)"),
    (["--top-p", "1.5"], r"--top-p=1.5 must be a number in \(0, 1\]"),
    (["--top-p", "0"], r"--top-p=0.0 must be a number in \(0, 1\]"),
])
def test_generate_cli_refuses_what_it_cannot_run_in_one_line(byte_checkpoint, flags, refusal,
                                                             capsys):
    from mamba_jax.generate.__main__ import main

    with pytest.raises(SystemExit, match=refusal) as refused:
        main(["--checkpoint", str(byte_checkpoint), "--prompt", "Hi", *flags])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("name,refusal", [("config.json", "a file, not a folder"),
                                          ("absent", "no such directory")])
def test_generate_cli_names_a_checkpoint_that_is_no_folder(byte_checkpoint, name, refusal,
                                                          capsys):
    from mamba_jax.generate.__main__ import main

    with pytest.raises(SystemExit, match=refusal) as refused:
        main(["--checkpoint", str(byte_checkpoint / name), "--prompt", "Hi"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_generate_cli_names_a_folder_without_a_model_by_its_config(tmp_path, capsys):
    from mamba_jax.generate.__main__ import main

    with pytest.raises(SystemExit, match="config.json not found: a checkpoint dir needs "
                       "config.json") as refused:  # not a missing tokenizer.json
        main(["--checkpoint", str(tmp_path), "--prompt", "Hi"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("url,why", [("notaurl", "no http:// or https:// before the address"),
                                     ("127.0.0.1:9", "no http:// or https:// before the address"),
                                     ("http://127.0.0.1:9", "cannot reach it")])
def test_generate_cli_names_a_server_it_cannot_reach(url, why, capsys):
    from mamba_jax.generate.__main__ import main

    with pytest.raises(SystemExit, match=f"--server {url}: {why}") as refused:
        main(["--server", url, "--prompt", "Hi"])
    assert refused.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.out == ""  # no prompt echoed first


def test_generate_cli_names_a_prompt_not_in_utf8_and_a_step_of_a_checkpoint_dir(
        byte_checkpoint, tmp_path, capsys):
    from mamba_jax.generate.__main__ import main

    # b"caf\xff" as Python gives a command line's bytes that are not UTF-8 (a traceback)
    with pytest.raises(SystemExit, match=r"--prompt holds bytes that are not UTF-8 text "
                                         r"\(b'\\xff'\); give it in UTF-8") as refused:
        main(["--checkpoint", str(byte_checkpoint), "--prompt", "caf\udcff"])
    assert refused.value.code == 2
    step = tmp_path / "ck" / "10"  # a trainer's step folder (it was "config.json not found")
    step.mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(SystemExit, match=rf"--checkpoint {step} is step 10 of the trainer's "
                                         rf"--checkpoint-dir {step.parent}: give that folder"):
        main(["--checkpoint", str(step), "--prompt", "Hi"])


def test_generate_cli_prints_nothing_after_the_end_of_text_token(byte_checkpoint, tmp_path,
                                                                 capsys):
    from mamba_jax.generate.__main__ import main

    model = mamba_jax.from_pretrained(byte_checkpoint)
    first = int(mamba_jax.generate(model, jnp.asarray([list(b"Hello")]), 1)[0, -1])
    shutil.copytree(byte_checkpoint, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "eos_token_id": first}))
    main(["--checkpoint", str(tmp_path / "m"), "--prompt", "Hello", "--max-new-tokens", "6"])
    assert capsys.readouterr().out == "Hello\n"  # was Hello and six of the end token


def test_top_k_0_is_off_as_documented(byte_checkpoint, capsys):
    from mamba_jax.generate.__main__ import main

    sampled = ["--checkpoint", str(byte_checkpoint), "--prompt", "Hello", "--max-new-tokens",
               "8", "--temperature", "1.5", "--seed", "3"]
    main(sampled)
    without = capsys.readouterr().out
    main([*sampled, "--top-k", "0"])
    assert capsys.readouterr().out == without


@pytest.mark.parametrize("flags,named", [
    (["--seed", "3"], "--seed: not part of /v1/completions (the server's model and its serve "
                      "flags decide them); leave it out with --server"),
    (["--top-k", "2", "--dtype", "bfloat16", "--tokenizer", "bytes"],
     "--tokenizer, --top-k, --dtype: not part of /v1/completions"),
    (["--ssm-state-dtype", "float32", "--step-implementation", "xla"],
     "--ssm-state-dtype, --step-implementation: not part"),
])
def test_generate_cli_refuses_with_server_the_flags_the_server_decides(flags, named, capsys):
    """Given with --server they would be silently ignored (a --seed that seeds nothing), even
    at their default values; refused before any request is sent."""
    from mamba_jax.generate.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(["--server", "http://127.0.0.1:9", "--prompt", "Hi", *flags])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "cannot reach" not in err


def test_a_model_with_bidirectional_layers_is_refused_before_decoding():
    """Its B layers have no decode step (generate failed inside on a missing cache)."""
    cfg = Mamba2Config.preset("tiny", d_model=64, headdim=16, d_state=16, n_layer=2,
                              layer_pattern="MB")
    with pytest.raises(ValueError, match=r"layer_pattern 'MB': its B layers read later "
                                         r"tokens"):
        mamba_jax.generate(Mamba2LM(cfg, rngs=nnx.Rngs(0)), jnp.ones((1, 3), jnp.int32), 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(eos_token_id=[1, 2]), r"eos_token_id=\[1, 2\] must be an integer \(one token id\) "
                                r"or None"),
    (dict(seed=None), "seed=None must be an integer"),
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an integer"),
    # truncated, or a TypeError / OverflowError from inside
    (dict(prompt_lengths=[2.5]), r"prompt_lengths=\[2.5\] must be integers"),
    (dict(temperature=1.0, top_k=2.7), "top_k=2.7 must be integers"),
    (dict(banned_after=3), "banned_after=3 must be a pair"),
    (dict(eos_token_id=2**40), f"eos_token_id={2**40} is no token id"),
    (dict(seed=2**70), "seed=.* must fit 64 bits"),
    (dict(on_token=5), "on_token=5 must be a function"),
])
def test_arguments_that_must_be_integers_are_named(model, kwargs, match):
    """A list of eos ids (as HF configs give), seed=None or a float length were jit's or
    numpy's errors, or truncated."""
    with pytest.raises(ValueError, match=f"generate: {match}"):
        mamba_jax.generate(model, jnp.zeros((1, 3), jnp.int32), **{"max_new_tokens": 2,
                                                                   **kwargs})


def test_left_padding_is_refused_where_a_learned_state_would_miss_the_prompt():
    """A learnable initial state enters a row's first document: left padding took it, and
    the prompt started from zeros (a continuation unlike the row's alone). (The server's
    engine pads no such prompt: tests/test_engine.py.)"""
    from mamba_jax.generate import token_logprobs

    model = Mamba2LM(Mamba2Config.preset("tiny", **{"mamba2.learnable_init_state": True}),
                     rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 250, (2, 6)))
    for call in (lambda: mamba_jax.generate(model, ids, max_new_tokens=2, prompt_lengths=[3, 6]),
                 lambda: token_logprobs(model, ids, lengths=[3, 6])):
        with pytest.raises(ValueError, match=r"left-padded rows \(.*\) of a model with a "
                                             r"learnable initial state"):
            call()
    assert mamba_jax.generate(model, ids, max_new_tokens=2, prompt_lengths=[6, 6]).shape == (2, 8)
