"""Mamba2 language models in JAX.

    import mamba_jax
    cfg = mamba_jax.Mamba2Config.preset("mamba2-130m")
    model = mamba_jax.Mamba2LM(cfg, rngs=nnx.Rngs(0))
    logits = model(input_ids)                       # [batch, seqlen, padded vocab]
    model = mamba_jax.from_pretrained(path)         # HF or mamba_ssm checkpoint dir
    mamba_jax.save_pretrained(model, path, format="hf")
    tokens = mamba_jax.generate(model, input_ids, max_new_tokens=64)
"""

from mamba_jax.config import Mamba2Config
from mamba_jax.generate import generate
from mamba_jax.model import Mamba2LM

__all__ = ["Mamba2Config", "Mamba2LM", "from_pretrained", "save_pretrained", "generate"]


def __getattr__(name):
    # Imported on first use, so `python -m mamba_jax.convert` does not find its module
    # already imported by the package (runpy warns about that).
    if name in ("from_pretrained", "save_pretrained"):
        from mamba_jax import convert
        return getattr(convert, name)
    raise AttributeError(f"module 'mamba_jax' has no attribute {name!r}")
