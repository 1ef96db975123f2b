"""`python -m mamba_jax.generate --checkpoint DIR --prompt TEXT`: generate from a checkpoint.

Uses the checkpoint's tokenizer.json (or --tokenizer PATH|bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp

from mamba_jax.convert import from_pretrained
from mamba_jax.data import load_tokenizer
from mamba_jax.generate import generate


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_jax.generate",
                                     description="Generate text from a Mamba2 checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir (HF or mamba_ssm)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json path or 'bytes' (default: the checkpoint's "
                             "tokenizer.json)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer or Path(args.checkpoint) / "tokenizer.json")
    model = from_pretrained(args.checkpoint, dtype=jnp.dtype(args.dtype))
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        sys.exit("generate: the prompt encodes to no tokens")
    eos = tokenizer.token_to_id("<|endoftext|>")
    out = generate(model, jnp.asarray([ids]), args.max_new_tokens, args.temperature,
                   args.top_k, args.top_p, args.seed, eos)
    print(tokenizer.decode([int(t) for t in out[0]]))


if __name__ == "__main__":
    main()
