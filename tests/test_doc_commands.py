"""Every command block of README.md and docs/*.md runs as written.

Each ```bash block is one test (its id: file:line). It runs in bash, in a scratch folder
(so `runs/`, `profiles/`, `hosts.txt` and the like land there, never in the checkout), with
what a reader has there: `photos/` and `photos-test/` (ImageFolders) and `new-photos/`.
The block's own words are kept; only these are changed:

- size-shrinking flags are added after each hybriddl command's own (argparse keeps the
  last): `--epochs 1 --max-steps 2`, a small `--image-size` (`SMALLEST_IMAGE`), and
  `--tune-budget`/`--budget` of `TUNE_SECONDS` where the command would tune for 120 s or
  more, plus compare's `--steps 1 --warmup 0` (one step per contender) and tune's single
  round: sizes, not meanings;
- `.venv/bin/` is the venv running these tests (sys.executable's folder); `sudo` is dropped
  (such a block is marked `root` and skipped without it);
- an install step (`python3 -m venv .venv`, `.venv/bin/pip install ...`) and the test
  command are not run here: each must be one of the steps of `.ci/run`'s install-and-test
  line, which CI runs from scratch (`-q` and the `[test]` extra aside).

A block CI cannot run says so in the line before it, with the reason shown as the skip's:

    <!-- doc-test: skip (needs 3 real hosts reachable over ssh) -->
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, hybriddl_env
from sample_data import write_imagefolder, write_tinted_classes

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\s*\((?P<why>.+?)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
VENV_BIN = Path(sys.executable).parent
CI_RUN = REPO / ".ci" / "run"
# The smallest image each model takes (AlexNet's pooling needs 63 px); 32 px otherwise.
SMALLEST_IMAGE = {"SimpleBig": 64, "alexnet": 64}
# Tuning's budget in a test: enough for a few candidates at 32 px on 2 busy cores.
TUNE_SECONDS = "6"
SHRINK = {
    "train": ["--epochs", "1", "--max-steps", "2", "--tune-budget", TUNE_SECONDS],
    "tune": ["--budget", TUNE_SECONDS, "--rounds", "1", "--second-look", "0", "--steps", "1"],
    "compare": ["--steps", "1", "--warmup", "0"],
}
WITH_IMAGE_SIZE = {"train", "tune", "compare"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int          # the opening fence's line, 1-based
    text: str
    skip: str | None   # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def fenced_blocks(page: Path) -> list[tuple[int, str, str, str | None]]:
    """(line, language, text, skip reason) of every fenced block of a Markdown page."""
    lines = page.read_text().splitlines()
    blocks, opened, lang, marker = [], None, "", None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if opened is None and fence:
            previous = next((l for l in reversed(lines[:number - 1]) if l.strip()), "")
            found = SKIP.search(previous)
            opened, lang, marker = number, fence["lang"], found["why"] if found else None
        elif opened is not None and line.startswith("```"):
            blocks.append((opened, lang, "\n".join(lines[opened:number - 1]), marker))
            opened = None
    return blocks


def command_blocks() -> list[Block]:
    return [Block(page, line, text, why) for page in PAGES
            for line, lang, text, why in fenced_blocks(page) if lang == "bash"]


def logical_lines(text: str) -> list[str]:
    """The block's commands, backslash continuations joined, trailing comments dropped."""
    joined = re.sub(r"\\\n\s*", "", text)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        out.append(without_comment(line))
    return out


def without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (a word's start, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def normalised_step(step: str) -> str:
    """An install or test step as .ci/run's are compared: -q and the [test] extra aside."""
    return " ".join(w for w in shlex.split(step.replace("'.[test]'", "."))
                    if w not in ("-q",))


def ci_steps() -> set[str]:
    """The steps of .ci/run's install-and-test line."""
    line = next(l for l in CI_RUN.read_text().splitlines() if l.startswith("python3 -m venv"))
    return {normalised_step(step) for step in line.split(" && ")}


def is_ci_step(step: str) -> bool:
    words = shlex.split(step)
    return words[:3] == ["python3", "-m", "venv"] or words[:2] == [".venv/bin/pip", "install"] \
        or words[1:4] == ["-m", "pytest", "-q"]


def subcommand_at(words: list[str]) -> int | None:
    """Where the hybriddl subcommand of a step is: the command `emulate` starts, if that is
    hybriddl too; None when the step runs no hybriddl."""
    at = None
    for i, word in enumerate(words[:-1]):
        if word == "hybriddl" or word.endswith("/hybriddl"):
            at = i + 1
            if words[at] != "emulate":
                return at
    return at


def split_redirect(step: str) -> tuple[str, str]:
    """(the command, its redirection or pipe, if any)."""
    found = re.search(r"\s[>|]\s", step)
    return (step[:found.start()], step[found.start():]) if found else (step, "")


def shrunk(step: str) -> str:
    """One step with its size-shrinking flags added after its own."""
    command, rest = split_redirect(step)
    words = shlex.split(command)
    at = subcommand_at(words)
    if at is None:
        return step
    sub = words[at]
    extra = list(SHRINK.get(sub, []))
    if sub in WITH_IMAGE_SIZE:
        models = [SMALLEST_IMAGE[w] for w in words if w in SMALLEST_IMAGE]
        extra += ["--image-size", str(max(models, default=32))]
    if not extra:
        return step
    return command.rstrip() + " " + shlex.join(extra) + rest


def runnable(block: Block) -> tuple[str, list[str]]:
    """(the bash script this test runs, the steps left to .ci/run)."""
    script, left_to_ci = [], []
    for line in logical_lines(block.text):
        kept = []
        for step in line.split(" && "):
            if is_ci_step(step):
                left_to_ci.append(step)
                continue
            kept.append(shrunk(step))
        if kept:
            script.append(" && ".join(kept))
    text = "\n".join(script)
    text = re.sub(r"(^|[\s;&|(])sudo\s+", r"\1", text, flags=re.M)
    text = text.replace(".venv/bin/", f"{VENV_BIN}/")
    return text, left_to_ci


def needs(block: Block) -> list:
    """The markers a block's commands call for (tests/test_architecture.py's rules)."""
    text, marks = block.text, []
    emulated = re.search(r"\bsudo\b|hybriddl (compare|emulate)\b", text)
    if emulated:
        marks += [pytest.mark.root, pytest.mark.mpi, pytest.mark.emulated]
    elif "mpirun" in text or "hybriddl launch" in text:
        marks.append(pytest.mark.mpi)
    if re.search(r"\b(sbatch|srun)\b", text):
        marks.append(pytest.mark.slurm)
    if emulated or re.search(r"hybriddl (train|tune)\b", text):
        marks.append(pytest.mark.slow)  # training or tuning end to end
    return marks


BLOCKS = command_blocks()


def reader_folder(folder: Path) -> Path:
    """What the docs assume a reader has: their images, an evaluation set, new images."""
    for name in ("photos", "photos-test"):
        (folder / name).mkdir()
    write_tinted_classes(folder / "photos", per_class=8)
    write_tinted_classes(folder / "photos-test", per_class=2)
    write_imagefolder(folder / "new-photos", per_class=1)
    return folder


def check_outputs(script: str, folder: Path) -> None:
    """What each command promises to leave, read back."""
    from hybriddl.compare.settings import CONTENDERS

    for line in script.splitlines():
        for step in line.split(" && "):
            command, _ = split_redirect(step)
            words = shlex.split(command)
            at = subcommand_at(words)
            if at is None:
                continue
            sub, flags = words[at], words[at + 1:]

            def value(flag: str) -> str:  # the last one given, as argparse reads it
                return flags[len(flags) - flags[::-1].index(flag)]

            if sub == "train" and "--run-dir" in flags:
                metrics = json.loads((folder / value("--run-dir") / "metrics.json").read_text())
                assert metrics["epochs"], f"{step}: no epoch in metrics.json"
            if sub == "evaluate":
                assert (folder / flags[0] / "evaluation" / "evaluation.json").exists(), step
            if sub == "compare":
                comparison = json.loads((folder / value("--output") / "comparison.json")
                                        .read_text())
                names = [c["name"] for c in comparison["contenders"]]
                expected = value("--contenders").split(",") if "--contenders" in flags \
                    else list(CONTENDERS)
                assert sorted(names) == sorted(expected), f"{step}: contenders {names}"
                assert "hybrid" in names and len(names) >= 2, f"{step}: hybrid beside a peer"
            redirect = re.search(r"\s>\s*(\S+)", step)
            if redirect:
                assert (folder / redirect[1]).stat().st_size > 0, f"{step}: empty output"


def test_the_docs_have_command_blocks_and_markers_name_a_reason():
    assert len(BLOCKS) >= 8, [b.id for b in BLOCKS]
    readme = [b for b in BLOCKS if b.page.name == "README.md"]
    assert any("hybriddl compare" in b.text and b.skip is None for b in readme)
    for page in PAGES:
        for match in re.finditer(r"<!--\s*doc-test:(.*?)-->", page.read_text(), re.S):
            assert SKIP.fullmatch(match[0]), f"{page.name}: a marker without its reason: {match[0]}"


def test_every_fenced_block_of_the_guides_says_its_language():
    """An unlabelled block would escape the runner; docs/cli.md is --help output, generated."""
    for page in PAGES:
        if page.name == "cli.md":
            continue
        unlabelled = [line for line, lang, _, _ in fenced_blocks(page) if not lang]
        assert unlabelled == [], f"{page.relative_to(REPO)}: label lines {unlabelled} " \
                                 "(bash for commands, text for output)"


def test_install_and_test_steps_are_ci_run_steps():
    """The README's install steps are .ci/run's, which CI runs from scratch."""
    steps = [s for b in BLOCKS for s in runnable(b)[1]]
    assert steps, "no install step found in the docs"
    assert not [s for s in steps if normalised_step(s) not in ci_steps()], ci_steps()


def test_runnable_adds_only_shrinking_flags():
    block = Block(REPO / "README.md", 1, "sudo .venv/bin/hybriddl emulate --hosts 2 -- \\\n"
                  "    .venv/bin/hybriddl train --usecase SimpleBig --run-dir runs/x  # note\n"
                  "hybriddl predict runs/x new/ > out.csv\n", None)
    script, _ = runnable(block)
    first, second = script.splitlines()
    assert first == (f"{VENV_BIN}/hybriddl emulate --hosts 2 -- {VENV_BIN}/hybriddl train "
                     "--usecase SimpleBig --run-dir runs/x --epochs 1 --max-steps 2 "
                     f"--tune-budget {TUNE_SECONDS} --image-size 64")
    assert second == "hybriddl predict runs/x new/ > out.csv"


def on_hosts(block: Block) -> bool:
    """Whether the block starts MPI ranks, emulated hosts or SLURM: it runs from
    tests/test_doc_commands_on_hosts.py (beside other tests, as the blocks here do)."""
    return any(mark.name in ("root", "mpi", "emulated", "slurm") for mark in needs(block))


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=needs(b)) for b in BLOCKS
                                   if not on_hosts(b)])
def test_command_block_runs_as_written(block: Block, tmp_path):
    run_block(block, tmp_path)


def run_block(block: Block, tmp_path: Path) -> None:
    """Run the block as written (shrunk), or skip it saying why."""
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    script, left_to_ci = runnable(block)
    if not script:
        pytest.skip(f"{block.id}: CI runs it: each of its {len(left_to_ci)} steps is one of "
                    ".ci/run's (test_install_and_test_steps_are_ci_run_steps)")
    if re.search(r"\bsudo\b", block.text) and os.geteuid() != 0:
        pytest.skip(f"{block.id}: needs root (emulated hosts are network namespaces)")
    if f"{VENV_BIN}/activate" in script and not (VENV_BIN / "activate").exists():
        pytest.skip(f"{block.id}: the tests do not run in a venv ({sys.executable})")
    folder = reader_folder(tmp_path)
    done = run_script(script, folder)
    assert done.returncode == 0, f"{block.id} failed (exit {done.returncode}):\n{script}\n" \
                                 f"{(done.stdout + done.stderr)[-4000:]}"
    check_outputs(script, folder)


def run_script(script: str, folder: Path) -> subprocess.CompletedProcess:
    """The block's script in bash, stopping at its first failing command."""
    env = hybriddl_env(PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=1200)


def test_a_block_with_a_broken_command_fails(tmp_path):
    """What a README edit that breaks a command meets: the block's exit is not 0."""
    good = Block(REPO / "README.md", 1, ".venv/bin/hybriddl --version > version.txt\n", None)
    broken = Block(REPO / "README.md", 1, ".venv/bin/hybriddl --no-such-flag\n"
                   ".venv/bin/hybriddl --version > version.txt\n", None)
    assert run_script(runnable(good)[0], tmp_path).returncode == 0
    check_outputs(runnable(good)[0], tmp_path)
    (tmp_path / "version.txt").unlink()
    assert run_script(runnable(broken)[0], tmp_path).returncode == 2
    assert not (tmp_path / "version.txt").exists()  # stopped at the broken command
