"""Test set-up: 8 fake CPU devices for the mesh tests.

XLA reads XLA_FLAGS when jax initialises its backends, so this runs before any test module
imports jax.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
