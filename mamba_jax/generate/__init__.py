"""Generation: prefill through the chunked scan, then one compiled decode loop.

    tokens = generate(model, input_ids, max_new_tokens=64, temperature=0.0)
    python -m mamba_jax.generate --checkpoint DIR --prompt "Hello"   (the CLI: __main__.py)

The whole decode (all layers, sampling, stopping) is one jitted `lax.while_loop`: no Python
loop and no recompilation per token. The cache (mixer.MambaCache per layer) is carried in
the loop; its buffers are updated in place by XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def sample_logits(logits, key, temperature=0.0, top_k=None, top_p=None):
    """logits [b, v] float32 -> token ids [b] int32. temperature 0 is greedy (argmax).

    top_k keeps the k most likely tokens; top_p keeps the smallest set whose probability
    reaches p (nucleus sampling), always at least the most likely token.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # A token stays if the mass strictly before it is below top_p.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1,
                         keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature",
                                             "top_k", "top_p", "eos_token_id"))
def _generate(graphdef, state, input_ids, key, *, max_new_tokens, temperature, top_k, top_p,
              eos_token_id):
    model = nnx.merge(graphdef, state)
    vocab = model.config.vocab_size  # never sample the padding rows of the vocabulary
    b, l = input_ids.shape
    logits, cache = model.prefill(input_ids)
    stop = -1 if eos_token_id is None else eos_token_id
    pad = 0 if eos_token_id is None else eos_token_id
    first = sample_logits(logits[:, -1, :vocab], jax.random.fold_in(key, 0), temperature,
                          top_k, top_p)
    out = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, cache, done, out = carry
        logits, cache = model.step(token, cache)
        token = sample_logits(logits[:, :vocab], jax.random.fold_in(key, i), temperature,
                              top_k, top_p)
        token = jnp.where(done, pad, token)
        return i + 1, token, cache, done | (token == stop), out.at[:, i].set(token)

    carry = (jnp.int32(1), first, cache, first == stop, out)
    *_, out = jax.lax.while_loop(cond, body, carry)
    return jnp.concatenate([input_ids.astype(jnp.int32), out], axis=1)


def generate(model, input_ids, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
             seed=0, eos_token_id=None):
    """input_ids [b, l] -> [b, l + max_new_tokens] int32: the prompt and its continuation.

    Rows that emit eos_token_id continue with eos_token_id; the loop ends early once every
    row has. Compiled once per (model structure, shapes, sampling settings).
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be [batch, seqlen >= 1], got "
                         f"{input_ids.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 is greedy)")
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
        raise ValueError(f"generate: top_k={top_k} must be in [1, vocab_size="
                         f"{model.config.vocab_size}] or None")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1] or None")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, input_ids, jax.random.key(seed),
                     max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                     top_k=top_k, top_p=None if top_p is None else float(top_p),
                     eos_token_id=eos_token_id)
