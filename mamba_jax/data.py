"""Prepared token datasets, and the batches the trainer reads.

    python -m mamba_jax.data prepare a.txt b.jsonl --tokenizer bytes --out data/corpus

A prepared dataset is a directory:
  tokens.bin   every document's tokens back to back (uint16, or uint32 for vocabularies
               over 65536), read through a memory map;
  docs.npy     int64 [n_docs + 1]: where each document starts in tokens.bin, then the end;
  meta.json    dtype, counts, the largest token id, the tokenizer, the sources, and
               `train_docs`: the documents before it train, the rest are held out.

Legend: b batch, l sequence (--seq-len). A batch is a dict of int32 arrays
`inputs [b, l]`, `targets [b, l]` (inputs shifted by one) and `seq_idx [b, l]` (the
document each input token belongs to, for the scan's state resets).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from mamba_jax.tokenizer import byte_tokenizer, load_tokenizer

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "licenses.txt"
FORMAT_VERSION = 1


# ---------------------------------------------------------------- preparing


def _documents(path: Path, lines_per_piece: int = 4096):
    """Yield (document_starts, text_piece) for one input file, reading it line by line.

    A .jsonl file has one document per line (its "text" field); any other file is one
    document of plain text, handed out in pieces of whole lines so that a large file never
    sits in memory (a piece boundary is a line boundary, where tokenizers rarely merge).
    """
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".jsonl":
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: expected a JSON object with a 'text' "
                                     "field on every line") from None
                yield True, text
        else:
            piece, first = [], True
            for line in f:
                piece.append(line)
                if len(piece) == lines_per_piece:
                    yield first, "".join(piece)
                    piece, first = [], False
            if piece or first:
                yield first, "".join(piece)


def _tokenize_file(job):
    """Worker: tokenize one file into a temporary shard; returns its paths and counts."""
    path, tokenizer_spec, dtype, tmp = job
    tokenizer = load_tokenizer(tokenizer_spec)
    shard = Path(tempfile.mkstemp(dir=tmp, suffix=".bin")[1])
    lengths, max_token = [], -1
    with open(shard, "wb") as out:
        for starts_doc, text in _documents(Path(path)):
            ids = np.asarray(tokenizer.encode(text).ids, np.int64)
            if ids.size:
                max_token = max(max_token, int(ids.max()))
                if ids.max() > np.iinfo(dtype).max:
                    raise ValueError(f"{path}: token id {ids.max()} does not fit {dtype}")
            if starts_doc:
                lengths.append(0)
            lengths[-1] += ids.size
            out.write(ids.astype(dtype).tobytes())
    return str(shard), [n for n in lengths if n], max_token


def prepare(inputs, tokenizer_spec, out, eval_fraction=0.01, workers=None, log=sys.stderr):
    """Tokenize text / JSON-lines files into a dataset directory `out` (see module doc).

    Files are tokenized in parallel (one process per file), each streamed to a shard, and
    the shards are joined in input order. Returns the metadata dict.
    """
    inputs = [Path(p) for p in inputs]
    for path in inputs:
        if not path.is_file():
            raise FileNotFoundError(f"prepare: input {path} does not exist")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"prepare: --eval-fraction={eval_fraction} must be in [0, 1)")
    vocab = load_tokenizer(tokenizer_spec).get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or min(len(inputs), os.cpu_count())
    with tempfile.TemporaryDirectory(dir=out) as tmp, contextlib.ExitStack() as stack:
        jobs = [(str(p), str(tokenizer_spec), dtype, tmp) for p in inputs]
        if workers > 1:
            # spawn, not fork: the caller may be a threaded jax process.
            pool = stack.enter_context(ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")))
            tokenized = pool.map(_tokenize_file, jobs)
        else:
            tokenized = map(_tokenize_file, jobs)
        results = []
        for i, result in enumerate(tokenized, 1):
            results.append(result)
            print(f"\rprepare: {i}/{len(inputs)} files tokenized", end="", file=log, flush=True)
        print(file=log)
        lengths = [n for _, file_lengths, _ in results for n in file_lengths]
        if not lengths:
            raise ValueError(f"prepare: {', '.join(map(str, inputs))} hold no text")
        with open(out / "tokens.bin.tmp", "wb") as joined:
            for shard, _, _ in results:
                with open(shard, "rb") as f:
                    while block := f.read(1 << 24):
                        joined.write(block)
    docs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_eval = int(round(len(lengths) * eval_fraction))
    if eval_fraction and n_eval == 0 and len(lengths) > 1:
        n_eval = 1
    meta = {"version": FORMAT_VERSION, "dtype": np.dtype(dtype).name,
            "n_tokens": int(docs[-1]), "n_docs": len(lengths),
            "train_docs": len(lengths) - n_eval,
            "max_token": max(m for _, _, m in results), "vocab_size": vocab,
            "tokenizer": str(tokenizer_spec), "sources": [str(p) for p in inputs]}
    np.save(out / "docs.npy", docs)
    os.replace(out / "tokens.bin.tmp", out / "tokens.bin")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# ---------------------------------------------------------------- reading


class TokenDataset:
    """Token ids and document starts, split into a training and a held-out range.

    `tokens` [t] ints, `doc_starts` [n_docs + 1] (0, ..., t), `train_docs` documents train.
    """

    def __init__(self, tokens, doc_starts, train_docs: int, name: str = "dataset"):
        self.tokens, self.doc_starts, self.name = tokens, np.asarray(doc_starts), name
        self.train_end = int(self.doc_starts[train_docs])

    @classmethod
    def load(cls, path, vocab_size: int, tokenizer=None) -> "TokenDataset":
        """A prepared directory, or a UTF-8 text file (tokenized in memory with `tokenizer`,
        by default byte-level).

        Checks, before any compute, that the data exists, is not empty, and that every
        token id is < vocab_size.
        """
        path = Path(path)
        if path.is_file():
            from_text = cls.from_text_file(path, tokenizer or byte_tokenizer())
            from_text.check_vocab(int(from_text.tokens.max()), vocab_size)
            return from_text
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(
                f"--data {path}: neither a text file nor a prepared dataset (no meta.json); "
                f"make one with `python -m mamba_jax.data prepare FILES --out {path}`")
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"--data {path}: format version {meta.get('version')}, this "
                             f"code reads {FORMAT_VERSION}; prepare the data again")
        tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r")
        if tokens.size != meta["n_tokens"] or tokens.size == 0:
            raise ValueError(f"--data {path}: tokens.bin holds {tokens.size} tokens, meta.json "
                             f"says {meta['n_tokens']}; prepare the data again")
        dataset = cls(tokens, np.load(path / "docs.npy"), meta["train_docs"], str(path))
        dataset.check_vocab(meta["max_token"], vocab_size)
        return dataset

    @classmethod
    def from_text_file(cls, path, tokenizer, eval_fraction: float = 0.05) -> "TokenDataset":
        """One small UTF-8 text file as one document, tokenized in memory; its last
        eval_fraction is held out (as a second document, so the split needs no boundary)."""
        text = Path(path).read_text(encoding="utf-8")
        if not text:
            raise ValueError(f"--data {path} is empty")
        tokens = np.asarray(tokenizer.encode(text).ids, np.int32)
        split = len(tokens) - int(len(tokens) * eval_fraction)
        return cls(tokens, [0, split, len(tokens)], 1, str(path))

    def check_vocab(self, max_token: int, vocab_size: int):
        if max_token >= vocab_size:
            raise ValueError(f"--data {self.name}: token id {max_token} >= the model's "
                             f"vocab_size={vocab_size}; use a tokenizer that matches the model")

    def _windows(self, start: int, end: int, seq_len: int) -> int:
        n = (end - start - 1) // seq_len
        if n < 1:
            raise ValueError(f"--data {self.name}: {end - start} tokens in this split, too few "
                             f"for --seq-len {seq_len}")
        return n

    def _batch(self, starts, seq_len: int) -> dict[str, np.ndarray]:
        rows = np.stack([np.asarray(self.tokens[s:s + seq_len + 1]) for s in starts])
        positions = np.asarray(starts)[:, None] + np.arange(seq_len)
        seq_idx = np.searchsorted(self.doc_starts, positions, side="right") - 1
        return {"inputs": rows[:, :-1].astype(np.int32), "targets": rows[:, 1:].astype(np.int32),
                "seq_idx": seq_idx.astype(np.int32)}

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int,
                    process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """Rows [process_index * b / P, (process_index + 1) * b / P) of global batch `step`.

        The training range is cut into non-overlapping windows of seq_len + 1 tokens, visited
        in a fresh seeded permutation each epoch; batch `step` is a pure function of
        (step, seed), so resuming at a step restores the exact position.
        """
        if batch_size % process_count:
            raise ValueError(f"--batch-size {batch_size} is not divisible by the "
                             f"{process_count} processes")
        n = self._windows(0, self.train_end, seq_len)
        per_epoch = n // batch_size
        if per_epoch < 1:
            raise ValueError(f"--data {self.name}: {n} windows of --seq-len {seq_len}, fewer "
                             f"than --batch-size {batch_size}")
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        local = batch_size // process_count
        rows = order[index * batch_size:(index + 1) * batch_size]
        rows = rows[process_index * local:(process_index + 1) * local]
        return self._batch(rows * seq_len, seq_len)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int = 4):
        """Consecutive windows of the held-out range, at most max_batches batches."""
        n = min(self._windows(self.train_end, len(self.tokens), seq_len),
                batch_size * max_batches)
        starts = self.train_end + np.arange(n) * seq_len
        for i in range(0, n, batch_size):
            yield self._batch(starts[i:i + batch_size], seq_len)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_jax.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text or JSON-lines files into a dataset dir")
    p.add_argument("inputs", nargs="+", help="text files (one document each) or .jsonl files "
                                             "(one document per line, field 'text')")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json path or 'bytes'")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--eval-fraction", type=float, default=0.01,
                   help="fraction of documents held out for evaluation (the last ones)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    args = parser.parse_args(argv)
    meta = prepare(args.inputs, args.tokenizer, args.out, args.eval_fraction, args.workers)
    print(f"{args.out}: {meta['n_tokens']} tokens in {meta['n_docs']} documents "
          f"({meta['n_docs'] - meta['train_docs']} held out)")


if __name__ == "__main__":
    main()
