"""The flags become settings once (hybriddl/cli/settings.py): a flag left out is the
settings' own default, and what `hybriddl compare` starts its ranks with reads back as the
settings it was given."""

import argparse
from pathlib import Path

from hybriddl.cli import compare_ddp, compare_worker
from hybriddl.cli.compare import add_compare_arguments
from hybriddl.cli.train import add_training_args
from hybriddl.cli.tune import add_tune_args
from hybriddl.cli.settings import compare_config, hosts_options, measure_settings
from hybriddl.compare.settings import CompareConfig, MeasureSettings
from hybriddl.hosts.compression import Compression

SETTINGS = MeasureSettings(usecase="SimpleBig", model="squeezenet1_1", data="synthetic:40",
                           image_size=32, batch_size=8, steps=2, warmup=0, seed=3,
                           fp16_allreduce=True)
CLI = Path(__file__).resolve().parents[1] / "hybriddl" / "cli"


def help_of(add_arguments) -> str:
    """The help of a parser `add_arguments` filled, on one line."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return " ".join(parser.format_help().split())


def test_compare_flags_left_out_are_the_settings_defaults():
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    assert compare_config(parser.parse_args([])) == CompareConfig()
    typed = compare_config(parser.parse_args(["--contenders", "hybrid, ddp", "--hosts", "3"]))
    assert typed.contenders == ("hybrid", "ddp") and typed.hosts == 3


def test_a_contenders_ranks_read_back_the_settings_they_were_given():
    worker = compare_worker.build_parser().parse_args(
        ["--strategy", "flat", "--overlap", *SETTINGS.to_argv(), "--result-dir", "d"])
    ddp = compare_ddp.build_parser().parse_args(
        ["--processes", "2", *SETTINGS.to_argv(), "--result-dir", "d"])
    assert measure_settings(worker) == SETTINGS == measure_settings(ddp)
    assert hosts_options(worker)["compression"] is Compression.fp16


def test_a_rank_left_to_defaults_connects_with_connects_defaults():
    args = compare_worker.build_parser().parse_args(["--strategy", "flat", "--result-dir", "d"])
    assert measure_settings(args) == MeasureSettings()
    assert hosts_options(args) == {"overlap": False, "compression": Compression.none}
    assert args.host_parallel is None  # measure_training's own default then


def test_seed_steps_and_warmup_are_each_defined_once_for_every_command():
    """One definition per meaning (cli/flags.py), whichever commands share it."""
    source = "".join(path.read_text() for path in sorted(CLI.glob("*.py")))
    for flag in ("--seed", "--steps", "--warmup"):
        assert source.count(f'add_argument("{flag}"') == 1, flag
    for add_arguments in (add_training_args, add_compare_arguments):
        assert "initialisation, shuffling and augmentation seed" in help_of(add_arguments)
    for add_arguments, each in ((add_compare_arguments, ""), (add_tune_args, " per visit")):
        assert f"timed steps{each} (default:" in help_of(add_arguments)
        assert f"untimed steps{each} before them" in help_of(add_arguments)


def test_tune_left_to_its_defaults_times_the_tuners_steps(monkeypatch, cli_here, tmp_path):
    """tune's --steps and --warmup left out reach the tuner as left out (its defaults)."""
    from hybriddl.data import loading
    from hybriddl.errors import UsageError
    from hybriddl.tuning import tuner

    given = []

    def tune_host(settings, images, **kwargs):
        given.append(kwargs)
        raise UsageError("stopped here by the test")

    monkeypatch.setattr(tuner, "tune_images", lambda *args: [])
    monkeypatch.setattr(loading, "image_notes", lambda images: [])
    monkeypatch.setattr(tuner, "tune_host", tune_host)
    output = ["--output", str(tmp_path / "profile.json")]
    assert cli_here("tune", *output).returncode == 2
    assert cli_here("tune", *output, "--steps", "3", "--warmup", "0").returncode == 2
    assert "steps" not in given[0] and "warmup" not in given[0]
    assert given[1]["steps"] == 3 and given[1]["warmup"] == 0
