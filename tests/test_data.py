import json

import numpy as np
import pytest

from mamba_jax.data import DEFAULT_CORPUS, TokenDataset, main, prepare
from mamba_jax.tokenizer import byte_tokenizer


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
    with pytest.raises(ValueError, match=r"hold no text"):
        prepare([tmp_path / "empty.txt"], "bytes", tmp_path / "ds0")
    prepare([corpus / "a.txt"], "bytes", tmp_path / "ds", eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"token id 119 >= the model's vocab_size=100"):
        TokenDataset.load(tmp_path / "ds", vocab_size=100)
    (corpus / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object"):
        prepare([corpus / "bad.jsonl"], "bytes", tmp_path / "ds1", workers=1)


def test_prepare_cli(corpus, tmp_path, capsys):
    main(["prepare", str(corpus / "b.jsonl"), "--tokenizer", "bytes", "--out",
          str(tmp_path / "ds"), "--eval-fraction", "0.1"])
    assert "in 12 documents (1 held out)" in capsys.readouterr().out


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "naïve — 数据\n\tend "
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text).ids) == text
