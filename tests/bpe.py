"""A small byte-level BPE tokenizer with GPT-NeoX's special tokens, trained on the bundled
corpus in milliseconds: the tests' stand-in for a real tokenizer.json."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mamba_jax.data import DEFAULT_CORPUS

VOCAB = 300
EOS_ID = 0  # <|endoftext|>
PAD_ID = 1  # <|padding|>


def bpe_tokenizer(path) -> Tokenizer:
    """Train the tokenizer, save it to `path` (a tokenizer.json) and return it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([DEFAULT_CORPUS.read_text()], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(str(path))
    return tokenizer
