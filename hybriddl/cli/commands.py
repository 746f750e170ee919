"""The commands, in the order `hybriddl --help` lists them, each with the line it shows
there. Apart from the commands' modules, so that `--help`, `--version` and a mistyped
command are answered from these names alone, without importing train's flags (and torch:
seconds)."""

COMMANDS = {
    "train": "train a use case on this host (or under mpirun)",
    "compare": "hybrid vs Horovod's model vs PyTorch DDP on emulated hosts: speed, bytes per "
               "host NIC, memory",
    "tune": "measure every feasible local strategy here, keep the fastest as this host's profile",
    "report": "PNG charts and a Markdown table from run directories",
    "info": "this host: cores, RAM, GPUs, library versions",
    "emulate": "run a command under mpirun across H emulated hosts (network namespaces, needs "
               "root) and report the bytes each host's NIC sent and received",
    "evaluate": "a run's model on a labelled ImageFolder: accuracy, per-class precision, recall "
                "and F1, confusion matrix (JSON and PNG)",
    "predict": "a run's model on images: file, class and probability per image, as CSV on "
               "stdout (or --output FILE)",
    "launch": "run 'train' under mpirun, one rank per host of a hostfile; relaunch from the "
              "checkpoint on the hosts that still answer when one is lost",
}


def a_path(text: str) -> str:
    """argparse's type for a file or folder argument: an empty one (`""`, an unset shell
    variable) would name the current directory and read or write there."""
    if not text.strip():
        raise ValueError("empty")
    return text


a_path.__name__ = "path (not empty)"  # argparse's "invalid path (not empty) value: ''"
