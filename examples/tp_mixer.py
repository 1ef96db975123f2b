"""A Mamba2 layer inside your own jax.shard_map, on your own mesh with your own axis names,
tensor-parallel over its heads. ParallelContext is told the mesh's names (AxisNames); the
layer's parameters are placed from their logical axes (mamba_jax.sharding.param_specs), and
the layer's forward is the same code as on one device.

    python examples/tp_mixer.py          # needs 2+ devices; on a CPU:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/tp_mixer.py
"""

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mamba_jax import Mamba2Config
from mamba_jax.layers.mamba2 import Mamba2Mixer
from mamba_jax.sharding import AxisNames, ParallelContext, param_specs


def main(model_size=2):
    """Runs a Mamba2 layer with its heads over the mesh axis "model" and the batch over
    "data"; returns the largest difference from the one-device output."""
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices) // model_size, model_size), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    names = AxisNames(dp="data", tp="model")
    ctx = ParallelContext.for_mesh(mesh, sequence_parallel=False, axis_names=names)

    cfg = Mamba2Config(d_model=64, n_layer=1, d_state=16, headdim=16, chunk_size=16)
    graphdef, params = nnx.split(Mamba2Mixer(cfg, rngs=nnx.Rngs(0)))
    specs = param_specs(params, mesh, names)  # heads over "model"; the rest whole
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    u = np.random.default_rng(0).standard_normal((mesh.shape["data"] * 2, 32, 64))
    u = jax.device_put(u.astype(np.float32), NamedSharding(mesh, P("data")))

    def layer(params, u):
        out, _ = nnx.merge(graphdef, params)(u, ctx=ctx)
        return ctx.layer_output(out)  # the tp ranks' shares of out_proj, summed
    sharded = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(specs, P("data")),
                                    out_specs=P("data"), check_vma=False))
    one_device = jax.jit(lambda params, u: nnx.merge(graphdef, params)(u)[0])
    return float(np.abs(np.asarray(sharded(params, u))
                        - np.asarray(one_device(jax.device_get(params), jax.device_get(u)))
                        ).max())


if __name__ == "__main__":
    if jax.device_count() < 2:
        raise SystemExit("examples/tp_mixer.py splits a layer over 2 devices and sees "
                         f"{jax.device_count()}: on a CPU, run it with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    print(f"largest difference from one device: {main():.2e}")
