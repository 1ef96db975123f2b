"""A sequence classifier: a bidirectional Mamba2Encoder (layer_pattern "BB"), its outputs
mean-pooled, and a linear head, trained together with optax. The task: are most of a
row's tokens from the lower half of the vocabulary?

    python examples/encoder_classification.py
"""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mamba_jax import Mamba2Config
from mamba_jax.encoder import Mamba2Encoder


class Classifier(nnx.Module):
    def __init__(self, cfg, classes, *, rngs):
        self.encoder = Mamba2Encoder(cfg, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, classes, rngs=rngs)

    def __call__(self, ids):
        return self.head(self.encoder(ids, pool="mean"))  # [b, classes]


def batch(rng, rows, length, vocab):
    """Rows of random tokens; label 1 where most of a row's tokens are in the lower half of
    the vocabulary."""
    ids = rng.integers(0, vocab, (rows, length))
    labels = (ids < vocab // 2).sum(1) > length // 2
    return jnp.asarray(ids, jnp.int32), jnp.asarray(labels, jnp.int32)


def main(steps=60, rows=32, length=15, seed=0):
    """Trains the classifier; returns its accuracy on fresh rows."""
    cfg = Mamba2Config(d_model=32, n_layer=2, layer_pattern="BB", vocab_size=16, d_state=8,
                       headdim=8, chunk_size=8)
    model = Classifier(cfg, 2, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, ids, labels):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(ids), labels).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        train_step(model, optimizer, *batch(rng, rows, length, cfg.vocab_size))
    ids, labels = batch(rng, 256, length, cfg.vocab_size)
    return float(np.mean(np.asarray(nnx.jit(model)(ids).argmax(-1)) == np.asarray(labels)))


if __name__ == "__main__":
    print(f"accuracy on fresh rows: {main():.3f}")
