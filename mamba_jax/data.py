"""Prepared token datasets, and the batches the trainer reads.

    python -m mamba_jax.data prepare a.txt b.jsonl --tokenizer bytes --out data/corpus

A prepared dataset is a directory:
  tokens.bin      every document's tokens back to back (uint16, or uint32 for vocabularies
                  over 65536), each followed by the tokenizer's end-of-document token
                  (Megatron's --append-eod; `--no-append-eod` leaves it out), read through a
                  memory map;
  docs.npy        int64 [n_docs + 1]: where each document starts in tokens.bin, then the end;
  tokenizer.json  a copy of the tokenizer it was made with (none for the byte tokenizer);
  meta.json       dtype, counts, the largest token id, the tokenizer ("bytes" or
                  "tokenizer.json", the copy; `tokenizer_source`: what --tokenizer named),
                  `eod_token` and `eod_id` (null when none was appended), the sources, and
                  `train_docs`: the documents before it train, the rest are held out.

The end-of-document token is the tokenizer's end-of-sequence token (tokenizer.special_tokens,
e.g. GPT-NeoX's <|endoftext|>), so that a model learns to stop where generation's eos stops
it. The byte tokenizer has none (its 256 ids are all bytes): byte-level documents are joined
without one, and prepare says so.

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
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from mamba_jax.cli import HelpFormatter, command
from mamba_jax.files import locked
from mamba_jax.tokenizer import SPECIAL_TOKENS, byte_tokenizer, load_tokenizer, special_tokens

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "licenses.txt"
FORMAT_VERSION = 1
# What a dataset directory holds; meta.json, written last, makes it a dataset.
DATASET_FILES = ("tokens.bin", "docs.npy", "tokenizer.json", "meta.json")
# prepare's working directory inside --out; one left behind was a prepare killed mid-way.
_WORK_PREFIX = ".prepare-"


def _not_utf8(path, error: UnicodeDecodeError) -> ValueError:
    bad = error.object[error.start:error.start + 1].hex()
    return ValueError(f"{path} is not UTF-8 text (byte 0x{bad}: {error.reason}); convert it "
                      "to UTF-8 first, e.g. `iconv -f LATIN1 -t UTF-8`")


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
    """Worker: tokenize one file into a temporary shard, eod_id (or None) after each
    non-empty document; returns the shard's path, the documents' lengths, the largest id."""
    path, tokenizer_spec, dtype, tmp, eod_id = job
    tokenizer = load_tokenizer(tokenizer_spec)
    shard = Path(tempfile.mkstemp(dir=tmp, suffix=".bin")[1])
    lengths, max_token = [], -1
    with open(shard, "wb") as out:

        def end_document():
            nonlocal max_token
            if eod_id is not None and lengths and lengths[-1]:
                out.write(np.asarray([eod_id], dtype).tobytes())
                lengths[-1] += 1
                max_token = max(max_token, eod_id)

        try:
            for starts_doc, text in _documents(Path(path)):
                ids = np.asarray(tokenizer.encode(text).ids, np.int64)
                if ids.size:
                    max_token = max(max_token, int(ids.max()))
                    if ids.max() > np.iinfo(dtype).max:
                        raise ValueError(f"{path}: token id {ids.max()} does not fit {dtype}")
                if starts_doc:
                    end_document()
                    lengths.append(0)
                lengths[-1] += ids.size
                out.write(ids.astype(dtype).tobytes())
        except UnicodeDecodeError as error:
            raise _not_utf8(path, error) from None
        end_document()
    return str(shard), [n for n in lengths if n], max_token


def _tokenize_all(jobs: list, workers: int, log) -> list:
    """_tokenize_file of every job, in order, in `workers` processes. Progress goes to log:
    one line redrawn on a terminal, a line every tenth of the files in a log file."""
    with contextlib.ExitStack() as stack:
        if workers > 1:
            # spawn, not fork: the caller may be a threaded jax process.
            pool = stack.enter_context(ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")))
            tokenized = pool.map(_tokenize_file, jobs)
        else:
            tokenized = map(_tokenize_file, jobs)
        results, tty = [], getattr(log, "isatty", lambda: False)()
        for i, result in enumerate(tokenized, 1):
            results.append(result)
            if tty:
                print(f"\rprepare: {i}/{len(jobs)} files tokenized", end="", file=log,
                      flush=True)
            elif 10 * i // len(jobs) > 10 * (i - 1) // len(jobs):
                print(f"prepare: {i}/{len(jobs)} files tokenized", file=log, flush=True)
        if tty:
            print(file=log)
    return results


def _is_given_tokenizer(out: Path, tokenizer_spec) -> bool:
    """Whether out/tokenizer.json is the very file --tokenizer names (kept as it is)."""
    copy, given = out / "tokenizer.json", Path(str(tokenizer_spec))
    return copy.exists() and given.is_file() and os.path.samefile(given, copy)


def _check_replaceable(out: Path, tokenizer_spec, overwrite: bool):
    """Refuse to write over a dataset in `out` unless overwrite."""
    existing = [name for name in DATASET_FILES if (out / name).exists()
                and not (name == "tokenizer.json" and _is_given_tokenizer(out, tokenizer_spec))]
    if existing and not overwrite:
        raise FileExistsError(f"prepare: --out {out} already holds a dataset "
                              f"({', '.join(existing)}); pass --overwrite to replace it, or "
                              "choose another --out")


def _install(work: Path, out: Path):
    """Move the finished dataset from `work` into `out`, replacing the one there. meta.json
    goes first out and last in, so an interruption leaves no dataset rather than a mix."""
    (out / "meta.json").unlink(missing_ok=True)
    for name in DATASET_FILES:
        if (work / name).exists():
            os.replace(work / name, out / name)


def prepare(inputs, tokenizer_spec, out, eval_fraction=0.01, workers=None, log=sys.stderr,
            *, append_eod: bool = True, overwrite: bool = False):
    """Tokenize text / JSON-lines files into a dataset directory `out` (see module doc).

    Files are tokenized in parallel (one process per file), each streamed to a shard, and
    the shards are joined in input order. A dataset already in `out` is refused unless
    `overwrite`; two prepares into one `out` are refused (a lock), and the working files of
    one that was killed are removed. Returns the metadata dict.
    """
    inputs = [Path(p) for p in inputs]
    for path in inputs:
        if not path.is_file():
            raise FileNotFoundError(f"prepare: input {path} " + (
                "is a directory; name the files in it" if path.is_dir() else "does not exist"))
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"prepare: --eval-fraction={eval_fraction} must be in [0, 1)")
    tokenizer = load_tokenizer(tokenizer_spec)
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    eod = special_tokens(tokenizer)["eos"] if append_eod else None
    out = Path(out)
    workers = workers or min(len(inputs), os.cpu_count())
    with locked(out, "prepare"):
        _check_replaceable(out, tokenizer_spec, overwrite)
        if append_eod and eod is None:
            print(f"prepare: the tokenizer {tokenizer_spec} has no end-of-document token (none "
                  f"of {', '.join(SPECIAL_TOKENS['eos'])}); documents are joined without one",
                  file=log)
        for stale in out.glob(_WORK_PREFIX + "*"):
            shutil.rmtree(stale)
            print(f"prepare: removed {stale}, left by a prepare that was interrupted",
                  file=log)
        with tempfile.TemporaryDirectory(dir=out, prefix=_WORK_PREFIX) as work:
            work = Path(work)
            results = _tokenize_all([(str(p), str(tokenizer_spec), dtype, work,
                                      None if eod is None else eod[1]) for p in inputs],
                                    workers, log)
            lengths = [n for _, file_lengths, _ in results for n in file_lengths]
            if not lengths:
                raise ValueError(f"prepare: {', '.join(map(str, inputs))} hold no text")
            with open(work / "tokens.bin", "wb") as joined:
                for shard, _, _ in results:
                    with open(shard, "rb") as f:
                        while block := f.read(1 << 24):
                            joined.write(block)
            docs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            n_eval = int(round(len(lengths) * eval_fraction))
            if eval_fraction and n_eval == 0 and len(lengths) > 1:
                n_eval = 1
            bytes_level = str(tokenizer_spec) == "bytes"
            meta = {"version": FORMAT_VERSION, "dtype": np.dtype(dtype).name,
                    "n_tokens": int(docs[-1]), "n_docs": len(lengths),
                    "train_docs": len(lengths) - n_eval,
                    "max_token": max(m for _, _, m in results), "vocab_size": vocab,
                    "tokenizer": "bytes" if bytes_level else "tokenizer.json",
                    "tokenizer_source": str(tokenizer_spec),
                    "eod_token": None if eod is None else eod[0],
                    "eod_id": None if eod is None else eod[1],
                    "sources": [str(p) for p in inputs]}
            np.save(work / "docs.npy", docs)
            if not bytes_level and not _is_given_tokenizer(out, tokenizer_spec):
                shutil.copyfile(tokenizer_spec, work / "tokenizer.json")
            (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _install(work, out)
    return meta


# ---------------------------------------------------------------- reading


def dataset_meta(path) -> dict | None:
    """meta.json of the prepared dataset at `path`, or None when `path` is a text file.
    Anything else (nothing there, a directory that is not a dataset, a meta.json of another
    format) is an error naming the path and the fix."""
    path = Path(path)
    if path.is_file():
        return None
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such file or directory; give a UTF-8 text "
                                "file or a dataset directory made by `python -m mamba_jax.data "
                                "prepare FILES --out DIR`")
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"--data {path} is a directory but not a prepared dataset (it "
                                "has no meta.json); make one with `python -m mamba_jax.data "
                                "prepare FILES --out DIR` and pass that DIR")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except ValueError as error:
        raise ValueError(f"--data {path}: meta.json is not valid JSON ({error}); prepare the "
                         "data again") from None
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise ValueError(f"--data {path}: format version {version}, this code reads "
                         f"{FORMAT_VERSION}; prepare the data again")
    return meta


def dataset_tokenizer(path, meta: dict) -> str:
    """The tokenizer a prepared dataset was made with, as load_tokenizer takes it: "bytes",
    or its tokenizer.json (the copy in the dataset; datasets made before prepare kept a copy
    name the file it was given)."""
    spec = meta["tokenizer"]
    if spec == "bytes":
        return spec
    copy = Path(path) / spec
    return str(copy if copy.is_file() else spec)


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
        meta = dataset_meta(path)
        if meta is None:
            tokenizer = tokenizer or byte_tokenizer()
            from_text = cls.from_text_file(path, tokenizer)
            from_text.check_vocab(int(from_text.tokens.max()), vocab_size,
                                  tokenizer.get_vocab_size())
            return from_text
        if not (path / "tokens.bin").is_file():
            raise FileNotFoundError(f"--data {path}: tokens.bin is missing; prepare the data "
                                    "again")
        tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r")
        if tokens.size != meta["n_tokens"] or tokens.size == 0:
            raise ValueError(f"--data {path}: tokens.bin holds {tokens.size} tokens, meta.json "
                             f"says {meta['n_tokens']}; prepare the data again")
        dataset = cls(tokens, np.load(path / "docs.npy"), meta["train_docs"], str(path))
        dataset.check_vocab(meta["max_token"], vocab_size, meta["vocab_size"])
        return dataset

    @classmethod
    def from_text_file(cls, path, tokenizer, eval_fraction: float = 0.05) -> "TokenDataset":
        """One small UTF-8 text file as one document, tokenized in memory; its last
        eval_fraction is held out (as a second document, so the split needs no boundary)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise _not_utf8(f"--data {path}", error) from None
        if not text:
            raise ValueError(f"--data {path} is empty")
        tokens = np.asarray(tokenizer.encode(text).ids, np.int32)
        split = len(tokens) - int(len(tokens) * eval_fraction)
        return cls(tokens, [0, split, len(tokens)], 1, str(path))

    def check_vocab(self, max_token: int, vocab_size: int, tokenizer_vocab: int):
        """Every id < vocab_size, else an error giving the size that fits (the tokenizer's)."""
        if max_token >= vocab_size:
            fits = max(tokenizer_vocab, max_token + 1)
            raise ValueError(f"--data {self.name}: token id {max_token} >= the model's "
                             f"vocab_size={vocab_size}; pass --set vocab_size={fits} (the "
                             "tokenizer's size) or use data prepared with the model's tokenizer")

    def _windows(self, start: int, end: int, seq_len: int) -> int:
        n = (end - start - 1) // seq_len
        if n < 1:
            raise ValueError(f"--data {self.name}: {end - start} tokens in this split, too few "
                             f"for --seq-len {seq_len}")
        return n

    def eval_windows(self, seq_len: int) -> int:
        """How many windows of seq_len + 1 tokens the held-out range holds (0: none)."""
        return max(0, (len(self.tokens) - self.train_end - 1) // seq_len)

    def prompt(self, tokenizer, max_chars: int = 24) -> str:
        """The first words of the first training document (an example prompt)."""
        start = int(self.doc_starts[0])
        text = tokenizer.decode(np.asarray(self.tokens[start:start + 4 * max_chars]).tolist())
        line = next((line.strip() for line in text.replace("\ufffd", "").splitlines()
                     if line.strip()), "")
        return line if len(line) <= max_chars else line[:max_chars].rsplit(" ", 1)[0]

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
        n = min(self.eval_windows(seq_len), batch_size * max_batches)
        starts = self.train_end + np.arange(n) * seq_len
        for i in range(0, n, batch_size):
            yield self._batch(starts[i:i + batch_size], seq_len)


@command("python -m mamba_jax.data")
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_jax.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text or JSON-lines files into a dataset dir",
                       formatter_class=HelpFormatter)
    p.add_argument("inputs", nargs="+", help="text files (one document each) or .jsonl files "
                                             "(one document per line, field 'text')")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json path or 'bytes'")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the dataset already in --out (refused otherwise)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not end each document with the tokenizer's end-of-document token")
    p.add_argument("--eval-fraction", type=float, default=0.01,
                   help="fraction of documents held out for evaluation (the last ones)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes (default: one per input file, at most the cores)")
    args = parser.parse_args(argv)
    meta = prepare(args.inputs, args.tokenizer, args.out, args.eval_fraction, args.workers,
                   append_eod=args.append_eod, overwrite=args.overwrite)
    print(f"{args.out}: {meta['n_tokens']} tokens in {meta['n_docs']} documents "
          f"({meta['n_docs'] - meta['train_docs']} held out)")


if __name__ == "__main__":
    main()
