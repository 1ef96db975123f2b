"""The layer kinds by layer_pattern symbol: the one place that names them.

    KINDS["M"]  -> Mamba2Mixer       KINDS["*"] -> Attention       KINDS["-"] -> MLP
    KINDS["1"]  -> Mamba1Mixer
    KINDS["3"]  -> Mamba3Mixer
    KINDS["B"]  -> BidirectionalMamba2 (non-causal: encoders)

A kind is a mamba_jax.layers.common.Mixer subclass in a module of its own: its config
section, parameters with logical axes, forward, cache and one-token steps, checkpoint keys
and FLOPs. Adding one is a new module and a line here; the config gets its section
(cfg.<name>), the model, the trainer, conversion and decoding take it from here, and the
tests enumerate KINDS.
"""

from __future__ import annotations

from mamba_jax.layers.attention import Attention
from mamba_jax.layers.bidirectional import BidirectionalMamba2
from mamba_jax.layers.mamba1 import Mamba1Mixer
from mamba_jax.layers.mamba2 import Mamba2Mixer
from mamba_jax.layers.mamba3 import Mamba3Mixer
from mamba_jax.layers.mlp import MLP

KINDS = {kind.symbol: kind for kind in (
    Mamba2Mixer,
    Attention,
    MLP,
    Mamba1Mixer,
    Mamba3Mixer,
    BidirectionalMamba2,
)}
