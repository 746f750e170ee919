"""The command blocks of README.md and docs/*.md that start MPI ranks, emulated hosts or
SLURM, run as written (tests/test_doc_commands.py says how). What they assert (the exit
code, the files a block writes in its own folder) holds on a loaded machine, and their
hosts are their own: they run beside other tests (`beside`, tests/two_at_once.py), though
marked for what they start."""

from __future__ import annotations

import pytest

from test_doc_commands import BLOCKS, Block, needs, on_hosts, run_block


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[*needs(b), pytest.mark.beside])
                                   for b in BLOCKS if on_hosts(b)])
def test_command_block_runs_as_written(block: Block, tmp_path):
    run_block(block, tmp_path)


def test_the_blocks_on_hosts_are_here_and_the_others_there():
    here = [b.id for b in BLOCKS if on_hosts(b)]
    assert any(id.startswith("README.md") for id in here), here
    assert len(here) < len(BLOCKS)
