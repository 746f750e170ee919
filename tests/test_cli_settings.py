"""The flags become settings once (hybriddl/cli/settings.py): a flag left out is the
settings' own default, and what `hybriddl compare` starts its ranks with reads back as the
settings it was given."""

import argparse

from hybriddl.cli import compare_ddp, compare_worker
from hybriddl.cli.compare import add_compare_arguments
from hybriddl.cli.settings import compare_config, hosts_options, measure_settings
from hybriddl.compare.settings import CompareConfig, MeasureSettings
from hybriddl.hosts.compression import Compression

SETTINGS = MeasureSettings(usecase="SimpleBig", model="squeezenet1_1", data="synthetic:40",
                           image_size=32, batch_size=8, steps=2, warmup=0, seed=3,
                           fp16_allreduce=True)


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
