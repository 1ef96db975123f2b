"""Tokenizers: a byte-level one (ids are UTF-8 bytes, vocabulary 256), any Hugging Face
`tokenizer.json` (`tokenizers.Tokenizer` objects) and a SentencePiece `tokenizer.model`
(SentencePieceTokenizer: Megatron-LM's GPTSentencePieceTokenizer, which needs the optional
`sentencepiece` package: `pip install mamba-jax[sentencepiece]`). Each has encode(text).ids,
decode(ids), get_vocab_size(), to_str() (equal for equal tokenizers) and save(path); a
directory holds it as TOKENIZER_FILES names it (save_tokenizer, find_tokenizer). Used by the
trainer's data preparation, by generation and by the server; it imports nothing else of ours.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import NamedTuple


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


class Encoding(NamedTuple):
    """What SentencePieceTokenizer.encode returns: the ids, as tokenizers' Encoding has them."""

    ids: list[int]


class SentencePieceTokenizer:
    """A SentencePiece model file (tokenizer.model) with Megatron-LM's GPTSentencePieceTokenizer
    semantics: encode is the model's encode_as_ids (no BOS or EOS added), decode its
    decode_ids, the vocabulary its pieces, the end-of-document token its eos piece (</s>),
    and bos / pad its bos / pad pieces, where the model has them."""

    file_name = "tokenizer.model"

    def __init__(self, path):
        try:
            import sentencepiece
        except ImportError:
            raise ValueError(f"tokenizer {path} is a SentencePiece model, which needs the "
                             "sentencepiece package: pip install 'mamba-jax[sentencepiece]'"
                             ) from None
        self.path = Path(path)
        self.model = self.path.read_bytes()
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(self.model)
        except RuntimeError as error:
            raise ValueError(f"tokenizer {path} is not a SentencePiece model ({error}); pass "
                             "a tokenizer.model or a tokenizer.json") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        """tokenizers' signature; it adds no special tokens either way."""
        return Encoding(self.processor.encode_as_ids(text))

    def decode(self, ids) -> str:
        return self.processor.decode_ids([int(i) for i in ids])

    def get_vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def token_to_id(self, token: str) -> int | None:
        """tokenizers' token_to_id: the piece's id, None where the model has no such piece."""
        i = self.processor.piece_to_id(token)
        return None if i == self.processor.unk_id() and token != self.processor.id_to_piece(i) \
            else i

    def to_str(self) -> str:
        """The model's digest: equal for the same model file."""
        return "sentencepiece:" + hashlib.sha256(self.model).hexdigest()

    def save(self, path) -> None:
        Path(path).write_bytes(self.model)

    def special_tokens(self) -> dict[str, tuple[str, int] | None]:
        """tokenizer.special_tokens' answer: the model's bos, eos and pad pieces."""
        sp = self.processor
        ids = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
        return {role: None if i < 0 else (sp.id_to_piece(i), i) for role, i in ids.items()}


# The file a tokenizer of each kind is saved as beside a model or a dataset, first looked for.
TOKENIZER_FILES = ("tokenizer.json", SentencePieceTokenizer.file_name)


def tokenizer_file_name(tokenizer) -> str:
    """The name a tokenizer is saved as (TOKENIZER_FILES)."""
    return getattr(tokenizer, "file_name", "tokenizer.json")


def save_tokenizer(tokenizer, directory) -> Path:
    """Save the tokenizer in `directory` under its file name; returns the path."""
    path = Path(directory) / tokenizer_file_name(tokenizer)
    tokenizer.save(str(path))
    return path


def find_tokenizer(directory) -> Path | None:
    """The tokenizer file saved in `directory` (TOKENIZER_FILES), or None."""
    return next((Path(directory) / name for name in TOKENIZER_FILES
                 if (Path(directory) / name).is_file()), None)


def copy_tokenizer(spec, directory) -> str:
    """Copy the tokenizer file `spec` names into `directory` under its kind's file name
    (TOKENIZER_FILES); returns that name."""
    name = tokenizer_file_name(load_tokenizer(spec))
    shutil.copyfile(spec, Path(directory) / name)
    return name


def special_ends(tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer's post-processor puts before and after a text's own (a BOS
    template's ([bos], []), RoBERTa's ([<s>], [</s>]); ([], []) for SentencePieceTokenizer,
    which adds none): a text encoded in pieces without them (add_special_tokens=False) is
    then given them once, at its ends. Found by encoding a probe with and without them."""
    inner = tokenizer.encode("a", add_special_tokens=False).ids
    whole = tokenizer.encode("a").ids
    at = next(i for i in range(len(whole) - len(inner) + 1) if whole[i:i + len(inner)] == inner)
    return whole[:at], whole[at + len(inner):]


def load_tokenizer(spec):
    """'bytes' -> byte_tokenizer(); a SentencePiece model file (a .model) ->
    SentencePieceTokenizer; a tokenizer.json (a .json) -> tokenizers.Tokenizer.from_file(path);
    a file named otherwise, whichever of the two reads it."""
    from tokenizers import Tokenizer

    if str(spec) == "bytes":
        return byte_tokenizer()
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} not found: pass --tokenizer "
                                "PATH/tokenizer.json or PATH/tokenizer.model (SentencePiece), "
                                "or --tokenizer bytes for byte-level models")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception for any bad file
        if path.suffix == ".json":
            raise ValueError(f"tokenizer {path} is not a tokenizer.json: {error}") from None
        return SentencePieceTokenizer(path)


# The usual spellings of the special tokens, most common first: GPT-2 / GPT-NeoX (whose
# <|endoftext|> begins and ends documents), Llama 3, SentencePiece models (<s>, </s>).
SPECIAL_TOKENS = {"bos": ("<|endoftext|>", "<|begin_of_text|>", "<s>", "<bos>"),
                  "eos": ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"),
                  "pad": ("<|padding|>", "<pad>", "[PAD]")}


def special_tokens(tokenizer) -> dict[str, tuple[str, int] | None]:
    """{"bos", "eos", "pad"} -> (token, id) of the tokenizer's added token with a usual
    spelling (SPECIAL_TOKENS), or None. Only added tokens count: the byte tokenizer has
    none (its 256 ids are all bytes), and text that merely spells "</s>" is not one. A
    SentencePiece model's are its own bos, eos and pad pieces."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        return tokenizer.special_tokens()
    added = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}
    return {role: next(((t, added[t]) for t in spellings if t in added), None)
            for role, spellings in SPECIAL_TOKENS.items()}


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"}: the ids of special_tokens."""
    return {f"{role}_token_id": None if found is None else found[1]
            for role, found in special_tokens(tokenizer).items()}
