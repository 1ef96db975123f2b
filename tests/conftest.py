"""Test set-up: 8 fake CPU devices for the mesh tests, and XLA:CPU's quickest compiles.

XLA reads XLA_FLAGS when jax initialises its backends, so this runs before any test module
imports jax. Compiling dominates the suite's time and optimization level 0 about halves it;
every side of every comparison is compiled the same way. Subprocesses inherit both flags.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
