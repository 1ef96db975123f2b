"""The shell commands of README.md and docs/*.md run as written: every command of a fenced
bash / sh / shell / console block either runs here, on tiny sizes in a temporary folder, or
is on SKIP with the reason it cannot (a GPU, a network, a server that runs until stopped).

How a command runs: `python -m mamba_jax.X ARGS` (or `.venv/bin/python`, `python3`) calls
that module's main(ARGS) in a runner process of the device count its --mesh asks for (8
fake CPU devices otherwise), ARGS expanded as a shell would (globs). A training command
gets TRAIN_TINY appended (the command line's last value wins), and a recipe of a large
preset its model shrunk to the tiny preset's shape (TINY_MODEL; its name, and so its
default --out, kept). Commands run in a copy of the repository root's view: a folder
holding the recipes (train/) and what a user brings (bring: a tokenizer.json, JSON-lines
shards, and the dataset the Training section prepares where a later section trains on it).
The commands of one block run in order in one folder where they share a path (a block of
steps: prepare, train, resume, generate); each in a folder of its own otherwise (a block of
alternatives, each of which exports runs/tiny).

A failure names the file and line, the command as written and as run, its exit status and
the end of its output. Two runner processes (4 and 8 devices); about a minute on 2 cores.
"""

import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
PYTHON = re.compile(r"(\S*/)?python(3(\.\d+)?)?$")  # python, python3.12, .venv/bin/python

# Commands that cannot run here, by a pattern over the command (its words joined by one
# space), each with its reason. Every entry must match a documented command (no stale
# entry); a command neither run nor matched fails the test.
SKIP = {
    r"^python3(\.\d+)? -m venv ": "makes a virtual environment (CI's .ci/run runs the Quick "
                                  "start's line in a fresh clone)",
    r"^(\S*/)?pip install ": "installs packages from the network",
    r"^(\S*/)?python3? -m pytest": "the test suite itself (CI runs it through .ci/run)",
    r"^python3? -m bench\.": "a GPU benchmark (bench/; its numbers are BENCHMARKS.md's)",
    r"^(\S*/)?python3? -m mamba_jax\.serve ": "a server, listening until it is stopped "
                                              "(tests/test_serve.py runs it)",
    r"^curl ": "a request to a running server (tests/test_serve.py sends them)",
    r"^(\S*/)?python3? -m mamba_jax\.generate --server ": "the client of a running server "
                                                          "(tests/test_serve.py)",
    r"^python3? -m mamba_jax\.convert (ckpts .*|.* --to megatron)": (
        "a Megatron-LM checkpoint the user brings (ckpts/), read or written with torch, "
        "the megatron extra that CI does not install"),
    r"^lm_eval ": "lm-eval against a running server, its tasks' data from the network "
                  "(tests/test_serve.py replays its requests)",
    r"^git archive main \|": "the earlier commit's code for bench.serve_load --before (a GPU "
                             "benchmark)",
    r"^hf download |models/mamba2-130m|runs/chat": (
        "docs/finetuning.md's walk-through, from a model downloaded from the hub and the "
        "page's chats: tests/test_finetuning_docs.py runs it on a tiny model in their place"),
}
# The start of a line that is a command: an unlabelled block holding one must say ```bash.
COMMAND_LINE = re.compile(r"^(\$ )?((\S*/)?python3?(\.\d+)? -m |(\S*/)?pip |curl )")

TRAIN_TINY = ["--steps", "2", "--batch-size", "16", "--seq-len", "32", "--eval-every", "0"]
# A large preset's layers at the tiny preset's shape, by the preset's layer kinds.
TINY_MODEL = {frozenset("M"): ["--set", "n_layer=2", "--set", "d_model=128", "--set",
                               "mamba2.headdim=32", "--set", "mamba2.d_state=32", "--set",
                               "mamba2.chunk_size=64"]}
TINY_PRESETS = ("tiny", "tiny-mamba1", "mamba3-tiny")


@dataclass(frozen=True)
class Command:
    where: str  # FILE:LINE
    text: str  # as written, continuation lines joined
    argv: tuple  # its words, as the shell splits them
    block: str  # FILE:LINE of its block


def documented_commands() -> list[Command]:
    """Every command of the shell blocks of DOCS: one a line (a line ending in a backslash,
    or inside an open quote, goes on on the next), each side of `&&` or `;` one; comments
    and console prompts ($) dropped."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT)
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
            first = text.count("\n", 0, block.start(2)) + 1
            if block.group(1) not in SHELL_BLOCKS:
                assert block.group(1) or not any(map(COMMAND_LINE.match,
                                                     block.group(2).splitlines())), (
                    f"{name}:{first}: a block of commands without a language: label it "
                    "```bash (a block of Python ```python), so that its commands are run here")
                continue
            where, pending = None, ""
            for number, line in enumerate(block.group(2).splitlines(), first):
                where = where or number
                pending += re.sub(r"^\$ ", "", line) + "\n"
                if line.endswith("\\") or _open_quote(pending):
                    continue
                lexer = shlex.shlex(pending.replace("\\\n", " "), posix=True,
                                    punctuation_chars="&;|()")
                lexer.whitespace_split, lexer.commenters = True, "#"
                words, depth = [], 0  # a pipeline or a subshell ( ... ) is one command
                for word in [*lexer, ";"]:
                    depth += (word == "(") - (word == ")")
                    if word in ("&&", ";") and not depth:
                        if words:
                            found.append(Command(f"{name}:{where}", " ".join(words),
                                                 tuple(words), f"{name}:{first}"))
                        words = []
                    else:
                        words.append(word)
                where, pending = None, ""
    return found


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # "No closing quotation": the command goes on on the next line
        return True
    return False


def skip_reason(command: Command) -> str | None:
    return next((why for pattern, why in SKIP.items() if re.search(pattern, command.text)),
                None)


def as_run(command: Command, folder: Path) -> list[str]:
    """The module and argv a runnable command calls main with: globs expanded in `folder`,
    a training command's tiny sizes appended."""
    module, argv = command.argv[2], []
    for word in command.argv[3:]:
        matches = sorted(str(p.relative_to(folder)) for p in folder.glob(word)) \
            if any(c in word for c in "*?[") else []
        argv += matches or [word]
    if module == "mamba_jax.train":
        argv += TRAIN_TINY + tiny_model(argv)
    return [module, *argv]


def tiny_model(argv: list[str]) -> list[str]:
    """--set flags shrinking the preset a training command names (by --preset, or its
    --config recipe's) to the tiny one's shape, or none for a tiny preset."""
    given = dict(zip(argv, argv[1:]))
    preset = given.get("--preset")
    if preset is None and "--config" in given:
        preset = tomllib.loads((ROOT / given["--config"]).read_text()).get("preset")
    if preset is None or preset in TINY_PRESETS:
        return []
    from mamba_jax import Mamba2Config
    kinds = frozenset(Mamba2Config.preset(preset).layers)
    assert kinds in TINY_MODEL, (f"no tiny shape for preset {preset!r} (layers {sorted(kinds)}) "
                                 "in TINY_MODEL: add one")
    return TINY_MODEL[kinds]


def devices(run: list[str]) -> int:
    """The devices a command's --mesh asks for (its last), 8 where it asks none."""
    meshes = [value for flag, value in zip(run, run[1:]) if flag == "--mesh"]
    if not meshes:
        return 8
    return eval("*".join(size for part in meshes[-1].split(",")  # noqa: S307 - digits only
                         for size in re.findall(r"=(\d+)", part)) or "8")


# The dataset the Training section prepares (its step 1), which later sections train on.
PREPARED = "data/corpus"


def bring(folder: Path, unit: list) -> None:
    """What a user brings that the commands read, stand-ins in `folder`: the recipes (the
    repository's train/), a tokenizer.json and JSON-lines shards, and PREPARED from them
    where a command of the unit reads it and none prepares it."""
    from bpe import bpe_tokenizer

    from mamba_jax.data import prepare

    (folder / "train").symlink_to(ROOT / "train")  # the recipes, from the repository root
    bpe_tokenizer(folder / "tokenizer.json")
    (folder / "shards").mkdir()
    corpus = (ROOT / "mamba_jax" / "corpus" / "licenses.txt").read_text()
    lines = [json.dumps({"text": corpus[i:i + 2000]}) for i in range(0, 60000, 2000)]
    (folder / "shards" / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    words = [set(c.argv) for c in unit]
    if any(PREPARED in w for w in words) and not any({"prepare", PREPARED} <= w for w in words):
        prepare([folder / "shards" / "part-0.jsonl"], str(folder / "tokenizer.json"),
                folder / PREPARED, log=io.StringIO())


RUNNER = r"""
import contextlib, importlib, io, json, os, sys, time, traceback
spec = json.loads(open(sys.argv[1]).read())
results = []
for unit in spec:
    os.chdir(unit["folder"])
    for command in unit["commands"]:
        module, argv = command["run"][0], command["run"][1:]
        out, began, status = io.StringIO(), time.perf_counter(), 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    main = importlib.import_module(module + ".__main__").main
                except ModuleNotFoundError:
                    main = importlib.import_module(module).main
                main(argv)
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            status, _ = 1, out.write(traceback.format_exc())
        results.append({"where": command["where"], "status": status or 0,
                        "seconds": time.perf_counter() - began,
                        "output": out.getvalue()[-3000:]})
        if status:
            break  # the rest of a sequence reads what this one would have written
json.dump(results, open(sys.argv[2], "w"))
"""


@pytest.mark.subprocess
def test_every_command_in_the_docs_is_on_the_skip_list_or_runs_here_as_written(tmp_path):
    commands = documented_commands()
    assert commands, "no commands found: the parser or DOCS is wrong"
    skipped = {c: why for c in commands if (why := skip_reason(c))}
    unused = [p for p in SKIP if not any(re.search(p, c.text) for c in commands)]
    assert not unused, f"SKIP entries no documented command matches (remove them): {unused}"
    runnable = [c for c in commands if c not in skipped]
    strange = [c for c in runnable if not (PYTHON.fullmatch(c.argv[0]) and
                                           c.argv[1:3] and c.argv[1] == "-m"
                                           and c.argv[2].startswith("mamba_jax"))]
    assert not strange, "\n".join(
        f"{c.where}: `{c.text}` neither runs here (python -m mamba_jax...) nor is on SKIP: "
        "make it run as written, or add it to SKIP with the reason" for c in strange)

    # Units run in one folder, in order: a block whose commands share a path, or one
    # command; the same command written twice (README and docs/parallel.md) runs once.
    units, seen = [], set()
    for block in dict.fromkeys(c.block for c in runnable):
        members = [c for c in runnable if c.block == block and c.text not in seen]
        seen.update(c.text for c in members)
        paths = [{w for w in c.argv if "/" in w} for c in members]
        shared = any(a & b for i, a in enumerate(paths) for b in paths[i + 1:])
        units += [members] if shared else [[c] for c in members]

    by_devices = {}
    for i, unit in enumerate(units):
        folder = tmp_path / f"unit{i}"
        folder.mkdir()
        bring(folder, unit)
        runs = [as_run(c, folder) for c in unit]
        counts = {devices(run) for run in runs}
        assert len(counts) == 1, f"{unit[0].block}: one sequence asks for {counts} devices"
        by_devices.setdefault(counts.pop(), []).append({
            "folder": str(folder),
            "commands": [{"where": c.where, "run": run} for c, run in zip(unit, runs)]})
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
           "JAX_PLATFORMS": "cpu"}
    processes = []
    for count, spec in by_devices.items():
        (tmp_path / f"spec{count}.json").write_text(json.dumps(spec))
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       env.get("XLA_FLAGS", ""))
        processes.append((tmp_path / f"results{count}.json", subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(tmp_path / f"spec{count}.json"),
             str(tmp_path / f"results{count}.json")], cwd=tmp_path,
            env={**env, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count="
                                     f"{count}"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)))
    results = {}
    for path, process in processes:
        output = process.communicate(timeout=600)[0]
        assert process.returncode == 0, f"the runner failed: {output[-3000:]}"
        results.update({r["where"]: r for r in json.loads(path.read_text())})
    failures = []
    for unit in units:
        for c in unit:
            r = results.get(c.where)
            run = " ".join(shlex.quote(w) for w in next(
                cmd["run"] for spec in by_devices.values() for u in spec
                for cmd in u["commands"] if cmd["where"] == c.where))
            if r is None:
                failures.append(f"{c.where}: `{c.text}` did not run (a command before it in "
                                "its block failed)")
            elif r["status"] != 0:
                failures.append(f"{c.where}: `{c.text}` (run as `python -m {run}`) exited "
                                f"{r['status']}:\n{r['output']}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.subprocess
def test_pytest_runs_without_xdist():
    """`pytest -p no:xdist` (one process, e.g. to debug) failed on pyproject's addopts,
    whose -n it did not know; xdist's workers are now asked for in conftest, where it is
    loaded."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "--co",
                           "tests/test_bench.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert re.search(r"\d+ tests collected", done.stdout)

