"""A linear probe on a sharded model's hidden states: what does a layer's output encode?
The model runs on a mesh (mamba_jax.parallel.make_hidden_fn: the final norm's output, not
only logits); a logistic regression, trained with optax on the frozen states, reads a
property of each token from them.

    python examples/linear_probe.py      # any number of devices (the same 32 rows on 1, 2,
                                         # 4 or 8 of them); on a CPU, try
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/linear_probe.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from mamba_jax import Mamba2Config, Mamba2LM, parallel


def main(mesh_spec=None, steps=200, seed=0):
    """Probes whether each token's id is even from its hidden state; returns the probe's
    accuracy on held-out rows."""
    cfg = Mamba2Config(d_model=64, n_layer=2, vocab_size=16, d_state=16, headdim=16,
                       chunk_size=16)
    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(seed)))
    mesh = parallel.make_mesh(mesh_spec)  # None: every device on dp
    specs = parallel.param_specs(params, mesh)
    params = jax.device_put(params, parallel.shardings(mesh, specs))
    hidden_fn = jax.jit(parallel.make_hidden_fn(graphdef, specs, mesh))

    rng = np.random.default_rng(seed)
    shards = mesh.shape["dp"] * mesh.shape["fsdp"]
    rows = -(-32 // shards) * shards  # 32, or the least multiple of the data shards above
    ids = rng.integers(0, cfg.vocab_size, (rows, 32)).astype(np.int32)
    states = hidden_fn(params, jax.device_put(ids, NamedSharding(mesh, parallel.TOKENS)))
    features = np.asarray(states, np.float32).reshape(-1, cfg.d_model)  # [tokens, d]
    labels = (ids.reshape(-1) % 2 == 0).astype(np.float32)
    train, test = slice(0, len(labels) // 2), slice(len(labels) // 2, None)

    probe = {"w": jnp.zeros((cfg.d_model,)), "b": jnp.zeros(())}
    optimizer = optax.adam(1e-1)
    opt_state = optimizer.init(probe)

    def loss_fn(probe, x, y):
        return optax.sigmoid_binary_cross_entropy(x @ probe["w"] + probe["b"], y).mean()

    @jax.jit
    def step(probe, opt_state):
        grads = jax.grad(loss_fn)(probe, features[train], labels[train])
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(probe, updates), opt_state

    for _ in range(steps):
        probe, opt_state = step(probe, opt_state)
    predicted = (features[test] @ probe["w"] + probe["b"]) > 0
    return float(np.mean(predicted == labels[test].astype(bool)))


if __name__ == "__main__":
    print(f"probe accuracy on held-out tokens: {main():.3f}")
