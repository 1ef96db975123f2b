"""Prepared token datasets, Megatron-LM's indexed datasets, instruction data (chats and
prompt-completion pairs, with a loss mask), blends of several, and the batches the trainer
reads.

    python -m mamba_jax.data prepare a.txt b.jsonl --tokenizer bytes --out data/corpus
    python -m mamba_jax.data prepare c.jsonl --json-keys text --tokenizer tokenizer.model \
        --out data/c
    python -m mamba_jax.data prepare chats.jsonl --format chat --tokenizer models/nano \
        --out data/chats
    python -m mamba_jax.train --data 0.3 data/corpus 0.7 /megatron/corpus_text_document

A prepared dataset is a directory:
  tokens.bin      every document's tokens back to back (uint16, or int32 for vocabularies
                  of 65500 and more: Megatron's choice), each followed by the tokenizer's
                  end-of-document token (Megatron's --append-eod; `--no-append-eod` leaves
                  it out; a chat's template writes its own ends), read through a memory map;
  tokens.idx      its index in Megatron-LM's MMapIndexedDataset format (one sequence per
                  document; INDEXED_DATASET below), so that DIR/tokens is a Megatron
                  --data-path as its tools/preprocess_data.py would have written it;
  docs.npy        int64 [n_docs + 1]: where each document starts in tokens.bin, then the end;
  loss_mask.bin   instruction data only: uint8 [n_tokens], 1 where the token is one a
                  fine-tune learns (an assistant's turn, a completion), beside tokens.bin;
  tokenizer.json  a copy of the tokenizer it was made with (tokenizer.model for a
                  SentencePiece model; none for the byte tokenizer);
  meta.json       `format` (FORMATS: "text", "chat", "prompt-completion"), dtype, counts
                  (`n_trained`: the tokens the mask counts), the largest token id, the
                  tokenizer ("bytes", "tokenizer.json" or "tokenizer.model", the copy;
                  `tokenizer_source`: what --tokenizer named), `eod_token` and `eod_id`
                  (null when none was appended), `chat_template` (instruction data: the
                  template its rows were rendered with, {"source", "template", its
                  "special_tokens", its "tool_use" template or null}, or null), the
                  sources, and `train_docs`: the documents before it train, the rest are
                  held out.

Input (--format text, the default): text files (one document each), and JSON-lines (.jsonl,
.json, .ndjson, any case; or one JSON array of rows, read whole) or Parquet (.parquet;
pyarrow, the `parquet` extra) files, one object per row whose --json-keys fields (Megatron's flag; "text" by default) are its
documents, in key order (Megatron's preprocess_data writes a dataset per key instead); with
--json-keys every input must be JSON lines or Parquet.

Instruction data (--format chat | prompt-completion; JSON lines or Parquet), one document a
row. chat: {"messages": [{"role", "content"}, ...]} (the roles the template takes, at least
one assistant turn), rendered and tokenized exactly as transformers'
apply_chat_template(tokenize=True) does (mamba_jax.chat) with --chat-template FILE or the
template of the model folder --tokenizer names, with the row's "tools" and
"chat_template_kwargs" where it has them (as TRL passes them); the mask counts each
assistant turn (its content and its end of turn).
prompt-completion: {"prompt": str, "completion": str}, as TRL's SFTTrainer tokenizes it:
prompt + completion tokenized together, then the end-of-text token (the model folder's
eos_token); or {"prompt": [messages], "completion": [messages]}, the whole conversation
rendered; either way the mask counts the tokens from where they part from the prompt's own
(the prompt alone tokenized, or rendered with the generation prompt: TRL's
common_prefix_length), the end-of-text token among them.

--data (the trainer) takes a dataset directory, a text file (not JSON lines), a Megatron
dataset by its path prefix (PREFIX.bin + PREFIX.idx, trained as they are: no re-tokenising;
the last EVAL_FRACTION of its documents held out), or a blend `W1 PATH1 W2 PATH2 ...`
(BlendedDataset). Text is cut into windows (TokenDataset); instruction data is packed whole
(PackedDataset).

The end-of-document token is the tokenizer's end-of-sequence token (tokenizer.special_tokens,
e.g. GPT-NeoX's <|endoftext|>), so that a model learns to stop where generation's eos stops
it. The byte tokenizer has none (its 256 ids are all bytes): byte-level documents are joined
without one, and prepare says so.

Legend: b batch, l sequence (--seq-len). A batch is a dict of int32 arrays
`inputs [b, l]`, `targets [b, l]` (inputs shifted by one) and `seq_idx [b, l]` (the
document each input token belongs to, for the scan's state resets), and for instruction
data `loss_mask [b, l]` bool (the targets that count).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import struct
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mamba_jax.chat import ChatTemplate, ChatTemplateError, model_special_tokens
from mamba_jax.cli import HelpFormatter, MissingDependency, command
from mamba_jax.files import (check_outside_checkpoints, check_writable, holds_model, locked,
                             model_file)
from mamba_jax.tokenizer import (SPECIAL_TOKENS, TOKENIZER_FILES, byte_tokenizer,
                                 copy_tokenizer, find_tokenizer, load_tokenizer, special_ends,
                                 special_tokens)

DEFAULT_CORPUS = Path(__file__).parent / "corpus" / "licenses.txt"
FORMAT_VERSION = 1
# What a dataset directory holds; meta.json, written last, makes it a dataset.
DATASET_FILES = ("tokens.bin", "tokens.idx", "docs.npy", "loss_mask.bin", *TOKENIZER_FILES,
                 "meta.json")
# The share of a Megatron dataset's documents held out (the last ones; prepare's default).
EVAL_FRACTION = 0.01

# Megatron-LM's MMapIndexedDataset index, PREFIX.idx (megatron/core/datasets/
# indexed_dataset.py), little-endian: INDEX_HEADER, the version (uint64 1), the tokens'
# dtype code (uint8, DTYPE_CODES), the sequence count S (uint64), the document count D + 1
# (uint64), then int32 [S] sequence lengths in tokens, int64 [S] each sequence's byte offset
# in PREFIX.bin, int64 [D + 1] the sequence each document begins at, then S. PREFIX.bin
# holds the sequences' tokens back to back.
INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}


def token_dtype(vocab_size: int):
    """The token dtype of a dataset for this vocabulary: Megatron's (DType.optimal_dtype),
    uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_index(path, lengths, dtype) -> None:
    """Write Megatron's index (INDEX_HEADER) of documents of `lengths` tokens of `dtype`,
    back to back in the .bin, each document one sequence."""
    lengths = np.asarray(lengths, np.int64)
    code = {np.dtype(t): c for c, t in DTYPE_CODES.items()}[np.dtype(dtype)]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", 1, code, len(lengths), len(lengths) + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())


def read_indexed(prefix) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's indexed dataset PREFIX.bin + PREFIX.idx -> (its tokens [t], a read-only
    memory map, and int64 [n_docs + 1]: where each document starts, then t). A document may
    be several sequences (preprocess_data's --split-sentences); the sequences must lie back
    to back, as Megatron's writer lays them."""
    index, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    fix = "write it again with Megatron's tools/preprocess_data.py or `mamba_jax.data prepare`"
    raw = np.memmap(index, np.uint8, mode="r")
    if raw.size < 34 or bytes(raw[:9]) != INDEX_HEADER:
        raise ValueError(f"--data {prefix}: {index} is not a Megatron MMapIndexedDataset index "
                         f"(it does not begin with {INDEX_HEADER!r}); {fix}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(raw[9:34]))
    if version != 1 or code not in DTYPE_CODES or raw.size < 34 + 12 * n_seq + 8 * n_doc \
            or n_doc < 1:
        raise ValueError(f"--data {prefix}: {index} has version {version}, dtype code {code}, "
                         f"{n_seq} sequences and {n_doc} document indices in {raw.size} bytes, "
                         f"which is not an index this code reads (version 1); {fix}")
    dtype = np.dtype(DTYPE_CODES[code])
    lengths = np.frombuffer(raw, "<i4", n_seq, 34).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", n_seq, 34 + 4 * n_seq)
    documents = np.frombuffer(raw, "<i8", n_doc, 34 + 12 * n_seq)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.memmap(data, dtype, mode="r")
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize) or tokens.size != starts[-1] \
            or documents[0] != 0 or documents[-1] != n_seq or np.any(np.diff(documents) < 0):
        raise ValueError(f"--data {prefix}: {index} does not describe {data} ({tokens.size} "
                         f"{dtype.name} tokens; the index's {n_seq} sequences of {starts[-1]} "
                         f"tokens, back to back, in {n_doc - 1} documents); {fix}")
    return tokens, starts[documents]


def is_indexed(path) -> bool:
    """Whether `path` names a Megatron indexed dataset by its prefix (PREFIX.bin, .idx)."""
    return not Path(path).exists() and Path(f"{path}.idx").is_file() \
        and Path(f"{path}.bin").is_file()


# prepare's working directory inside --out; one left behind was a prepare killed mid-way.
_WORK_PREFIX = ".prepare-"


def _not_utf8(path, error: UnicodeDecodeError) -> ValueError:
    bad = error.object[error.start:error.start + 1].hex()
    return ValueError(f"{path} is not UTF-8 text (byte 0x{bad}: {error.reason}); convert it "
                      "to UTF-8 first, e.g. `iconv -f LATIN1 -t UTF-8`")


# ---------------------------------------------------------------- preparing


# The suffixes of JSON-lines files (any case), and of Parquet files: every other input is
# plain text
JSON_LINES = (".jsonl", ".json", ".ndjson")
PARQUET = ".parquet"
# What prepare writes (--format): plain text, every token trained; instruction data, whose
# loss mask (loss_mask.bin) counts only what a fine-tune learns
FORMATS = ("text", "chat", "prompt-completion")


def is_json_lines(path) -> bool:
    """Whether prepare reads `path` as JSON lines (by its suffix), not as plain text."""
    return Path(path).suffix.lower() in JSON_LINES


def is_parquet(path) -> bool:
    """Whether prepare reads `path` as a Parquet table (by its suffix)."""
    return Path(path).suffix.lower() == PARQUET


_NOT_JSON = object()  # a JSON-lines file's line that does not parse


def _rows(path: Path):
    """Yield (where, row) for each row of a JSON-lines file (each non-blank line's value, or
    _NOT_JSON; where: "PATH:LINE"), of a JSON file that holds one array of rows (read whole,
    as datasets' load_dataset("json") reads one; where: "PATH item N", from 1) or of a
    Parquet file (each row as a dict, read a batch of rows at a time; where: "PATH row N",
    from 1)."""
    if is_parquet(path):
        try:
            import pyarrow
            import pyarrow.parquet
        except ImportError:
            raise MissingDependency(f"{path} is a Parquet file, which needs pyarrow: pip "
                                    "install 'mamba-jax[parquet]'") from None
        try:
            table = pyarrow.parquet.ParquetFile(path)
        except pyarrow.ArrowException as error:
            raise ValueError(f"{path} is not a Parquet file ({error}); write it again, or "
                             "convert it to JSON lines") from None
        number = 0
        for batch in table.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield f"{path} row {number}", row
        return
    # utf-8-sig: a byte-order mark that Windows tools write is no character of the text.
    with open(path, encoding="utf-8-sig") as f:
        if f.read(4096).lstrip().startswith("["):  # one array, or JSON lines of arrays
            f.seek(0)
            try:
                items = json.load(f)
            except json.JSONDecodeError:
                items = None
            if isinstance(items, list):
                for number, row in enumerate(items, 1):
                    yield f"{path} item {number}", row
                return
        f.seek(0)
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{number}", json.loads(line)
                except json.JSONDecodeError:
                    yield f"{path}:{number}", _NOT_JSON


def _documents(path: Path, json_keys=("text",), lines_per_piece: int = 4096):
    """Yield (document_starts, whole_document, text) for one input file, reading it line by
    line.

    A JSON-lines (JSON_LINES) or Parquet file has an object per row, whose json_keys fields
    are each a document, whole; any other file is one document of plain text, handed out in
    pieces of whole lines so that a large file never sits in memory (a piece boundary is a
    line boundary, where tokenizers rarely merge).
    """
    if is_json_lines(path) or is_parquet(path):
        for where, row in _rows(path):
            texts = [row.get(key) for key in json_keys] if isinstance(row, dict) else [None]
            if not all(isinstance(text, str) for text in texts):
                fields = " and ".join(repr(key) for key in json_keys)
                raise ValueError(f"{where}: expected a JSON object whose field(s) {fields} "
                                 f"are strings, on every {'row' if is_parquet(path) else 'line'}"
                                 " (--json-keys names them)")
            for text in texts:
                yield True, True, text
        return
    with open(path, encoding="utf-8-sig") as f:
        piece, first = [], True
        for line in f:
            piece.append(line)
            if len(piece) == lines_per_piece:
                yield first, False, "".join(piece)
                piece, first = [], False
        if piece or first:
            yield first, False, "".join(piece)


def _what(value) -> str:
    """How an error names a row's value: "a JSON list", "not JSON", ..."""
    if value is _NOT_JSON:
        return "a line that is not JSON"
    return "null" if value is None else f"a {type(value).__name__}"


class _Instructions:
    """A worker's encoder of instruction rows (prepare --format chat | prompt-completion):
    row -> (ids, mask), mask 1 where the token trains. Built in each worker from picklable
    settings: the tokenizer's file, the chat template's (path, special tokens, whether it
    is a model dir's) or None, and the end-of-text id that ends a completion (or None)."""

    def __init__(self, fmt: str, tokenizer_file: str, template, eos_id):
        self.fmt, self.eos_id = fmt, eos_id
        self.tokenizer = load_tokenizer(tokenizer_file)
        self.template = None if template is None else _chat_template(*template)
        self.prefix, self.suffix = special_ends(self.tokenizer)

    def __call__(self, where: str, row) -> tuple[list[int], list[int]]:
        try:
            if self.fmt == "chat":
                return self._chat(where, row)
            return self._prompt_completion(where, row)
        except ChatTemplateError as error:  # names the template and its own message
            raise ValueError(f"{where}: {error}") from None

    def _messages(self, where: str, messages, field: str) -> list:
        """messages, checked: a non-empty list of objects with a role. Which roles there are
        is the template's to say (OpenAI's, Llama 3.1's "ipython" for tool output, ...), as
        transformers leaves it: one it does not know is refused by its raise_exception."""
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: "{field}" is {_what(messages)}, not a list of '
                             '{"role", "content"} objects; give each row its messages')
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if not (isinstance(role, str) and role):
                got = (f"fields {sorted(message)}" if isinstance(message, dict)
                       and "role" not in message else f"role {role!r}"
                       if isinstance(message, dict) else _what(message))
                raise ValueError(f'{where}: "{field}" message {i} has {got}, not a role; give '
                                 'each message a role and content ("role": "user", '
                                 '"content": "...")')
        return messages

    def _chat(self, where: str, row):
        if not isinstance(row, dict) or "messages" not in row:
            raise ValueError(f'{where}: expected a JSON object with a "messages" list (--format '
                             f"chat), got {_what(row)}"
                             + (f" with fields {sorted(row)}" if isinstance(row, dict) else "")
                             + "; give every row its conversation")
        messages = self._messages(where, row["messages"], "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the chat has no assistant turn, so none of its tokens "
                             "would train; add the assistant's reply, or leave the row out")
        return self.template.encode_with_mask(self.tokenizer, messages,
                                              **_template_options(where, row))

    def _prompt_completion(self, where: str, row):
        missing = [k for k in ("prompt", "completion") if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f'{where}: expected a JSON object with "prompt" and "completion" '
                             f"fields (--format prompt-completion), got {_what(row)} without "
                             f"{' and '.join(repr(k) for k in missing)}; give every row both")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            # TRL's: prompt and completion tokenized together, then the end-of-text token
            encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids
            body = encode(prompt + completion)
            end = [] if self.eos_id is None or body[-1:] == [self.eos_id] else [self.eos_id]
            ids = self.prefix + body + end + self.suffix
            return ids, _completion_mask(self.prefix + encode(prompt), ids)
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise ValueError(f'{where}: "prompt" and "completion" are {_what(prompt)} and '
                             f"{_what(completion)}: give two strings, or two lists of messages "
                             "(a conversation and the assistant's reply)")
        if self.template is None:
            raise ValueError(f"{where}: a prompt and completion of messages are rendered with "
                             "a chat template, and the tokenizer has none: pass --chat-template "
                             "FILE, or --tokenizer a model folder with one")
        prompt = self._messages(where, prompt, "prompt")
        completion = self._messages(where, completion, "completion")
        if not any(m["role"] == "assistant" for m in completion):
            raise ValueError(f'{where}: the "completion" has no assistant turn, so none of its '
                             "tokens would train; give the assistant's reply")
        # TRL's: the prompt rendered with the generation prompt is not trained, the rest is
        options = _template_options(where, row)
        head = self.template.encode(self.tokenizer, prompt, add_generation_prompt=True,
                                    **options)
        ids = self.template.encode(self.tokenizer, prompt + completion, **options)
        return ids, _completion_mask(head, ids)


# What a row's chat_template_kwargs may not set: the arguments prepare gives the template
_TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools")


def _template_options(where: str, row: dict) -> dict:
    """A row's own arguments to its template, as TRL's SFTTrainer passes them: its "tools"
    (a list of function schemas, or that list as JSON text: a Parquet column's usual form)
    and the entries of its "chat_template_kwargs" object (e.g. enable_thinking)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as error:
            raise ValueError(f'{where}: "tools" is text that is not JSON ({error}); give the '
                             "list of tool schemas, or its JSON") from None
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f'{where}: "tools" is {_what(tools)}, not a list of tool schemas '
                         "(OpenAI's {\"type\": \"function\", \"function\": {...}})")
    extra = row.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f'{where}: "chat_template_kwargs" is {_what(extra)}, not an object of '
                         "the template's variables")
    taken = sorted(set(extra or {}) & set(_TEMPLATE_ARGUMENTS))
    if taken:
        raise ValueError(f'{where}: "chat_template_kwargs" sets {", ".join(taken)}, which '
                         "prepare gives the template itself; leave them out")
    return {"tools": tools, **(extra or {})}


def _completion_mask(prompt: list[int], ids: list[int]) -> list[int]:
    """TRL's completion mask of a prompt-completion pair's ids: 1 from where they part from
    the prompt's own ids on (its common_prefix_length). Tokenized together, the pair may
    join the prompt's last characters and the completion's first into one token, and a
    template may render the prompt alone otherwise than followed by its reply; counting
    the prompt's ids instead left that token out or, where the prompt's ids outnumbered the
    pair's, gave a mask longer than the ids."""
    shared = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b),
                  min(len(prompt), len(ids)))
    return [0] * shared + [1] * (len(ids) - shared)


def _chat_template(path: str, special_tokens: dict, model_dir: bool) -> ChatTemplate:
    """The template prepare renders with: a model dir's, or a --chat-template file."""
    return ChatTemplate.from_model_dir(path) if model_dir else \
        ChatTemplate.from_file(path, special_tokens)


class _Job(NamedTuple):
    """One input file's tokenizing (a worker's part of prepare)."""

    path: str
    tokenizer_file: str
    dtype: type
    tmp: Path
    eod_id: int | None
    json_keys: tuple
    fmt: str = "text"
    template: tuple | None = None  # _chat_template's arguments


def _tokenize_file(job: _Job):
    """Worker: tokenize one file into a temporary shard (and, for instruction data, its
    loss mask into SHARD.mask, one uint8 a token); returns the shard's path, the documents'
    lengths, the largest id and the count of trained tokens (None for text)."""
    shard = Path(tempfile.mkstemp(dir=job.tmp, suffix=".bin")[1])
    lengths, max_token, counted = [], -1, None

    def write(out, ids):
        nonlocal max_token
        ids = np.asarray(ids, np.int64)
        if ids.size:
            max_token = max(max_token, int(ids.max()))
            if ids.max() > np.iinfo(job.dtype).max:
                raise ValueError(f"{job.path}: token id {ids.max()} does not fit {job.dtype}")
        lengths[-1] += ids.size
        out.write(ids.astype(job.dtype).tobytes())

    try:
        if job.fmt == "text":
            _write_text(job, shard, lengths, write)
        else:
            counted = _write_instructions(job, shard, lengths, write)
    except UnicodeDecodeError as error:
        raise _not_utf8(job.path, error) from None
    return str(shard), [n for n in lengths if n], max_token, counted


def _write_text(job: _Job, shard: Path, lengths: list, write) -> None:
    """_tokenize_file's plain text: eod_id (or None) after each non-empty document."""
    tokenizer = load_tokenizer(job.tokenizer_file)
    # A document in pieces gets the special tokens of one encode (a BOS) once, at its ends
    prefix, suffix = special_ends(tokenizer)
    in_pieces = False
    with open(shard, "wb") as out:

        def end_document():
            if in_pieces and lengths:
                write(out, suffix)
            if job.eod_id is not None and lengths and lengths[-1]:
                write(out, [job.eod_id])

        for starts_doc, whole, text in _documents(Path(job.path), job.json_keys):
            if starts_doc:
                end_document()
                lengths.append(0)
                in_pieces = not whole
                if in_pieces:
                    write(out, prefix)
            write(out, tokenizer.encode(text).ids if whole else
                  tokenizer.encode(text, add_special_tokens=False).ids)
        end_document()


def _write_instructions(job: _Job, shard: Path, lengths: list, write) -> int:
    """_tokenize_file's instruction data: each row a document, its mask in SHARD.mask;
    returns the count of trained tokens. A file without a row is refused."""
    encode = _Instructions(job.fmt, job.tokenizer_file, job.template, job.eod_id)
    counted = 0
    with open(shard, "wb") as out, open(f"{shard}.mask", "wb") as masks:
        for where, row in _rows(Path(job.path)):
            ids, mask = encode(where, row)
            lengths.append(0)
            write(out, ids)
            masks.write(np.asarray(mask, np.uint8).tobytes())
            counted += sum(mask)
    if not lengths:
        raise ValueError(f"prepare: {job.path} holds no rows; give files with {job.fmt} rows "
                         "in them (one JSON object a line, or a Parquet table)")
    return counted


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


def _is_given_tokenizer(copy: Path, tokenizer_spec) -> bool:
    """Whether the tokenizer file `copy` is the very file --tokenizer names (kept as it is)."""
    given = Path(str(tokenizer_spec))
    return copy.exists() and given.is_file() and os.path.samefile(given, copy)


def _check_replaceable(out: Path, tokenizer_spec, overwrite: bool):
    """Refuse to write over a dataset in `out` unless overwrite, and into a model's folder
    at all (the dataset's tokenizer would replace the model's)."""
    if holds_model(out):
        raise FileExistsError(f"prepare: --out {out} holds a model (its {model_file(out)}), "
                              "whose tokenizer a dataset there would replace: choose another "
                              "--out")
    check_outside_checkpoints("prepare: --out", out)
    existing = [name for name in DATASET_FILES if (out / name).exists()
                and not _is_given_tokenizer(out / name, tokenizer_spec)]
    if existing and not overwrite:
        raise FileExistsError(f"prepare: --out {out} already holds a dataset "
                              f"({', '.join(existing)}); pass --overwrite to replace it, or "
                              "choose another --out")


def _held_out(n_docs: int, eval_fraction: float) -> int:
    """How many of n_docs documents (the last) are held out: eval_fraction of them, rounded,
    and at least one where eval_fraction > 0 and more than one document is there."""
    n_eval = int(round(n_docs * eval_fraction))
    return 1 if eval_fraction and n_eval == 0 and n_docs > 1 else n_eval


def _install(work: Path, out: Path):
    """Move the finished dataset from `work` into `out`, replacing the one there (a loss mask
    of the one replaced goes with it). meta.json goes first out and last in, so an
    interruption leaves no dataset rather than a mix."""
    (out / "meta.json").unlink(missing_ok=True)
    for name in DATASET_FILES:
        if (work / name).exists():
            os.replace(work / name, out / name)
        elif name == "loss_mask.bin":
            (out / name).unlink(missing_ok=True)


def tokenizer_file(spec) -> str:
    """--tokenizer as load_tokenizer takes it: "bytes" or a tokenizer file as it is; a
    model's folder -> its tokenizer.json or tokenizer.model (TOKENIZER_FILES)."""
    if str(spec) != "bytes" and Path(spec).is_dir():
        found = find_tokenizer(spec)
        if found is None:
            raise FileNotFoundError(f"--tokenizer {spec}: the folder holds no "
                                    f"{' or '.join(TOKENIZER_FILES)}; give a model's folder "
                                    "or the tokenizer file")
        return str(found)
    return str(spec)


def _end_of_text(tokenizer, spec, fmt: str) -> tuple[str, int] | None:
    """The end-of-document token prepare appends: for a completion (as TRL) a model
    folder's eos_token (tokenizer_config.json), else the tokenizer's (special_tokens)."""
    eos = model_special_tokens(spec).get("eos_token") \
        if fmt == "prompt-completion" and Path(spec).is_dir() else None
    if eos is not None and tokenizer.token_to_id(eos) is not None:
        return eos, tokenizer.token_to_id(eos)
    return special_tokens(tokenizer)["eos"]


def prepare(inputs, tokenizer_spec, out, eval_fraction=EVAL_FRACTION, workers=None,
            log=sys.stderr, *, append_eod: bool = True, overwrite: bool = False,
            json_keys=None, fmt: str = "text", chat_template=None):
    """Tokenize text / JSON-lines / Parquet files into a dataset directory `out` (see module
    doc). json_keys: the documents' fields of each row (default ["text"]); given, every
    input must be JSON lines or Parquet (a text file would ignore them). fmt: "text",
    "chat" or "prompt-completion" (FORMATS; the last two write loss_mask.bin, and need JSON
    lines or Parquet). chat_template: a template file for chats (default: the one of the
    model folder tokenizer_spec names).

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
    if fmt not in FORMATS:
        raise ValueError(f"prepare: --format {fmt!r}: use one of {', '.join(FORMATS)}")
    text = [p for p in inputs if not (is_json_lines(p) or is_parquet(p))]
    if json_keys is not None and fmt != "text":
        raise ValueError(f"prepare: --json-keys names the documents of --format text; --format "
                         f"{fmt} reads its rows' fixed fields: leave --json-keys out")
    if (json_keys is not None or fmt != "text") and text:
        raise ValueError(f"prepare: " + ("--json-keys names fields of JSON lines" if fmt == "text"
                                         else f"--format {fmt} reads rows of JSON lines")
                         + f", but {text[0]} is read as plain text (one document): JSON-lines "
                         f"files are named {', '.join(JSON_LINES)}, Parquet files {PARQUET}; "
                         "rename it" + (", or leave --json-keys out" if fmt == "text" else ""))
    if chat_template is not None and fmt == "text":
        raise ValueError("prepare: --chat-template renders --format chat or prompt-completion "
                         "rows; give one of them, or leave --chat-template out")
    json_keys = json_keys or ["text"]
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"prepare: --eval-fraction={eval_fraction} must be in [0, 1)")
    if workers is not None and workers < 1:
        raise ValueError(f"prepare: --workers={workers} must be at least 1")
    file = tokenizer_file(tokenizer_spec)
    tokenizer = load_tokenizer(file)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    template = _template(fmt, tokenizer_spec, chat_template)
    eod = _end_of_text(tokenizer, tokenizer_spec, fmt) if append_eod and fmt != "chat" \
        else None
    out = Path(out)
    check_writable("prepare: --out", out, folder=True)
    workers = workers or min(len(inputs), os.cpu_count())
    _check_replaceable(out, file, overwrite)  # before the lock: a refusal writes
    # nothing into a model's folder; again under it, against another prepare meanwhile
    with locked(out, "prepare"):
        _check_replaceable(out, file, overwrite)
        if append_eod and eod is None and fmt != "chat":
            print(f"prepare: the tokenizer {tokenizer_spec} has no end-of-document token "
                  f"(none of {', '.join(SPECIAL_TOKENS['eos'])}); documents are joined "
                  "without one", file=log)
        chat = None if template is None else _chat_template(*template)
        if chat is not None and (unnamed := chat.unnamed_tokens()):
            print(f"prepare: {chat.source} writes {', '.join(unnamed)}, "
                  f"which --tokenizer {tokenizer_spec} does not name (a model folder's "
                  "tokenizer_config.json does), so the chats hold "
                  f"{'it' if len(unnamed) == 1 else 'them'} as empty text; give --tokenizer "
                  "the model's folder", file=log)
        for stale in out.glob(_WORK_PREFIX + "*"):
            shutil.rmtree(stale)
            print(f"prepare: removed {stale}, left by a prepare that was interrupted",
                  file=log)
        with tempfile.TemporaryDirectory(dir=out, prefix=_WORK_PREFIX) as work:
            work = Path(work)
            results = _tokenize_all([_Job(str(p), file, dtype, work,
                                          None if eod is None else eod[1], tuple(json_keys),
                                          fmt, template) for p in inputs],
                                    workers, log)
            lengths = [n for _, file_lengths, _, _ in results for n in file_lengths]
            if not lengths:
                held = 'holds' if len(inputs) == 1 else 'hold'
                raise ValueError(f"prepare: {', '.join(map(str, inputs))} " + (
                    f"{held} no text (JSON lines: their --json-keys fields {list(json_keys)} "
                    "empty); give files with documents in them" if fmt == "text" else
                    f"{'renders' if len(inputs) == 1 else 'render'} no tokens: check the "
                    "chat template (does it render the messages?)"))
            _join([shard for shard, *_ in results], work / "tokens.bin")
            if fmt != "text":
                _join([f"{shard}.mask" for shard, *_ in results], work / "loss_mask.bin")
            docs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            n_eval = _held_out(len(lengths), eval_fraction)
            bytes_level = file == "bytes"
            meta = {"version": FORMAT_VERSION, "format": fmt, "dtype": np.dtype(dtype).name,
                    "n_tokens": int(docs[-1]), "n_docs": len(lengths),
                    "train_docs": len(lengths) - n_eval,
                    "max_token": max(m for _, _, m, _ in results), "vocab_size": vocab,
                    "tokenizer": "bytes",
                    "tokenizer_source": str(tokenizer_spec),
                    "eod_token": None if eod is None else eod[0],
                    "eod_id": None if eod is None else eod[1],
                    "sources": [str(p) for p in inputs]}
            if fmt != "text":
                meta["n_trained"] = sum(counted for *_, counted in results)
                if template is not None:
                    template = _chat_template(*template)
                    template = {"source": template.source, "template": template.text,
                                "special_tokens": template.special_tokens,
                                "tool_use": template.tool_use and template.tool_use.text}
                meta["chat_template"] = template
            np.save(work / "docs.npy", docs)
            write_index(work / "tokens.idx", lengths, dtype)
            if not bytes_level:
                meta["tokenizer"] = copy_tokenizer(file, work)
                if _is_given_tokenizer(out / meta["tokenizer"], file):
                    (work / meta["tokenizer"]).unlink()  # --tokenizer is the copy: keep it
            (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _install(work, out)
    return meta


def _template(fmt: str, tokenizer_spec, chat_template) -> tuple | None:
    """_chat_template's arguments for instruction rows (None: no template), the template
    read once here so that one that does not compile is refused before any work: a
    --chat-template file (with a model folder's special tokens), else the model folder's
    own; a chat needs one."""
    folder = str(tokenizer_spec) != "bytes" and Path(tokenizer_spec).is_dir()
    if fmt == "text":
        return None
    if chat_template is not None:
        template = (str(chat_template), model_special_tokens(tokenizer_spec) if folder else {},
                    False)
    elif folder and ChatTemplate.from_model_dir(tokenizer_spec) is not None:
        template = (str(tokenizer_spec), {}, True)
    elif fmt == "chat":
        raise ValueError(f"prepare --format chat: --tokenizer {tokenizer_spec} has no chat "
                         "template (a model folder's tokenizer_config.json chat_template or "
                         "chat_template.jinja); pass --chat-template FILE")
    else:
        return None
    _chat_template(*template)
    return template


def _join(shards, path: Path) -> None:
    """The shards' bytes, in order, into one file."""
    with open(path, "wb") as joined:
        for shard in shards:
            with open(shard, "rb") as f:
                while block := f.read(1 << 24):
                    joined.write(block)


# ---------------------------------------------------------------- reading


def _check_not_a_part(path: Path):
    """Refuse a file of a dataset given as --data (read as text, a tokens.bin of small ids is
    valid UTF-8: the run would train on its bytes)."""
    if path.name in ("tokens.bin", "docs.npy", "loss_mask.bin", "meta.json") and \
            (path.parent / "meta.json").is_file():
        raise ValueError(f"--data {path} is a file of the dataset {path.parent}; give the "
                         f"folder: --data {path.parent}")
    if is_json_lines(path) or is_parquet(path):  # read as text, its syntax would be trained
        kind = "JSON lines" if is_json_lines(path) else "Parquet"
        raise ValueError(f"--data {path} is {kind}, which --data does not read directly: "
                         f"python -m mamba_jax.data prepare {path} --tokenizer T --out DIR, "
                         "then --data DIR")
    prefix = path.with_suffix("")
    if path.suffix in (".bin", ".idx") and is_indexed(prefix):
        raise ValueError(f"--data {path} is a file of the Megatron dataset {prefix}; give its "
                         f"prefix: --data {prefix}")


def dataset_meta(path) -> dict | None:
    """meta.json of the prepared dataset at `path`, or None when `path` is a text file.
    Anything else (nothing there, a directory that is not a dataset, a meta.json of another
    format) is an error naming the path and the fix."""
    path = Path(path)
    if path.is_file():
        _check_not_a_part(path)
        return None
    if is_indexed(path):
        return None
    if not path.exists():
        raise FileNotFoundError(f"--data {path}: no such file or directory; give a UTF-8 text "
                                "file, a dataset directory made by `python -m mamba_jax.data "
                                "prepare FILES --out DIR`, or a Megatron dataset's prefix "
                                "(PREFIX.bin and PREFIX.idx)")
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
    or its tokenizer.json / tokenizer.model (the copy in the dataset; datasets made before
    prepare kept a copy name the file it was given)."""
    spec = meta["tokenizer"]
    if spec == "bytes":
        return spec
    copy = Path(path) / spec
    return str(copy if copy.is_file() else spec)


class TokenDataset:
    """Token ids and document starts, split into a training and a held-out range.

    `tokens` [t] ints, `doc_starts` [n_docs + 1] (0, ..., t), `train_docs` documents train.
    `vocab_size`: where the largest id is not known before reading (a Megatron dataset),
    each batch is checked against it as it is read. Its rows are windows of the token
    stream, documents cut where a window ends (pretraining's packing), every target counted.
    """

    masked = False  # whether its batches carry a loss_mask (PackedDataset's do)
    rows_named = "windows"

    def __init__(self, tokens, doc_starts, train_docs: int, name: str = "dataset",
                 vocab_size: int | None = None):
        self.tokens, self.doc_starts, self.name = tokens, np.asarray(doc_starts), name
        self.train_end = int(self.doc_starts[train_docs])
        self.vocab_size = vocab_size

    @classmethod
    def load(cls, path, vocab_size: int, tokenizer=None) -> "TokenDataset":
        """A prepared directory, a Megatron dataset's prefix, or a UTF-8 text file (tokenized
        in memory with `tokenizer`, by default byte-level).

        Checks, before any compute, that the data exists, is not empty, and that every
        token id is < vocab_size (a Megatron dataset's ids as each batch is read).
        """
        path = Path(path)
        meta = dataset_meta(path)
        if meta is None and is_indexed(path):
            tokens, starts = read_indexed(path)
            n_docs = len(starts) - 1
            if tokens.size == 0:
                raise ValueError(f"--data {path}: the Megatron dataset holds no tokens")
            return cls(tokens, starts, n_docs - _held_out(n_docs, EVAL_FRACTION), str(path),
                       vocab_size)
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
        docs = np.load(path / "docs.npy")
        if meta.get("format", "text") == "text":
            dataset = cls(tokens, docs, meta["train_docs"], str(path))
        else:
            mask = np.memmap(path / "loss_mask.bin", np.uint8, mode="r") \
                if (path / "loss_mask.bin").is_file() else np.zeros(0, np.uint8)
            if mask.size != tokens.size:
                raise ValueError(f"--data {path}: loss_mask.bin holds {mask.size} of the "
                                 f"{tokens.size} tokens' masks; prepare the data again")
            dataset = PackedDataset(tokens, docs, meta["train_docs"], mask, str(path))
        dataset.check_vocab(meta["max_token"], vocab_size, meta["vocab_size"])
        return dataset

    @classmethod
    def from_text_file(cls, path, tokenizer, eval_fraction: float = 0.05) -> "TokenDataset":
        """One small UTF-8 text file as one document, tokenized in memory; its last
        eval_fraction is held out (as a second document, so the split needs no boundary)."""
        try:
            text = Path(path).read_text(encoding="utf-8-sig")
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

    def evaluates(self, seq_len: int) -> bool:
        """Whether the held-out split holds a window to evaluate."""
        return self.eval_windows(seq_len) > 0

    def no_evaluation(self, seq_len: int) -> str:
        """Why a run at seq_len does not evaluate (where evaluates is False)."""
        return f"the held-out split has no window of --seq-len {seq_len} + 1 tokens"

    def prompt(self, tokenizer, max_chars: int = 24) -> str:
        """The first words of the first training document (an example prompt)."""
        start = int(self.doc_starts[0])
        text = tokenizer.decode(np.asarray(self.tokens[start:start + 4 * max_chars]).tolist())
        line = next((line.strip() for line in text.replace("\ufffd", "").splitlines()
                     if line.strip()), "")
        return line if len(line) <= max_chars else line[:max_chars].rsplit(" ", 1)[0]

    def _batch(self, starts, seq_len: int) -> dict[str, np.ndarray]:
        rows = np.stack([np.asarray(self.tokens[s:s + seq_len + 1]) for s in starts])
        if self.vocab_size is not None and rows.size and rows.max() >= self.vocab_size:
            self.check_vocab(int(rows.max()), self.vocab_size, int(rows.max()) + 1)
        positions = np.asarray(starts)[:, None] + np.arange(seq_len)
        seq_idx = np.searchsorted(self.doc_starts, positions, side="right") - 1
        return {"inputs": rows[:, :-1].astype(np.int32), "targets": rows[:, 1:].astype(np.int32),
                "seq_idx": seq_idx.astype(np.int32)}

    def train_rows(self, seq_len: int, seed: int) -> int:
        """How many rows of seq_len + 1 tokens the training range is cut into."""
        return self._windows(0, self.train_end, seq_len)

    def rows_batch(self, rows, seq_len: int, seed: int) -> dict[str, np.ndarray]:
        """The batch of training rows `rows` [b] (each < train_rows)."""
        return self._batch(np.asarray(rows) * seq_len, seq_len)

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int,
                    process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """Rows [process_index * b / P, (process_index + 1) * b / P) of global batch `step`.

        The training range is cut into non-overlapping rows of seq_len + 1 tokens
        (train_rows), visited in a fresh seeded permutation each epoch; batch `step` is a
        pure function of (step, seed), so resuming at a step restores the exact position.
        """
        if batch_size % process_count:
            raise ValueError(f"--batch-size {batch_size} is not divisible by the "
                             f"{process_count} processes")
        n = self.train_rows(seq_len, seed)
        per_epoch = n // batch_size
        if per_epoch < 1:
            raise ValueError(f"--data {self.name}: {n} {self.rows_named} of --seq-len "
                             f"{seq_len}, fewer than --batch-size {batch_size}")
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        local = batch_size // process_count
        rows = order[index * batch_size:(index + 1) * batch_size]
        rows = rows[process_index * local:(process_index + 1) * local]
        return self.rows_batch(rows, seq_len, seed)

    def sample_batch(self, samples, seq_len: int, seed: int) -> dict[str, np.ndarray]:
        """The training rows of global sample numbers `samples` [n]: sample s is row
        order[s % rows] of epoch s // rows, order a seeded permutation per epoch (as
        train_batch's); BlendedDataset draws its rows from here."""
        n = self.train_rows(seq_len, seed)
        epochs, index = np.divmod(np.asarray(samples, np.int64), n)
        rows = np.empty_like(index)
        for epoch in np.unique(epochs):
            order = np.random.default_rng([seed, int(epoch)]).permutation(n)
            rows[epochs == epoch] = order[index[epochs == epoch]]
        return self.rows_batch(rows, seq_len, seed)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int = 4):
        """Consecutive windows of the held-out range, at most max_batches batches."""
        n = min(self.eval_windows(seq_len), batch_size * max_batches)
        starts = self.train_end + np.arange(n) * seq_len
        for i in range(0, n, batch_size):
            yield self._batch(starts[i:i + batch_size], seq_len)

    def packing_note(self, seq_len: int, seed: int) -> str | None:
        """What packing did to the documents, said at the start of a run (None: nothing)."""
        return None


# The seed's companion in the generator of PackedDataset's document order (an epoch's
# permutation takes [seed, epoch])
_PACKING = 0x7061636B


class PackedDataset(TokenDataset):
    """Instruction data (prepare --format chat | prompt-completion): documents and their loss
    mask, `loss_mask` [t] uint8 (1 where the token trains), packed whole into rows.

    Packing: the training documents, in an order seeded by the run's seed, fill rows of
    seq_len + 1 tokens greedily (a document that does not fit in the rest of a row begins
    the next; the rest is padding), once a run; each epoch visits the rows in a fresh
    seeded permutation, as TokenDataset's windows, so batch `step` is a pure function of
    (step, seed). A document longer than a row is cut to it (its tokens past the row's end
    are not trained; packing_note counts them), and training documents that keep no token
    to train on between them are refused. The held-out documents that keep a token to train
    on are packed the same way, in their order, so that every evaluated row counts one. No
    state crosses a document (seq_idx) and no target does (masked), so a document's loss
    does not depend on what shares its row.

    Batches: `inputs`, `targets` [b, l] int32; `seq_idx` [b, l] int32 (a row's documents 0,
    1, ...; the padding after them one more); `loss_mask` [b, l] bool: the stored mask of
    each target, False where the target begins a document or is padding.
    """

    masked = True
    rows_named = "packed rows"

    def __init__(self, tokens, doc_starts, train_docs: int, loss_mask, name: str = "dataset"):
        super().__init__(tokens, doc_starts, train_docs, name)
        self.loss_mask, self.train_docs = loss_mask, train_docs
        self._packings, self._kept = {}, {}

    def _trained(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Per document [n_docs]: (the targets a row of seq_len + 1 tokens trains of it, the
        trained tokens its cut leaves out). A document's first token is no target of it, and
        a document longer than the row keeps its first seq_len + 1 tokens."""
        if seq_len not in self._kept:
            capacity = seq_len + 1
            starts, ends = self.doc_starts[:-1], self.doc_starts[1:]
            # documents are never empty: their starts rise, one sum each over the mask
            total = np.add.reduceat(self.loss_mask, starts, dtype=np.int64) \
                if len(starts) else np.zeros(0, np.int64)
            lost = np.zeros(len(starts), np.int64)
            for d in np.flatnonzero(ends - starts > capacity):
                lost[d] = self.loss_mask[starts[d] + capacity:ends[d]].sum(dtype=np.int64)
            self._kept[seq_len] = total - self.loss_mask[starts] - lost, lost
        return self._kept[seq_len]

    def _packing(self, seq_len: int, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(documents [n] in row order, bounds [rows + 1]: row r holds documents
        [bounds[r], bounds[r + 1]) of them): the training documents in their seeded order
        (seed), or the held-out ones that keep a token to train on in theirs (seed None),
        filled into rows greedily. Training documents that keep none between them are
        refused (a ValueError naming the fix): every step would change nothing."""
        key = (seq_len, seed)
        if key not in self._packings:
            n_docs = len(self.doc_starts) - 1
            kept, lost = self._trained(seq_len)
            if seed is None:
                docs = np.arange(self.train_docs, n_docs)
                docs = docs[kept[docs] > 0]
            else:
                docs = np.random.default_rng([seed, _PACKING]).permutation(self.train_docs)
                if not kept[:self.train_docs].any():
                    self._refuse(seq_len, int(lost[:self.train_docs].sum()))
            capacity = seq_len + 1
            bounds, fill = [0], 0
            for i, n in enumerate(np.minimum(np.diff(self.doc_starts)[docs], capacity).tolist()):
                if fill + n > capacity:
                    bounds.append(i)
                    fill = 0
                fill += n
            if len(docs):
                bounds.append(len(docs))
            self._packings[key] = docs, np.asarray(bounds)
        return self._packings[key]

    def _rows(self, packing, rows, seq_len: int) -> dict[str, np.ndarray]:
        """The batch of rows `rows` of a packing (_packing's)."""
        docs, bounds = packing
        capacity = seq_len + 1
        tokens = np.zeros((len(rows), capacity), np.int32)
        mask = np.zeros((len(rows), capacity), bool)
        doc = np.zeros((len(rows), capacity), np.int32)
        for r, row in enumerate(rows):
            at, group = 0, docs[bounds[row]:bounds[row + 1]]
            for k, d in enumerate(group):
                start = int(self.doc_starts[d])
                n = min(int(self.doc_starts[d + 1]) - start, capacity)
                tokens[r, at:at + n] = self.tokens[start:start + n]
                mask[r, at:at + n] = self.loss_mask[start:start + n]
                doc[r, at:at + n] = k
                at += n
            doc[r, at:] = len(group)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "seq_idx": doc[:, :-1],
                "loss_mask": mask[:, 1:] & (doc[:, 1:] == doc[:, :-1])}

    def train_rows(self, seq_len: int, seed: int) -> int:
        return len(self._packing(seq_len, seed)[1]) - 1

    def rows_batch(self, rows, seq_len: int, seed: int) -> dict[str, np.ndarray]:
        return self._rows(self._packing(seq_len, seed), rows, seq_len)

    def _refuse(self, seq_len: int, lost: int):
        """The ValueError of training documents that keep no token to train on in rows of
        seq_len + 1 tokens, `lost` of theirs past the cut."""
        longest = int(np.diff(self.doc_starts)[:self.train_docs].max())
        if lost:
            raise ValueError(f"--data {self.name}: cut to rows of --seq-len {seq_len} + 1 "
                             f"tokens, its training documents keep no token to train on (all "
                             f"{lost} lie past the cut); raise --seq-len (the longest document "
                             f"has {longest} tokens)")
        raise ValueError(f"--data {self.name}: its training documents have no token to train "
                         "on (their loss mask counts none); prepare rows with assistant turns "
                         "or completions")

    def eval_windows(self, seq_len: int) -> int:
        """How many rows the held-out documents that keep a token to train on fill."""
        return max(0, len(self._packing(seq_len, None)[1]) - 1)

    def evaluates(self, seq_len: int) -> bool:
        """Whether a held-out document keeps a token to train on in a row (each evaluated
        row then counts one)."""
        return self.eval_windows(seq_len) > 0

    def no_evaluation(self, seq_len: int) -> str:
        return (f"no held-out document keeps a token to train on in a row of --seq-len "
                f"{seq_len} + 1 tokens")

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int = 4):
        """The rows of the held-out documents in order, at most max_batches batches."""
        n = min(self.eval_windows(seq_len), batch_size * max_batches)
        for i in range(0, n, batch_size):
            yield self._rows(self._packing(seq_len, None), range(i, min(i + batch_size, n)),
                             seq_len)

    def packing_note(self, seq_len: int, seed: int) -> str:
        docs, bounds = self._packing(seq_len, seed)
        lengths = np.diff(self.doc_starts)[:self.train_docs]
        long = int((lengths > seq_len + 1).sum())
        kept, lost = (a[:self.train_docs].sum() for a in self._trained(seq_len))
        padding = 1 - np.minimum(lengths, seq_len + 1).sum() / ((len(bounds) - 1) * (seq_len + 1))
        return (f"--data {self.name}: {len(docs)} training documents packed whole into "
                f"{len(bounds) - 1} rows of --seq-len {seq_len} + 1 tokens ({padding:.1%} "
                "padding)" + (f"; {long} longer than a row are cut to it: {lost} of the "
                              f"{kept + lost} tokens to train on lie past the cut, not trained "
                              "(raise --seq-len to keep them)" if long else ""))


class BlendedDataset:
    """Several datasets trained as one, each row of a batch drawn from dataset i with
    probability weights[i] (normalised): Megatron's --data-path W1 P1 W2 P2 blend, sampled
    rather than by Megatron's greedy schedule. Batch `step` is a pure function of (step,
    seed): the rows' datasets come from a generator seeded with (seed, step), and the k-th
    sample of the run (step * batch_size + row) is row k of the chosen dataset's own
    seeded order (TokenDataset.sample_batch), so resuming at a step restores the exact
    position. Evaluation reads each dataset's held-out range in turn."""

    def __init__(self, datasets: list[TokenDataset], weights):
        weights = np.asarray(weights, np.float64)
        self.datasets, self.weights = datasets, weights / weights.sum()
        self.name = " + ".join(f"{w:g} x {d.name}" for w, d in zip(self.weights, datasets))

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int,
                    process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """TokenDataset.train_batch's rows, each from its drawn dataset."""
        if batch_size % process_count:
            raise ValueError(f"--batch-size {batch_size} is not divisible by the "
                             f"{process_count} processes")
        choice = np.random.default_rng([seed, step, len(self.datasets)]).choice(
            len(self.datasets), size=batch_size, p=self.weights)
        local = batch_size // process_count
        rows = np.arange(process_index * local, (process_index + 1) * local)
        out = {name: np.empty((local, seq_len), np.int32)
               for name in ("inputs", "targets", "seq_idx")}
        if self.masked:
            out["loss_mask"] = np.empty((local, seq_len), bool)
        for i, dataset in enumerate(self.datasets):
            mine = choice[rows] == i
            if mine.any():
                samples = step * batch_size + rows[mine]
                part = self._masked(dataset.sample_batch(samples, seq_len, seed))
                for name in out:
                    out[name][mine] = part[name]
        return out

    @property
    def masked(self) -> bool:
        """Whether a dataset of the blend is instruction data: then every batch has a
        loss_mask, all True in the rows of the others."""
        return any(d.masked for d in self.datasets)

    def _masked(self, batch: dict) -> dict:
        if self.masked and "loss_mask" not in batch:
            return {**batch, "loss_mask": np.ones(batch["inputs"].shape, bool)}
        return batch

    def packing_note(self, seq_len: int, seed: int) -> str | None:
        notes = [n for d in self.datasets if (n := d.packing_note(seq_len, seed))]
        return "; ".join(notes) or None

    def eval_windows(self, seq_len: int) -> int:
        return sum(d.eval_windows(seq_len) for d in self.datasets)

    def evaluates(self, seq_len: int) -> bool:
        return any(d.evaluates(seq_len) for d in self.datasets)

    def no_evaluation(self, seq_len: int) -> str:
        return "; ".join(f"{d.name}: {d.no_evaluation(seq_len)}" for d in self.datasets)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int = 4):
        """Each dataset's TokenDataset.eval_batches, one after the other."""
        for dataset in self.datasets:
            yield from map(self._masked, dataset.eval_batches(batch_size, seq_len, max_batches))

    def prompt(self, tokenizer, max_chars: int = 24) -> str:
        return self.datasets[0].prompt(tokenizer, max_chars)


def fingerprint(path) -> str:
    """What identifies the tokens of a --data path (sha256 hex), so that a resume tells the
    same data at another path from other data at the same path: a prepared dataset's
    meta.json (its counts, tokenizer and sources), a Megatron dataset's index, a text
    file's bytes."""
    path = Path(path)
    source = Path(f"{path}.idx") if is_indexed(path) else path / "meta.json" if path.is_dir() \
        else path
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_blend(items: list[str]) -> list[tuple[float, str]]:
    """--data's values -> [(weight, path)]: one path (weight 1), or `W1 P1 W2 P2 ...` with
    positive weights."""
    if len(items) == 1:
        return [(1.0, items[0])]
    weights = []
    for weight in items[0::2]:
        try:
            weights.append(float(weight))
        except ValueError:
            weights.append(math.nan)
    if len(items) % 2 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--data {' '.join(items)}: give one dataset, or a blend of weights "
                         "and datasets, each weight a positive number before its dataset: "
                         "--data 0.3 data/a 0.7 data/b")
    return list(zip(weights, items[1::2]))


def data_chat_template(items: list[str]) -> tuple[ChatTemplate | None, str | None]:
    """(the chat template the instruction datasets among --data's values were rendered
    with (their meta.json's), or None, a line saying why none is taken where they were
    rendered with different ones): what a model trained on them answers chats with."""
    found = {}
    for _, path in parse_blend(items):
        meta = dataset_meta(path)
        if isinstance(meta, dict) and isinstance(meta.get("chat_template"), dict):
            found[path] = meta["chat_template"]
    if len({json.dumps([t["template"], t["special_tokens"], t.get("tool_use")], sort_keys=True)
            for t in found.values()}) > 1:
        return None, (f"--data {', '.join(found)} were rendered with different chat templates "
                      f"({', '.join(t['source'] for t in found.values())}), of which the model "
                      "carries none: give serve --chat-template FILE")
    record = next(iter(found.values()), None)
    if record is None:
        return None, None
    return ChatTemplate(record["template"], record["special_tokens"], record["source"],
                        record.get("tool_use")), None


def load_data(items: list[str], vocab_size: int, tokenizer=None):
    """--data's values -> a TokenDataset (one path) or a BlendedDataset (parse_blend), each
    loaded and checked by TokenDataset.load."""
    blend = parse_blend(items)
    datasets = [TokenDataset.load(path, vocab_size, tokenizer) for _, path in blend]
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, [w for w, _ in blend])


@command("python -m mamba_jax.data")
def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_jax.data")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text, JSON-lines or Parquet files into a "
                                       "dataset dir", formatter_class=HelpFormatter)
    # "*", not "+": a missing input is told apart from one that --json-keys took (below).
    p.add_argument("inputs", nargs="*", help="text files (one document each), or .jsonl / "
                                             ".parquet files (one document per row and "
                                             "--json-keys field; --format's rows)")
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer.json or SentencePiece tokenizer.model path, a model's folder "
                        "(its tokenizer, and tokenizer_config.json's chat template and special "
                        "tokens), or 'bytes'")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="text",
                   help="text: documents, every token trained; chat: rows of {\"messages\": "
                        "[{\"role\", \"content\"}, ...]} rendered with the chat template, "
                        "only the assistant's turns trained; prompt-completion: rows of "
                        "{\"prompt\", \"completion\"} (strings, or lists of messages), only "
                        "the completion and its end-of-text token trained")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for --format chat (and prompt-completion rows "
                        "of messages), as transformers' apply_chat_template renders it "
                        "(default: the --tokenizer folder's)")
    p.add_argument("--json-keys", nargs="+", metavar="KEY",
                   help="the fields of each JSON line that are documents (Megatron's flag; "
                        "default: text)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the dataset already in --out (refused otherwise)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not end each document (each completion) with the tokenizer's "
                        "end-of-document token (a chat's template writes its own ends)")
    p.add_argument("--eval-fraction", type=float, default=0.01,
                   help="fraction of documents held out for evaluation (the last ones)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes (default: one per input file, at most the cores)")
    args = parser.parse_args(argv)
    if not args.inputs:
        taken = [key for key in args.json_keys or [] if Path(key).exists()]
        p.error("the following arguments are required: inputs" + (
            f" (--json-keys took {', '.join(taken)} as field names: give the inputs before "
            "--json-keys)" if taken else ""))
    meta = prepare(args.inputs, args.tokenizer, args.out, args.eval_fraction, args.workers,
                   append_eod=args.append_eod, overwrite=args.overwrite,
                   json_keys=args.json_keys, fmt=args.fmt, chat_template=args.chat_template)
    n_docs, held = meta["n_docs"], meta["n_docs"] - meta["train_docs"]
    alone = ""
    if n_docs == 1 and args.eval_fraction:
        alone = (": a single document is not split, so runs on it do not evaluate; give "
                 "several (text files, or JSON lines) to hold some out")
    trained = f" ({meta['n_trained']} trained)" if "n_trained" in meta else ""
    print(f"{args.out}: {meta['n_tokens']} tokens{trained} in {n_docs} "
          f"document{'s' * (n_docs != 1)} ({held} held out{alone})")
    if meta.get("n_trained") == 0:
        print(f"{args.out}: no row has a token to train on, so training on it changes "
              "nothing: check the rows' assistant turns (completions) and the template",
              file=sys.stderr)


if __name__ == "__main__":
    main()
