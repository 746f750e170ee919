"""The command line's dispatch (hybriddl/cli/__init__.py): a command's module is imported only
when it runs, so that the commands that only start processes (emulate, launch) load no torch,
and the parser of one command reads a command line as the whole parser does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import hybriddl_env
from hybriddl.cli import COMMANDS, build_parser, command_named


@pytest.mark.parametrize("argv, says", [
    (["emulate", "--hosts", "0", "--", "true"], "--hosts 0: give between 1 and 250 hosts"),
    (["launch", "--hostfile", "hosts", "--", "train"], "exactly one run directory"),
])
def test_the_commands_that_only_start_processes_load_no_torch(argv, says, tmp_path):
    """Through the console script's whole path (allocator, parser, command, its one-line
    error): -X importtime lists every module the process imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hybriddl", *argv],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=hybriddl_env())
    assert done.returncode == 2, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "hybriddl.usecases" in imported and "hybriddl.display" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "torchvision")]
    assert "hybriddl: error: " in done.stderr and says in done.stderr


def test_the_command_is_read_past_the_options_before_it():
    assert command_named(["--allocator", "glibc", "train", "--epochs", "1"]) == "train"
    assert command_named(["--allocator=glibc", "emulate", "--hosts", "2"]) == "emulate"
    assert command_named(["--version"]) is None and command_named([]) is None
    assert command_named(["-h", "train"]) is None  # the help lists every command
    assert command_named(["trian", "train"]) is None  # the whole parser names the typo


@pytest.mark.parametrize("argv", [
    ["train", "--usecase", "SimpleBig", "--image-size", "64", "--strategy", "threads",
     "--workers", "2", "--overlap", "--compression", "powersgd:2"],
    ["emulate", "--hosts", "2", "--bandwidth", "1gbit", "--speedup", "20", "--", "true"],
    ["--allocator", "glibc", "launch", "--hostfile", "hosts", "--min-hosts", "2", "--",
     "train", "--run-dir", "r"],
])
def test_one_commands_parser_reads_a_command_line_as_the_whole_parser(argv):
    whole, alone = (vars(build_parser(command).parse_args(argv))
                    for command in (None, command_named(argv)))
    assert whole == alone


def test_every_command_has_its_module_and_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command} " in listed, command
        with pytest.raises(SystemExit) as help_asked:  # its module registers it by its name
            build_parser(command).parse_args([command, "--help"])
        assert help_asked.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: hybriddl {command} "), command


@pytest.mark.parametrize("argv, code, says", [
    (["--help"], 0, "    launch  "), (["--version"], 0, "hybriddl 0.1.0"),
    (["trian"], 2, "invalid choice: 'trian'"), ([], 2, "required: command"),
])
def test_help_version_and_a_mistyped_command_load_no_torch(argv, code, says, tmp_path):
    """They are answered from the commands' names and help lines (cli/commands.py), in a
    fraction of a second: train's flags import torch and torchvision, some 7 s here."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hybriddl", *argv],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=hybriddl_env())
    assert done.returncode == code, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    assert "hybriddl.cli.commands" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "torchvision")]
    assert says in done.stdout + done.stderr


def test_the_names_alone_give_the_whole_parsers_help():
    whole, names = (build_parser(names_only=light).format_help() for light in (False, True))
    assert names == whole


def test_a_system_error_no_check_foresaw_is_one_line_naming_the_file(monkeypatch, capsys):
    """An OSError a command did not turn into its own line (an I/O error, a folder this user
    cannot search) ends the command with one line naming the file, exit 1, not a traceback."""
    import errno
    import os

    import hybriddl.cli.info as info
    from hybriddl.cli import main

    def failing(args):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "/data/shard-3")

    monkeypatch.setattr(info, "cmd_info", failing)
    assert main(["info"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "hybriddl: error: /data/shard-3: Input/output error", err
