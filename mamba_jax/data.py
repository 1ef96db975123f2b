"""Tokenizers and token streams for training.

A tokenizer is a `tokenizers.Tokenizer`: a checkpoint's tokenizer.json, or our byte-level
one (token id == byte value, 256 tokens) for the bundled corpus and small models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "licenses.txt"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes of the text (vocab 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(spec):
    """'bytes' -> byte_tokenizer(); a path -> tokenizers.Tokenizer.from_file(path)."""
    from tokenizers import Tokenizer

    if str(spec) == "bytes":
        return byte_tokenizer()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} not found: pass --tokenizer "
                                "PATH/tokenizer.json, or --tokenizer bytes for byte-level models")
    return Tokenizer.from_file(str(path))


def tokenize_file(path, tokenizer, vocab_size: int) -> np.ndarray:
    """A UTF-8 text file -> int32 token ids [t]. Checks every id is < vocab_size."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (give a UTF-8 text file)")
    text = path.read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"--data {path} is empty")
    ids = np.asarray(tokenizer.encode(text).ids, np.int32)
    if ids.max() >= vocab_size:
        raise ValueError(f"--data {path}: token id {ids.max()} >= the model's vocab_size="
                         f"{vocab_size}; use a tokenizer that matches the model")
    return ids


def split_tokens(tokens: np.ndarray, seq_len: int, eval_fraction: float = 0.05):
    """(train, eval) token arrays: the last eval_fraction of the stream is held out."""
    n_eval = max(int(len(tokens) * eval_fraction), seq_len + 1)
    if len(tokens) - n_eval < seq_len + 1:
        raise ValueError(f"the corpus has {len(tokens)} tokens: too few for --seq-len "
                         f"{seq_len} plus a held-out split; use a larger corpus or shorter "
                         "sequences")
    return tokens[:-n_eval], tokens[-n_eval:]


def random_windows(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """Endless batches of (inputs, targets), each [batch_size, seq_len] int32, from windows
    at random offsets; the order depends only on the seed."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
        windows = np.stack([tokens[s:s + seq_len + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int = 4):
    """Consecutive non-overlapping (inputs, targets) batches from the held-out split."""
    n = min((len(tokens) - 1) // seq_len, batch_size * max_batches)
    windows = np.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    for i in range(0, n, batch_size):
        yield windows[i:i + batch_size, :-1], windows[i:i + batch_size, 1:]
