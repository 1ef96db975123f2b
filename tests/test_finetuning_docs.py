"""docs/finetuning.md's walk-through runs as written: every command of its bash blocks, in
order, in one folder, on the CPU: the page's download replaced by a tiny model brought to
its --local-dir (tests/fixtures/trained_tiny, a 2-layer Mamba2, with a tokenizer_config.json
naming the end-of-text token the page's template writes), its chats (repeated) as
chat.jsonl and its template as chat.jinja. A training command gets SMALL added (the last
value of a flag wins). What cannot run here is in NOT_RUN with why; then what the page says
each step leaves is checked."""

import importlib
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from mamba_jax.chat import ChatTemplate

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "finetuning.md"
FIXTURES = Path(__file__).parent / "fixtures"
# Commands that do not run here, by their first words, and why
NOT_RUN = {("pip",): "installs from the network",
           ("hf", "download"): "downloads the model: a tiny one is brought to its --local-dir",
           ("python", "-m", "mamba_jax.serve"): "a server, listening until it is stopped "
                                                 "(tests/test_serve.py runs it)",
           ("curl",): "a request to that server"}
SMALL = ["--steps", "2", "--batch-size", "8", "--seq-len", "128"]


def blocks(language: str) -> list[str]:
    """The contents of the page's ```language blocks, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), re.M | re.S)


def commands() -> list[list[str]]:
    """The words of each command of the bash blocks, as the shell splits them: a line ending
    in a backslash, or inside an open quote, goes on on the next."""
    found = []
    for block in blocks("bash"):
        pending = ""
        for line in block.splitlines():
            pending += line + "\n"
            if line.endswith("\\") or _open_quote(pending):
                continue
            if words := shlex.split(pending.replace("\\\n", " "), comments=True):
                found.append(words)
            pending = ""
    return found


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # no closing quotation: the command goes on on the next line
        return True
    return False


def not_run(words: list[str]) -> str | None:
    return next((why for start, why in NOT_RUN.items() if tuple(words[:len(start)]) == start),
                None)


def bring(folder: Path, download: list[str]) -> Path:
    """The tiny model where the download puts the model, and the page's chats and template."""
    model = folder / download[download.index("--local-dir") + 1]
    shutil.copytree(FIXTURES / "trained_tiny", model)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    rows = blocks("json")[0].splitlines()
    (folder / "chat.jsonl").write_text("\n".join(rows * 24) + "\n")
    (folder / "chat.jinja").write_text(blocks("jinja")[0])
    return model


def run(words: list[str]) -> None:
    """`python -m MODULE ARGS` as that module's main(ARGS), a training command with SMALL
    added (a resume with one step more than the run it resumes)."""
    assert words[:2] == ["python", "-m"] and words[2].startswith("mamba_jax."), words
    module, argv = words[2], words[3:]
    if module == "mamba_jax.train":
        argv += SMALL + (["--steps", "3"] if "--resume" in argv else [])
    try:
        main = importlib.import_module(module + ".__main__").main
    except ModuleNotFoundError:
        main = importlib.import_module(module).main
    main(argv)


def test_the_fine_tuning_walk_through_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ran, skipped = [], []
    for words in commands():
        if why := not_run(words):
            skipped.append(why)
            if words[:2] == ["hf", "download"]:
                model = bring(tmp_path, words)
            continue
        run(words)
        ran.append(words[2])
    assert len(skipped) == len(NOT_RUN)
    assert ran.count("mamba_jax.train") == 4 and {"mamba_jax.data", "mamba_jax.generate",
                                                   "mamba_jax.convert"} <= set(ran)
    out = capsys.readouterr().out
    # generate printed the chat prompt, then the reply
    prompt = next(w[w.index("--prompt") + 1] for w in commands() if "--prompt" in w)
    assert prompt.startswith("<|user|>\n") and out.count(prompt) == 1
    # the merged export: the base's layout, its tokenizer and the template it learned
    export = Path("runs/chat/model")
    assert json.loads((export / "config.json").read_text())["architectures"] == \
        ["Mamba2ForCausalLM"]
    assert ChatTemplate.from_model_dir(export).text == blocks("jinja")[0]
    assert (export / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    # convert of the newest checkpoint is the resumed run's export
    newest, merged = (load_file(d / "model.safetensors") for d in (Path("runs/chat/newest"),
                                                                    export))
    assert newest.keys() == merged.keys()
    for key in merged:
        np.testing.assert_array_equal(newest[key], merged[key], err_msg=key)
    peft = json.loads(Path("runs/chat/adapter/adapter_config.json").read_text())
    assert peft["base_model_name_or_path"] == str(model.absolute())
    assert peft["target_modules"] == ["in_proj"] and peft["r"] == 16
    for other in ("runs/chat-full/model", "runs/chat-ssm/model"):
        assert (Path(other) / "model.safetensors").is_file(), other

