import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bpe import EOS_ID, bpe_tokenizer
from mamba_jax.data import DEFAULT_CORPUS, TokenDataset, load_data, main, prepare
from mamba_jax.files import locked
from mamba_jax.tokenizer import byte_tokenizer, load_tokenizer, special_tokens


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nwith two lines\n")
    docs = [{"text": f"doc {i} " + "x" * i} for i in range(12)]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    return tmp_path


def test_prepare_writes_every_document_in_input_order(corpus, tmp_path):
    meta = prepare([corpus / "a.txt", corpus / "b.jsonl"], "bytes", tmp_path / "ds",
                   eval_fraction=0.25, workers=2)
    texts = ["first document\nwith two lines\n"] + [f"doc {i} " + "x" * i for i in range(12)]
    assert meta["n_docs"] == 13 and meta["train_docs"] == 13 - 3
    assert meta["n_tokens"] == sum(len(t.encode()) for t in texts)
    assert meta["max_token"] == max(max(t.encode()) for t in texts)
    tokens = np.memmap(tmp_path / "ds" / "tokens.bin", dtype=meta["dtype"], mode="r")
    starts = np.load(tmp_path / "ds" / "docs.npy")
    for i, text in enumerate(texts):
        assert bytes(tokens[starts[i]:starts[i + 1]].astype(np.uint8)) == text.encode()


def test_large_plain_text_is_streamed_in_pieces_into_one_document(tmp_path):
    text = "".join(f"line {i}\n" for i in range(10000))  # over one 4096-line piece
    (tmp_path / "big.txt").write_text(text)
    meta = prepare([tmp_path / "big.txt"], "bytes", tmp_path / "ds", eval_fraction=0.0)
    assert meta["n_docs"] == 1 and meta["n_tokens"] == len(text)


def test_a_text_in_pieces_gets_the_special_tokens_of_one_encode(tmp_path):
    """A tokenizer whose template wraps a text in <s> ... </s>: a large text file (three
    pieces) is one document with them once, at its ends, as encoding it whole gives (each
    piece gave them in the middle); a JSON document keeps its own."""
    from tokenizers import processors

    tokenizer = bpe_tokenizer(tmp_path / "plain.json")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|padding|> $A <|endoftext|>", special_tokens=[("<|padding|>", 1),
                                                               ("<|endoftext|>", 0)])
    tokenizer.save(str(tmp_path / "wrapped.json"))
    text = "".join(f"line {i}\n" for i in range(10000))
    (tmp_path / "big.txt").write_text(text)
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": "one line"}) + "\n")
    meta = prepare([tmp_path / "big.txt", tmp_path / "doc.jsonl"],
                   str(tmp_path / "wrapped.json"), tmp_path / "ds", eval_fraction=0.0)
    tokens = np.asarray(np.memmap(tmp_path / "ds" / "tokens.bin", dtype=meta["dtype"],
                                  mode="r"))
    whole, doc = tokenizer.encode(text).ids, tokenizer.encode("one line").ids
    assert whole[0] == 1 and whole[-1] == 0 and doc[0] == 1
    eod = tokens[len(whole)]  # each document ends with the end-of-text token once more
    np.testing.assert_array_equal(tokens, whole + [eod] + doc + [eod])


def test_batches_are_deterministic_and_resume_exactly(corpus, tmp_path):
    prepare([DEFAULT_CORPUS], "bytes", tmp_path / "ds", eval_fraction=0.0)
    ds = TokenDataset.load(tmp_path / "ds", vocab_size=256)
    first = [ds.train_batch(step, 4, 32, seed=1) for step in range(6)]
    again = ds.train_batch(5, 4, 32, seed=1)  # straight to step 5, as a resume does
    np.testing.assert_array_equal(again["inputs"], first[5]["inputs"])
    other_seed = ds.train_batch(0, 4, 32, seed=2)
    assert not np.array_equal(other_seed["inputs"], first[0]["inputs"])
    b = first[0]
    assert b["inputs"].shape == b["targets"].shape == b["seq_idx"].shape == (4, 32)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])


def test_each_process_reads_its_own_rows_of_the_global_batch(tmp_path):
    prepare([DEFAULT_CORPUS], "bytes", tmp_path / "ds", eval_fraction=0.0)
    ds = TokenDataset.load(tmp_path / "ds", vocab_size=256)
    whole = ds.train_batch(3, 8, 16, seed=0)
    parts = [ds.train_batch(3, 8, 16, seed=0, process_index=p, process_count=4)
             for p in range(4)]
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]),
                                  whole["inputs"])


def test_seq_idx_marks_document_boundaries(corpus, tmp_path):
    prepare([corpus / "b.jsonl"], "bytes", tmp_path / "ds", eval_fraction=0.0)
    ds = TokenDataset.load(tmp_path / "ds", vocab_size=256)
    batch = ds._batch([0], 40)
    lengths = [len(f"doc {i} " + "x" * i) for i in range(12)]
    expected = np.repeat(np.arange(12), lengths)[:40]
    np.testing.assert_array_equal(batch["seq_idx"][0], expected)


def test_held_out_documents_never_appear_in_training_batches(corpus, tmp_path):
    prepare([corpus / "b.jsonl"], "bytes", tmp_path / "ds", eval_fraction=0.5)
    ds = TokenDataset.load(tmp_path / "ds", vocab_size=256)
    for step in range(5):
        assert ds.train_batch(step, 1, 8, seed=0)["seq_idx"].max() < 6
    assert all(b["seq_idx"].min() >= 6 for b in ds.eval_batches(1, 8))


def test_bad_data_is_refused_before_any_compute(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m mamba_jax.data prepare"):
        TokenDataset.load(tmp_path / "absent", vocab_size=256)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        TokenDataset.load(tmp_path / "empty.txt", vocab_size=256)
    with pytest.raises(ValueError, match=r"empty.txt holds no text .*give files with"):
        prepare([tmp_path / "empty.txt"], "bytes", tmp_path / "ds0")
    prepare([corpus / "a.txt"], "bytes", tmp_path / "ds", eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"token id 119 >= the model's vocab_size=100"):
        TokenDataset.load(tmp_path / "ds", vocab_size=100)
    for i, line in enumerate(['{"body": "no text"}', '{"text": 5}', '{"text": null}',
                              '{"text": "unclosed', '["text"]']):
        (corpus / "bad.jsonl").write_text('{"text": "ok"}\n' + line + "\n")
        with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object whose "
                                             r"field\(s\) 'text' are strings, on every line"):
            prepare([corpus / "bad.jsonl"], "bytes", tmp_path / f"ds{i + 1}", workers=1)


def test_prepare_cli(corpus, tmp_path, capsys):
    main(["prepare", str(corpus / "b.jsonl"), "--tokenizer", "bytes", "--out",
          str(tmp_path / "ds"), "--eval-fraction", "0.1"])
    assert "in 12 documents (1 held out)" in capsys.readouterr().out
    main(["prepare", str(corpus / "a.txt"), "--tokenizer", "bytes", "--out",
          str(tmp_path / "one")])  # one document: none held out, and the summary says why
    assert "in 1 document (0 held out: a single document is not split, so runs on it do " \
        "not evaluate" in capsys.readouterr().out


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "naïve — 数据\n\tend "
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text).ids) == text


def test_prepare_refuses_to_replace_a_dataset_without_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    prepare([corpus / "a.txt"], "bytes", out, eval_fraction=0.0)
    before = {name: (out / name).read_bytes() for name in ("tokens.bin", "docs.npy",
                                                           "meta.json")}
    with pytest.raises(SystemExit) as refused:
        main(["prepare", str(corpus / "b.jsonl"), "--tokenizer", "bytes", "--out", str(out)])
    assert refused.value.code == 2
    assert "already holds a dataset" in str(refused.value) and "--overwrite" in str(
        refused.value)
    assert {name: (out / name).read_bytes() for name in before} == before
    main(["prepare", str(corpus / "b.jsonl"), "--tokenizer", "bytes", "--out", str(out),
          "--overwrite"])
    assert json.loads((out / "meta.json").read_text())["n_docs"] == 12
    assert "in 12 documents" in capsys.readouterr().out


def test_prepare_never_writes_into_a_models_folder(corpus, tmp_path, capsys):
    """Even with --overwrite: the dataset's tokenizer.json would replace the model's."""
    from flax import nnx

    import mamba_jax
    from mamba_jax import Mamba2Config, Mamba2LM
    out = tmp_path / "model"
    mamba_jax.save_pretrained(Mamba2LM(Mamba2Config.preset("tiny", d_model=32, n_layer=1),
                                       rngs=nnx.Rngs(0)), out)
    (out / "tokenizer.json").write_text("the model's")
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as refused:
            main(["prepare", str(corpus / "a.txt"), "--tokenizer", "bytes", "--out", str(out),
                  *extra])
        assert refused.value.code == 2
        assert str(refused.value) == (f"prepare: --out {out} holds a model (its config.json), "
                                      "whose tokenizer a dataset there would replace: choose "
                                      "another --out")
    assert (out / "tokenizer.json").read_text() == "the model's"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                     "tokenizer.json"]  # no .lock either
    # a first prepare that fails leaves no --out folder behind
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit):
        main(["prepare", str(tmp_path / "bad.jsonl"), "--tokenizer", "bytes", "--out",
              str(tmp_path / "new")])
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("out,refusal", [("file", "a file, not a folder"),
                                          ("file/ds", "file is a file, not a folder")])
def test_prepare_names_an_out_it_could_not_write(corpus, tmp_path, capsys, out, refusal):
    (tmp_path / "file").write_text("a user's file\n")
    with pytest.raises(SystemExit,
                       match=f"prepare: --out {tmp_path / out}: .*{refusal}") as refused:
        main(["prepare", str(corpus / "a.txt"), "--tokenizer", "bytes", "--out",
              str(tmp_path / out)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert (tmp_path / "file").read_text() == "a user's file\n"


def test_two_prepares_into_one_directory_are_refused(corpus, tmp_path):
    with locked(tmp_path / "ds", "prepare"):
        with pytest.raises(BlockingIOError, match=r"ds is in use by another prepare"):
            prepare([corpus / "a.txt"], "bytes", tmp_path / "ds")


@pytest.mark.subprocess
def test_the_working_files_of_a_killed_prepare_are_removed_by_the_next(corpus, tmp_path):
    out = tmp_path / "ds"
    # The prepare kills itself (SIGKILL) as it starts tokenizing: its shards are on disk.
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys, mamba_jax.data as data\n"
        "data._tokenize_file = lambda job: os.kill(os.getpid(), signal.SIGKILL)\n"
        "data.main(sys.argv[1:])"), "prepare", str(corpus / "a.txt"), "--tokenizer", "bytes",
        "--out", str(out), "--workers", "1"], env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert killed.returncode == -signal.SIGKILL
    left = [p for p in out.iterdir() if p.is_dir()]
    assert left  # what the kill left behind
    log = io.StringIO()
    prepare([corpus / "a.txt"], "bytes", out, eval_fraction=0.0, log=log)
    assert [p for p in out.iterdir() if p.is_dir()] == []
    assert f"removed {left[0]}" in log.getvalue()


def test_prepare_ends_each_document_with_the_tokenizers_end_of_text(corpus, tmp_path):
    tokenizer = bpe_tokenizer(tmp_path / "tokenizer.json")
    texts = [f"doc {i} " + "x" * i for i in range(12)]
    meta = prepare([corpus / "b.jsonl"], tmp_path / "tokenizer.json", tmp_path / "ds",
                   eval_fraction=0.0)
    assert (meta["eod_token"], meta["eod_id"]) == ("<|endoftext|>", EOS_ID)
    tokens = np.memmap(tmp_path / "ds" / "tokens.bin", dtype=meta["dtype"], mode="r")
    starts = np.load(tmp_path / "ds" / "docs.npy")
    for i, text in enumerate(texts):
        assert tokens[starts[i]:starts[i + 1]].tolist() == tokenizer.encode(text).ids + [EOS_ID]
    # The dataset keeps its tokenizer: moving the original away loses nothing.
    assert (tmp_path / "ds" / "tokenizer.json").read_text() == (
        tmp_path / "tokenizer.json").read_text()
    off = prepare([corpus / "b.jsonl"], tmp_path / "tokenizer.json", tmp_path / "off",
                  eval_fraction=0.0, append_eod=False)
    assert off["eod_id"] is None and off["n_tokens"] == meta["n_tokens"] - 12
    log = io.StringIO()
    byte_level = prepare([corpus / "b.jsonl"], "bytes", tmp_path / "bytes", log=log)
    assert byte_level["eod_id"] is None and "has no end-of-document token" in log.getvalue()


def test_json_lines_by_any_of_their_names_and_json_keys_only_with_them(corpus, tmp_path):
    """.ndjson and .JSONL are JSON lines (they were prepared as text: the JSON syntax
    trained on); --json-keys with a text input, a JSON-lines --data and --workers 0 are
    refused by name."""
    lines = (corpus / "b.jsonl").read_text()
    (tmp_path / "b.ndjson").write_text(lines)
    (tmp_path / "B.JSONL").write_text(lines)
    expected = prepare([corpus / "b.jsonl"], "bytes", tmp_path / "ref", eval_fraction=0.0)
    for name in ("b.ndjson", "B.JSONL"):
        meta = prepare([tmp_path / name], "bytes", tmp_path / f"ds-{name}", eval_fraction=0.0)
        assert (meta["n_docs"], meta["n_tokens"]) == (expected["n_docs"], expected["n_tokens"])
    with pytest.raises(ValueError, match=rf"--json-keys names fields of JSON lines, but "
                                         rf"{corpus / 'a.txt'} is read as plain text"):
        prepare([corpus / "b.jsonl", corpus / "a.txt"], "bytes", tmp_path / "mixed",
                json_keys=["text"])
    assert not (tmp_path / "mixed").exists()
    with pytest.raises(ValueError, match=r"--data .*b.ndjson is JSON lines, which --data does "
                                         r"not read directly: python -m mamba_jax.data prepare"):
        TokenDataset.load(tmp_path / "b.ndjson", vocab_size=256)
    with pytest.raises(ValueError, match=r"--workers=0 must be at least 1"):
        prepare([corpus / "a.txt"], "bytes", tmp_path / "w", workers=0)


def test_prepare_progress_writes_no_carriage_returns_into_a_log_file(tmp_path):
    files = []
    for i in range(25):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(f"file {i}\n")
    log = io.StringIO()  # not a terminal, as a redirected stderr
    prepare(files, "bytes", tmp_path / "ds", workers=1, log=log)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[-1] == "prepare: 25/25 files tokenized" and len(lines) <= 11


def test_data_errors_name_the_input_and_the_fix(corpus, tmp_path):
    absent = tmp_path / "absent"
    with pytest.raises(FileNotFoundError) as missing:
        TokenDataset.load(absent, vocab_size=256)
    assert "no such file or directory" in str(missing.value)
    assert f"--out {absent}" not in str(missing.value)  # no prepare into the missing path
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match=r"plain is a directory but not a prepared "
                                                r"dataset \(it has no meta.json\)"):
        TokenDataset.load(tmp_path / "plain", vocab_size=256)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"--data .*latin1.txt is not UTF-8 text \(byte 0xe9"):
        TokenDataset.load(tmp_path / "latin1.txt", vocab_size=256)
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text \(byte 0xe9"):
        prepare([tmp_path / "latin1.txt"], "bytes", tmp_path / "ds0", workers=1)
    prepare([corpus / "a.txt"], "bytes", tmp_path / "ds", eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"token id 119 >= the model's vocab_size=100; pass "
                                         r"--set vocab_size=256"):
        TokenDataset.load(tmp_path / "ds", vocab_size=100)
    # A dataset's file is not a text file (tokens.bin of byte ids is valid UTF-8)
    for name in ("tokens.bin", "meta.json"):
        with pytest.raises(ValueError, match=rf"--data .*ds/{name} is a file of the dataset "
                                             rf".*ds; give the folder: --data .*ds$"):
            load_data([str(tmp_path / "ds" / name)], vocab_size=256)


def test_a_byte_order_mark_is_no_character_of_the_text(tmp_path):
    bom = "\ufeff".encode()
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "b.txt").write_bytes(bom + b"plain")
    prepare([tmp_path / "a.jsonl", tmp_path / "b.txt"], "bytes", tmp_path / "ds", workers=1,
            append_eod=False)
    assert bytes(np.fromfile(tmp_path / "ds" / "tokens.bin", np.uint16).astype(np.uint8)) \
        == b"onetwoplain"
    assert bytes(np.asarray(TokenDataset.load(tmp_path / "b.txt", 256).tokens, np.uint8)) \
        == b"plain"


def test_prepare_names_inputs_that_json_keys_took(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--tokenizer", "bytes", "--json-keys", "text", str(corpus / "b.jsonl"),
              "--out", str(tmp_path / "ds")])
    assert exit_.value.code == 2
    assert (f"required: inputs (--json-keys took {corpus / 'b.jsonl'} as field names: give the "
            "inputs before --json-keys)") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prepare", "--tokenizer", "bytes", "--out", str(tmp_path / "ds")])
    assert capsys.readouterr().err.endswith("required: inputs\n")


# ------------------------------------------------------------------ Megatron-LM's data

SP_MODEL = Path(__file__).parent / "fixtures" / "megatron" / "tokenizer.model"


def megatron_index(lengths, documents, code, itemsize) -> bytes:
    """An MMapIndexedDataset .idx, written here from the layout of Megatron-LM's
    megatron/core/datasets/indexed_dataset.py (_IndexWriter): header, version 1, dtype
    code, sequence and document-index counts, lengths, byte pointers, document indices."""
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize
    return (b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([code])
            + len(lengths).to_bytes(8, "little") + len(documents).to_bytes(8, "little")
            + np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
            + np.asarray(documents, "<i8").tobytes())


def test_sentencepiece_model_has_megatrons_gpt_sentencepiece_semantics(tmp_path):
    import sentencepiece

    tok = load_tokenizer(SP_MODEL)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(SP_MODEL))
    text = "Permission is granted, free of charge: ünïcode 日本"
    # GPTSentencePieceTokenizer: tokenize = encode_as_ids (no BOS / EOS), detokenize =
    # decode_ids, eod = the model's eos, vocab = its pieces.
    assert tok.encode(text).ids == reference.encode_as_ids(text) and 2 not in tok.encode(text).ids
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() == 512
    assert special_tokens(tok) == {"bos": ("<s>", 1), "eos": ("</s>", 2), "pad": None}
    renamed = tmp_path / "spm.bin"  # not named .model: found out by reading it
    renamed.write_bytes(SP_MODEL.read_bytes())
    assert load_tokenizer(renamed).to_str() == tok.to_str() != byte_tokenizer().to_str()
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(ValueError, match=r"bad.model is not a SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")


def test_prepare_reads_json_keys_appends_eod_and_writes_megatrons_index(tmp_path):
    rows = [{"title": f"t{i}", "body": f"document {i} " + "words " * i} for i in range(5)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    meta = prepare([tmp_path / "c.jsonl"], SP_MODEL, tmp_path / "ds", eval_fraction=0.2,
                   json_keys=["body"])
    ds = tmp_path / "ds"
    assert (meta["eod_token"], meta["eod_id"], meta["tokenizer"]) == ("</s>", 2,
                                                                       "tokenizer.model")
    assert (ds / "tokenizer.model").read_bytes() == SP_MODEL.read_bytes()
    tok = load_tokenizer(SP_MODEL)
    docs = [tok.encode(r["body"]).ids + [2] for r in rows]
    assert np.fromfile(ds / "tokens.bin", np.uint16).tolist() == sum(docs, [])
    assert meta["dtype"] == "uint16"  # Megatron's for vocabularies under 65500 (code 8)
    lengths = [len(d) for d in docs]
    assert (ds / "tokens.idx").read_bytes() == megatron_index(lengths, range(6), 8, 2)
    # Two keys: each line's fields are documents in key order.
    meta = prepare([tmp_path / "c.jsonl"], SP_MODEL, tmp_path / "two", json_keys=["title", "body"])
    assert meta["n_docs"] == 10
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .* field\(s\) 'title' and 'body'"):
        prepare([tmp_path / "bad.jsonl"], "bytes", tmp_path / "bad", json_keys=["title", "body"])


def test_a_megatron_indexed_dataset_trains_as_it_is(tmp_path):
    # int32 tokens (code 4), documents of 1, 2 and 1 sequences (--split-sentences).
    seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [70000, 15, 16, 17, 18]]
    prefix = tmp_path / "corpus_text_document"
    Path(f"{prefix}.bin").write_bytes(np.asarray(sum(seqs, []), "<i4").tobytes())
    Path(f"{prefix}.idx").write_bytes(megatron_index([3, 2, 4, 5], [0, 1, 3, 4], 4, 4))
    ds = TokenDataset.load(prefix, vocab_size=100000)
    assert np.asarray(ds.tokens).tolist() == sum(seqs, [])
    assert ds.doc_starts.tolist() == [0, 3, 9, 14]
    assert ds.train_end == 9  # the last of 3 documents held out (rounded up to one)
    batch = ds._batch([0], 8)
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match=r"token id 70000 >= the model's vocab_size=1000"):
        TokenDataset.load(prefix, vocab_size=1000)._batch([9], 4)
    with pytest.raises(ValueError, match=r"corpus_text_document.bin is a file of the Megatron "
                                         r"dataset .*; give its prefix: --data .*document$"):
        TokenDataset.load(f"{prefix}.bin", vocab_size=100000)
    Path(f"{prefix}.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(40))
    with pytest.raises(ValueError, match=r"version 0, .* not an index this code reads"):
        TokenDataset.load(prefix, vocab_size=100000)


def test_a_blend_draws_rows_by_relative_weight_deterministically_per_step_and_seed(tmp_path):
    for name, offset in (("a", 0), ("b", 200)):
        Path(tmp_path / f"{name}.bin").write_bytes(
            (np.arange(4000) % 100 + offset).astype("<u2").tobytes())
        Path(tmp_path / f"{name}.idx").write_bytes(megatron_index([4000], [0, 1], 8, 2))
    ds = load_data(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")], 300)
    batches = [ds.train_batch(step, 16, 8, seed=3) for step in range(40)]
    from_b = np.mean([row[0] >= 200 for b in batches for row in b["inputs"]])
    assert 0.63 < from_b < 0.77  # 640 rows drawn with p = 0.7: 4.5 standard deviations
    again = ds.train_batch(17, 16, 8, seed=3)  # straight to step 17, as a resume does
    np.testing.assert_array_equal(again["inputs"], batches[17]["inputs"])
    assert not np.array_equal(ds.train_batch(17, 16, 8, seed=4)["inputs"], again["inputs"])
    halves = [ds.train_batch(17, 16, 8, seed=3, process_index=i, process_count=2)
              for i in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]),
                                  again["inputs"])
    # Weights are relative, as Megatron's: 2 and 1 draw two rows from a for one from b
    ds = load_data(["2", str(tmp_path / "a"), "1", str(tmp_path / "b")], 300)
    from_b = np.mean([row[0] >= 200 for step in range(40)
                      for row in ds.train_batch(step, 16, 8, seed=3)["inputs"]])
    assert 0.25 < from_b < 0.42  # 640 rows with p = 1/3: 4.5 standard deviations
    with pytest.raises(ValueError, match=r"each weight a positive number before its dataset"):
        load_data(["0.3", str(tmp_path / "a"), str(tmp_path / "b")], 300)
