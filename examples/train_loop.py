"""A training loop of your own: optax over Mamba2LM under jax.jit, with truncated
backpropagation through time. A long sequence is trained on in pieces; each piece starts
from the states the previous one ended with (Mamba2LM.loss(initial_states=...,
return_states=True)), so the model sees the whole sequence while the backward pass spans
one piece.

    python examples/train_loop.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mamba_jax import Mamba2Config, Mamba2LM


def main(steps=60, piece=32, pieces=4, batch=4, seed=0):
    """Trains a tiny model on a repeating pattern; returns the mean loss of each step."""
    cfg = Mamba2Config(d_model=64, n_layer=2, vocab_size=32, d_state=16, headdim=16,
                       chunk_size=16)
    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(seed)))
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(params)

    def loss_fn(params, ids, states):
        model = nnx.merge(graphdef, params)
        losses, states = model.loss(ids[:, :-1], ids[:, 1:], initial_states=states,
                                    return_states=True)
        return losses.mean(), states

    @jax.jit
    def train_step(params, opt_state, ids, states):
        (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ids, states)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        # The next piece continues from these states, but no gradient flows back into this
        # piece from the next one: truncated BPTT.
        return optax.apply_updates(params, updates), opt_state, loss, \
            jax.lax.stop_gradient(states)

    rng = np.random.default_rng(seed)
    history = []
    for _ in range(steps):
        # Each row counts up from a random start, modulo the vocabulary.
        start = rng.integers(0, cfg.vocab_size, (batch, 1))
        ids = jnp.asarray((start + np.arange(piece * pieces + 1)) % cfg.vocab_size, jnp.int32)
        states = nnx.merge(graphdef, params).init_cache(batch)  # zeros: the first piece
        losses = []
        for i in range(pieces):
            chunk = ids[:, i * piece:(i + 1) * piece + 1]  # one token of overlap: the target
            params, opt_state, loss, states = train_step(params, opt_state, chunk, states)
            losses.append(float(loss))
        history.append(float(np.mean(losses)))
    return history


if __name__ == "__main__":
    for step, loss in enumerate(main()):
        print(f"step {step:3d}  loss {loss:.3f}")
