"""Instruction data: `prepare --format chat | prompt-completion` renders rows as transformers'
apply_chat_template does (tests/fixtures/chat, saved from transformers) and stores a loss
mask beside the tokens; PackedDataset packs whole documents into rows with their document
ids; bad rows are one line naming the file, the row and the fix; the trainer runs on it."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from mamba_jax.chat import ChatTemplate
from mamba_jax.cli import MissingDependency
from mamba_jax.data import BlendedDataset, PackedDataset, TokenDataset, main, prepare

FIXTURES = Path(__file__).parent / "fixtures" / "chat"


def cases(name):
    """transformers' renderings of the fixture's conversations that have an assistant turn,
    without the generation prompt."""
    expected = json.loads((FIXTURES / name / "expected.json").read_text(encoding="utf-8"))
    return [c for c in expected["cases"] if "error" not in c and not c["add_generation_prompt"]
            and not c["tools"] and any(m["role"] == "assistant" for m in c["messages"])]


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def stored(out: Path):
    """(documents' tokens, documents' masks) of a prepared dataset."""
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / "tokens.bin", meta["dtype"])
    mask = np.fromfile(out / "loss_mask.bin", np.uint8)
    starts = np.load(out / "docs.npy")
    return ([tokens[a:b].tolist() for a, b in zip(starts, starts[1:])],
            [mask[a:b].tolist() for a, b in zip(starts, starts[1:])])


@pytest.mark.parametrize("name", ["generation", "headers", "chatml"])
def test_chats_are_stored_as_transformers_tokenizes_them_with_the_assistants_mask(name, tmp_path):
    """The token ids of apply_chat_template(tokenize=True); where the template has
    {% generation %} blocks, the mask is transformers' return_assistant_tokens_mask; the
    others mask each assistant turn's own tokens (its text and end of turn), nothing else."""
    chats = cases(name)
    rows = write_rows(tmp_path / "chats.jsonl", [{"messages": c["messages"]} for c in chats])
    meta = prepare([rows], FIXTURES / name, tmp_path / "ds", eval_fraction=0.0, fmt="chat")
    ids, masks = stored(tmp_path / "ds")
    assert ids == [c["ids"] for c in chats] and meta["format"] == "chat"
    assert meta["n_trained"] == sum(map(sum, masks)) > 0
    if name == "generation":
        assert masks == [c["assistant_masks"] for c in chats]
    tokenizer = Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json"))
    for chat, doc, mask in zip(chats, ids, masks):
        trained = tokenizer.decode([t for t, m in zip(doc, mask) if m], skip_special_tokens=False)
        replies = [m["content"] for m in chat["messages"] if m["role"] == "assistant"]
        assert all(reply.strip() in trained for reply in replies)
        assert not any(m["content"].strip() and m["content"].strip() in trained
                       for m in chat["messages"] if m["role"] == "user")


def test_prompt_completion_rows_train_the_completion_and_its_end_of_text(tmp_path):
    """Strings (TRL's): prompt and completion tokenized together, the model folder's
    eos_token after them, trained from the completion on; messages: the prompt rendered
    with the generation prompt not trained, the rest of the conversation trained."""
    folder = FIXTURES / "chatml"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")  # tokenizer_config.json's eos_token
    conversation = cases("chatml")[0]["messages"]  # user, assistant
    rows = [{"prompt": "The licence is", "completion": " free software."},
            {"prompt": "Say", "completion": ""},
            {"prompt": conversation[:1], "completion": conversation[1:]}]
    meta = prepare([write_rows(tmp_path / "pc.jsonl", rows)], folder, tmp_path / "ds",
                   eval_fraction=0.0, fmt="prompt-completion")
    ids, masks = stored(tmp_path / "ds")
    assert meta["eod_token"] == "<|im_end|>"
    for row, doc, mask in zip(rows[:2], ids, masks):
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False).ids
        assert doc == tokenizer.encode(row["prompt"] + row["completion"],
                                       add_special_tokens=False).ids + [eos]
        assert mask == [0] * len(prompt) + [1] * (len(doc) - len(prompt))
    template = ChatTemplate.from_model_dir(folder)
    head = template.encode(tokenizer, conversation[:1], add_generation_prompt=True)
    assert ids[2] == cases("chatml")[0]["ids"]  # transformers' rendering of the whole chat
    assert masks[2] == [0] * len(head) + [1] * (len(ids[2]) - len(head)) and len(head) > 3


def test_prompt_completion_masks_from_where_the_pair_parts_from_the_prompt(tmp_path):
    """A token that joins the prompt's end and the completion's start trains, and a template
    whose generation prompt the reply does not continue masks from where they part: TRL's
    common_prefix_length. The masks are TRL 1.16's (SFTTrainer's tokenize_fn, by hand with
    transformers 5.24); counting the prompt's own ids instead left the joined token out, and
    where they outnumbered the pair's gave a mask longer than the document."""
    rows = [{"prompt": "the Licen", "completion": "se"},  # "Licen" + "se": one token
            {"prompt": "Copyri", "completion": "ght"},
            {"prompt": [{"role": "user", "content": "hi"}],
             "completion": [{"role": "assistant", "content": "Sure."}]}]
    template = tmp_path / "think.jinja"  # the generation prompt opens an empty thought
    template.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
                        "m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if "
                        "add_generation_prompt %}{{ '<|im_start|>assistant\\n<think></think>' }}"
                        "{% endif %}")
    prepare([write_rows(tmp_path / "pc.jsonl", rows)], FIXTURES / "chatml", tmp_path / "ds",
            eval_fraction=0.0, fmt="prompt-completion", chat_template=template)
    ids, masks = stored(tmp_path / "ds")
    assert ids[:2] == [[317, 68, 328, 513], [34, 78, 355, 359, 513]]
    assert masks == [[0, 0, 1, 1], [0, 0, 0, 1, 1], [0] * 17 + [1] * 6]
    assert len(ids[2]) == 23


def test_a_template_writing_special_tokens_the_tokenizer_does_not_name_is_said(tmp_path):
    """A --chat-template file beside a tokenizer file (no tokenizer_config.json names its
    special tokens) renders its eos_token as empty text, as transformers would without
    one: the chats lose their ends of turn, which prepare says (it said nothing)."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% if m['role'] == "
                        "'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
    rows = write_rows(tmp_path / "c.jsonl", [{"messages": CHAT}])
    for tokenizer, said in ((FIXTURES / "chatml" / "tokenizer.json", True),
                            (FIXTURES / "chatml", False)):
        log = io.StringIO()
        prepare([rows], tokenizer, tmp_path / "ds", eval_fraction=0.0, fmt="chat",
                chat_template=template, log=log, overwrite=True)
        assert (f"prepare: {template} writes eos_token, which --tokenizer {tokenizer} does "
                "not name" in log.getvalue()) == said


def test_a_role_the_template_takes_is_rendered(tmp_path):
    """Which roles there are is the template's to say, as in transformers: Llama 3.1's
    "ipython" (tool output) renders where the template takes it (it was refused as no
    OpenAI role)."""
    chat = [*CHAT, {"role": "ipython", "content": "42"}, {"role": "assistant", "content": "ok"}]
    prepare([write_rows(tmp_path / "chats.jsonl", [{"messages": chat}])], FIXTURES / "chatml",
            tmp_path / "ds", eval_fraction=0.0, fmt="chat")
    (doc,), (mask,) = stored(tmp_path / "ds")
    tokenizer = Tokenizer.from_file(str(FIXTURES / "chatml" / "tokenizer.json"))
    assert "<|im_start|>ipython\n42<|im_end|>" in tokenizer.decode(doc, skip_special_tokens=False)
    assert tokenizer.decode([t for t, m in zip(doc, mask) if m], skip_special_tokens=False) == \
        "hello<|im_end|>\nok<|im_end|>\n"


def test_a_rows_tools_and_template_arguments_reach_the_template(tmp_path):
    """A row's "tools" (a list, or its JSON text as Parquet columns hold it) and
    "chat_template_kwargs" render with its messages, as TRL's SFTTrainer passes them to
    apply_chat_template: transformers' rendering with the tools (they were dropped)."""
    case = next(c for c in json.loads((FIXTURES / "reasoning" / "expected.json").read_text(
        encoding="utf-8"))["cases"] if c["tools"] and not c["add_generation_prompt"])
    template = tmp_path / "flag.jinja"  # the reasoning fixture's, after a template variable
    template.write_text("{{ greeting }}" + json.loads(
        (FIXTURES / "reasoning" / "tokenizer_config.json").read_text())["chat_template"])
    rows = [{"messages": case["messages"], "tools": case["tools"],
             "chat_template_kwargs": {"greeting": ""}},
            {"messages": case["messages"], "tools": json.dumps(case["tools"]),
             "chat_template_kwargs": {"greeting": "<|im_end|>"}}]
    prepare([write_rows(tmp_path / "chats.jsonl", rows)], FIXTURES / "reasoning",
            tmp_path / "ds", eval_fraction=0.0, fmt="chat", chat_template=template)
    ids, _ = stored(tmp_path / "ds")
    im_end = Tokenizer.from_file(str(FIXTURES / "reasoning" / "tokenizer.json")).token_to_id(
        "<|im_end|>")
    assert ids == [case["ids"], [im_end] + case["ids"]]


def test_parquet_rows_and_a_json_array_give_the_json_lines_dataset(tmp_path):
    """Parquet rows, and a .json file holding one array of rows (datasets' to_json(lines=
    False), which load_dataset("json") reads; it was refused as a line that is not JSON),
    give what JSON lines give."""
    import pyarrow
    import pyarrow.parquet

    rows = [{"messages": c["messages"]} for c in cases("generation")]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "chats.parquet")
    write_rows(tmp_path / "chats.jsonl", rows)
    (tmp_path / "chats.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    for name in ("chats.parquet", "chats.jsonl", "chats.json"):
        prepare([tmp_path / name], FIXTURES / "generation", tmp_path / name.replace(".", "_"),
                eval_fraction=0.0, fmt="chat")
    assert stored(tmp_path / "chats_parquet") == stored(tmp_path / "chats_jsonl") == \
        stored(tmp_path / "chats_json")


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(MissingDependency, match=r"t.parquet is a Parquet file, which needs "
                                                r"pyarrow: pip install 'mamba-jax\[parquet\]'"):
        prepare([tmp_path / "t.parquet"], "bytes", tmp_path / "ds", fmt="text")


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("fmt,line,refusal", [
    ("chat", json.dumps({"messages": CHAT[:1]}), r"bad.jsonl:2: the chat has no assistant "
                                                 r"turn, so none of its tokens would train"),
    ("chat", json.dumps({"messages": [{"from": "human", "value": "x"}, CHAT[1]]}),
     r"bad.jsonl:2: \"messages\" message 0 has fields \['from', 'value'\], not a role; give "
     r"each message a role and content"),
    ("chat", json.dumps({"messages": [{"role": "", "content": "x"}, CHAT[1]]}),
     r"bad.jsonl:2: \"messages\" message 0 has role '', not a role"),
    ("chat", json.dumps([CHAT]), r"bad.jsonl:2: expected a JSON object with a \"messages\" "
                                 r"list \(--format chat\), got a list"),
    ("chat", '{"messages": [', r"bad.jsonl:2: expected .* got a line that is not JSON"),
    ("chat", json.dumps({"messages": [{"role": "tool", "content": "42"}, *CHAT]}),
     r"bad.jsonl:2: .*chat_template.jinja does not render this conversation: Unknown role: "
     r"tool"),  # the template's own raise_exception
    ("prompt-completion", json.dumps({"prompt": "p"}),
     r"bad.jsonl:2: expected a JSON object with \"prompt\" and \"completion\" fields "
     r"\(--format prompt-completion\), got a dict without 'completion'"),
    ("prompt-completion", json.dumps({"prompt": "p", "completion": 3}),
     r"bad.jsonl:2: \"prompt\" and \"completion\" are a str and a int"),
    ("chat", json.dumps({"messages": CHAT, "tools": "[{"}),
     r"bad.jsonl:2: \"tools\" is text that is not JSON"),
    ("chat", json.dumps({"messages": CHAT, "chat_template_kwargs": {"tools": []}}),
     r"bad.jsonl:2: \"chat_template_kwargs\" sets tools, which prepare gives the template"),
])
def test_bad_rows_are_one_line_naming_the_file_the_row_and_the_fix(tmp_path, fmt, line,
                                                                    refusal):
    first = {"messages": CHAT} if fmt == "chat" else {"prompt": "p", "completion": "c"}
    (tmp_path / "bad.jsonl").write_text(json.dumps(first) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=refusal):
        prepare([tmp_path / "bad.jsonl"], FIXTURES / "headers", tmp_path / "ds", fmt=fmt)


def test_bad_templates_files_and_flags_are_refused_in_one_line(tmp_path, capsys):
    rows = write_rows(tmp_path / "c.jsonl", [{"messages": CHAT}])
    run = lambda *argv: main(["prepare", *map(str, argv), "--out", str(tmp_path / "ds")])
    (tmp_path / "users.jinja").write_text("{% for m in messages %}{% if m.role == 'user' %}"
                                          "{{ m.content }}{% endif %}{% endfor %}")
    (tmp_path / "empty.jinja").write_text("")
    for argv, refusal in [
        ((rows, "--format", "chat", "--tokenizer", "bytes"),
         "--tokenizer bytes has no chat template (a model folder's tokenizer_config.json "
         "chat_template or chat_template.jinja); pass --chat-template FILE"),
        ((rows, "--format", "chat", "--tokenizer", FIXTURES / "chatml", "--chat-template",
          tmp_path / "empty.jinja"), "c.jsonl renders no tokens"),
        ((write_rows(tmp_path / "empty.jsonl", []), "--format", "chat", "--tokenizer",
          FIXTURES / "chatml"), "empty.jsonl holds no rows"),
        ((tmp_path / "c.txt", "--format", "prompt-completion", "--tokenizer", "bytes"),
         "--format prompt-completion reads rows of JSON lines, but"),
        ((rows, "--format", "chat", "--tokenizer", FIXTURES / "chatml", "--chat-template",
          tmp_path / "users.jinja"), None),  # renders no assistant turn: no token trains, said
    ]:
        (tmp_path / "c.txt").write_text("text")
        if refusal is None:
            run(*argv)
            assert "no row has a token to train on" in capsys.readouterr().err
            continue
        with pytest.raises(SystemExit):
            run(*argv)
        err = capsys.readouterr().err
        assert refusal in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "broken.jinja").write_text("{% for %}")
    (tmp_path / "raises.jinja").write_text("{{ messages[0].content + 1 }}")
    for template, refusal in [("broken.jinja", "broken.jinja: not a Jinja template"),
                              ("raises.jinja", "c.jsonl:1: .*raises.jinja does not render this "
                                               "conversation: TypeError")]:
        with pytest.raises(ValueError, match=refusal):
            prepare([rows], FIXTURES / "chatml", tmp_path / "ds2", fmt="chat",
                    chat_template=tmp_path / template)


def packed(tmp_path, lengths, trained_from=1, eval_fraction=0.0) -> PackedDataset:
    """A prepared prompt-completion dataset of byte documents of `lengths` bytes (each
    'a' * n + 'b' * 0..., the bytes from `trained_from` on trained)."""
    rows = [{"prompt": chr(65 + i % 26) * trained_from, "completion": chr(97 + i % 26) *
             (n - trained_from)} for i, n in enumerate(lengths)]
    prepare([write_rows(tmp_path / "pc.jsonl", rows)], "bytes", tmp_path / "ds",
            eval_fraction=eval_fraction, fmt="prompt-completion")
    dataset = TokenDataset.load(tmp_path / "ds", vocab_size=256)
    assert isinstance(dataset, PackedDataset)
    return dataset


def test_rows_hold_whole_documents_with_their_ids_and_resume_exactly(tmp_path):
    """Every training document once an epoch, whole, in one row (none longer than a row);
    seq_idx numbers a row's documents; no target crosses a document or is padding; batch s
    depends only on (s, seed), and each process reads its rows."""
    lengths = np.random.default_rng(0).integers(2, 20, 60)
    dataset = packed(tmp_path, lengths)
    seq_len, batch_size = 24, 4
    n_rows = dataset.train_rows(seq_len, seed=3)
    epoch = [dataset.train_batch(s, batch_size, seq_len, 3) for s in range(n_rows // batch_size)]
    seen = []
    for batch in epoch:
        for inputs, targets, seq_idx, mask in zip(*(batch[k] for k in (
                "inputs", "targets", "seq_idx", "loss_mask"))):
            row = np.concatenate([inputs, targets[-1:]])
            starts = np.flatnonzero(np.diff(seq_idx, prepend=-1))
            for k, (a, b) in enumerate(zip(starts, [*starts[1:], seq_len])):
                assert np.all(seq_idx[a:b] == k)
                doc = row[a:b + 1] if b == seq_len or k + 1 == len(starts) else row[a:b]
                if doc[0] != 0:  # a document, not the padding after the last
                    seen.append(bytes(doc.astype(np.uint8)).rstrip(b"\0"))
            # the first target of every document and the padding's are not trained
            boundaries = seq_idx[1:] != seq_idx[:-1]
            assert not mask[:-1][boundaries].any() and not mask[targets == 0].any()
            assert np.array_equal(mask, (targets >= 97) & (np.diff(np.concatenate(
                [seq_idx, [seq_idx[-1] + (targets[-1] == 0)]])) == 0))
    texts = [chr(65 + i % 26).encode() + chr(97 + i % 26).encode() * (n - 1)
             for i, n in enumerate(lengths)]
    whole_epoch = (n_rows // batch_size) * batch_size == n_rows
    assert sorted(seen) == sorted(texts) or not whole_epoch
    again = dataset.train_batch(2, batch_size, seq_len, 3)
    for key in again:
        np.testing.assert_array_equal(again[key], epoch[2][key])
        np.testing.assert_array_equal(np.concatenate(
            [dataset.train_batch(2, batch_size, seq_len, 3, p, 2)[key] for p in range(2)]),
            epoch[2][key])
    assert not np.array_equal(dataset.train_batch(0, batch_size, seq_len, 4)["inputs"],
                              epoch[0]["inputs"])


def test_documents_longer_than_a_row_are_cut_and_counted(tmp_path):
    dataset = packed(tmp_path, [40, 5, 30, 6], trained_from=2)
    note = dataset.packing_note(16, seed=0)
    assert "4 training documents packed whole into" in note
    assert "2 longer than a row are cut to it" in note
    batch = dataset.rows_batch(range(dataset.train_rows(16, 0)), 16, 0)
    # 15 of each cut document's 16 targets, 3 and 4 of the others' (the first 2 not)
    assert batch["loss_mask"].sum() == 15 + 3 + 15 + 4
    assert sorted(batch["loss_mask"].sum(-1).tolist())[-2:] == [15, 15]


# At --seq-len 16, (prompt bytes, completion bytes) of documents of which 0 and 5 targets train
LATE, EARLY = (20, 10), (2, 5)


def shaped(tmp_path, name, shapes, eval_fraction=0.4) -> PackedDataset:
    """A prompt-completion dataset of byte documents of `shapes` [(prompt bytes, completion
    bytes)], the last eval_fraction held out."""
    rows = [{"prompt": "P" * p, "completion": "c" * c} for p, c in shapes]
    prepare([write_rows(tmp_path / f"{name}.jsonl", rows)], "bytes", tmp_path / name,
            eval_fraction=eval_fraction, fmt="prompt-completion")
    return TokenDataset.load(tmp_path / name, vocab_size=256)


def test_held_out_documents_that_keep_no_trained_token_in_a_row_are_not_evaluated(tmp_path):
    """Cut to a row, a document may keep no token to train on: a held-out one is not
    evaluated, so every evaluated row counts a token (held-out rows that counted none
    divided the evaluation by zero)."""
    mixed = shaped(tmp_path, "mixed", [LATE, EARLY, LATE, LATE, EARLY])  # 2 held out
    assert mixed.evaluates(16)
    assert [b["loss_mask"].sum(-1).tolist() for b in mixed.eval_batches(4, 16)] == [[5]]
    held_late = shaped(tmp_path, "held_late", [EARLY, EARLY, LATE, LATE, LATE])
    assert not held_late.evaluates(16) and not list(held_late.eval_batches(4, 16))
    assert "no held-out document keeps a token" in held_late.no_evaluation(16)


def test_training_documents_that_keep_no_trained_token_in_a_row_are_refused(tmp_path):
    """Training documents that keep no token to train on between them, cut to rows, are
    refused naming --seq-len (every step would skip its update: a run that trained nothing);
    the packing note counts the trained tokens a cut leaves out."""
    mixed = shaped(tmp_path, "mixed", [LATE, EARLY, LATE, LATE, EARLY])
    assert "2 longer than a row are cut to it: 20 of the 25 tokens to train on lie past " \
           "the cut" in mixed.packing_note(16, seed=0)
    with pytest.raises(ValueError, match=r"--seq-len 16 \+ 1 tokens, its training documents keep "
                                         r"no token to train on \(all 30 lie past the cut\); "
                                         r"raise --seq-len \(the longest document has 30"):
        shaped(tmp_path, "late", [LATE, LATE, LATE, EARLY, EARLY]).train_batch(0, 1, 16, 0)


def test_held_out_documents_are_evaluated_masked_and_a_blend_masks_every_row(tmp_path):
    dataset = packed(tmp_path, [8] * 10, trained_from=3, eval_fraction=0.2)
    assert dataset.evaluates(16)
    batches = list(dataset.eval_batches(4, 16))
    assert len(batches) == 1 and batches[0]["inputs"].shape == (1, 16)
    assert batches[0]["loss_mask"].sum() == 2 * 5  # two held-out documents
    assert set(np.unique(batches[0]["inputs"])) <= {0, 65 + 8, 65 + 9, 97 + 8, 97 + 9}
    for step in range(3):  # the training documents' prompts are A to H
        inputs = dataset.train_batch(step, 2, 16, 0)["inputs"]
        assert (inputs[(inputs >= 65) & (inputs < 97)] < 65 + 8).all()
    (tmp_path / "t.txt").write_text("plain text " * 200)
    blend = BlendedDataset([dataset, TokenDataset.load(tmp_path / "t.txt", 256)], [1, 1])
    batch = blend.train_batch(0, 8, 16, 0)
    text_rows = batch["inputs"].max(-1) > 97 + 10
    assert blend.masked and text_rows.any() and (~text_rows).any()
    assert batch["loss_mask"][text_rows].all() and not batch["loss_mask"][~text_rows].all()


def test_the_trainer_trains_on_chats_with_grad_accum_and_evaluates(tmp_path, capsys):
    from mamba_jax.convert import main as convert
    from mamba_jax.train import main as train

    chats = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                           {"role": "assistant", "content": "An answer. " * (1 + i % 3)}]}
             for i in range(40)]
    prepare([write_rows(tmp_path / "c.jsonl", chats)], FIXTURES / "chatml", tmp_path / "ds",
            eval_fraction=0.1, fmt="chat")
    train(["--data", str(tmp_path / "ds"), "--steps", "3", "--batch-size", "4",
           "--grad-accum", "2", "--mesh", "dp=2,tp=4", "--seq-len", "64", "--eval-every", "3",
           "--set", "d_model=32",
           "--set", "n_layer=1", "--set", "headdim=16", "--set", "d_state=16",
           "--set", "chunk_size=16", "--metrics-file", str(tmp_path / "m.jsonl"),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records) and "eval_loss" in records[-1]
    assert "36 training documents packed whole into" in capsys.readouterr().err
    # The export, the checkpoints and their conversion carry the template the chats were
    # rendered with, and its special tokens, as transformers saves them (serve and
    # apply_chat_template read them there; they were lost); the export's
    # tokenizer_config.json names the class that loads it.
    convert([str(tmp_path / "ckpt"), str(tmp_path / "converted"), "--to", "hf"])
    given = ChatTemplate.from_model_dir(FIXTURES / "chatml")
    for folder in (tmp_path / "out", tmp_path / "ckpt", tmp_path / "converted"):
        carried = ChatTemplate.from_model_dir(folder)
        assert (carried.text, carried.special_tokens) == (given.text, given.special_tokens)
        assert carried.source == str(folder / "chat_template.jinja")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    im_end = Tokenizer.from_file(str(FIXTURES / "chatml" / "tokenizer.json")).token_to_id(
        "<|im_end|>")  # where transformers' generate stops
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == im_end
