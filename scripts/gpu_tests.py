"""Run the GPU tests on a GPU host and record their outcome in results/gpu_tests.json.

    python scripts/gpu_tests.py            # pytest -m gpu tests, then the JSON

The JSON names the GPU (gpu_name), the counts (passed, failed, skipped) with each test's
outcome, and the command, beside the usual provenance (cpu_model, torch, commit, date).
Without a CUDA device it writes nothing and exits 2: the GPU tests skip there, and a
record of skips would say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from bench_common import REPO, results_header
from hybriddl.files import atomic_write_json

COMMAND = ["-m", "pytest", "-q", "-m", "gpu", "tests", "-rs"]


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped, from pytest's JUnit XML."""
    found = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = ("failed" if kinds & {"failure", "error"} else
                       "skipped" if "skipped" in kinds else "passed")
    return found


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_tests: no CUDA device here: run it on a GPU host (nothing written)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        done = subprocess.run([sys.executable, *COMMAND, f"--junitxml={junit}"], cwd=REPO)
        tests = outcomes(junit)
    counts = {kind: sum(v == kind for v in tests.values()) for kind in ("passed", "failed", "skipped")}
    result = {**results_header("gpu_tests.py", argv), "gpu_name": torch.cuda.get_device_name(0),
              "gpu_count": torch.cuda.device_count(), "pytest": "python " + " ".join(COMMAND),
              "rows": [{"test": k, "outcome": v} for k, v in sorted(tests.items())], **counts}
    atomic_write_json(REPO / "results" / "gpu_tests.json", result)
    print(f"results/gpu_tests.json: {counts} on {result['gpu_name']}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
