"""Tokenizers: a byte-level one (ids are UTF-8 bytes, vocabulary 256) and any Hugging Face
`tokenizer.json`, as `tokenizers.Tokenizer` objects. Used by the trainer's data preparation,
by generation and by the server; it imports nothing else of ours.
"""

from __future__ import annotations

from pathlib import Path


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


# The usual spellings of the special tokens, most common first: GPT-2 / GPT-NeoX (whose
# <|endoftext|> begins and ends documents), Llama 3, SentencePiece models (<s>, </s>).
SPECIAL_TOKENS = {"bos": ("<|endoftext|>", "<|begin_of_text|>", "<s>", "<bos>"),
                  "eos": ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"),
                  "pad": ("<|padding|>", "<pad>", "[PAD]")}


def special_tokens(tokenizer) -> dict[str, tuple[str, int] | None]:
    """{"bos", "eos", "pad"} -> (token, id) of the tokenizer's added token with a usual
    spelling (SPECIAL_TOKENS), or None. Only added tokens count: the byte tokenizer has
    none (its 256 ids are all bytes), and text that merely spells "</s>" is not one."""
    added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}
    return {role: next(((t, added[t]) for t in spellings if t in added), None)
            for role, spellings in SPECIAL_TOKENS.items()}


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"}: the ids of special_tokens."""
    return {f"{role}_token_id": None if found is None else found[1]
            for role, found in special_tokens(tokenizer).items()}
