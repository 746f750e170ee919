"""Run the GPU tests on a GPU host and record their outcome in results/gpu_tests.json.

    python scripts/gpu_tests.py            # pytest -m gpu tests, then the JSON

The JSON names the GPU (gpu_name), the counts (passed, failed, skipped) with each test's
outcome, pytest's exit code and the command, beside the usual provenance (cpu_model,
torch, commit, date). When pytest ends without its report (a crash, a CUDA fault that
kills the interpreter, `--timeout` reached), the JSON records that instead: its exit code
and the last lines it printed. Without a CUDA device it writes nothing and exits 2: the
GPU tests skip there, and a record of skips would say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from bench_common import REPO, results_header, run_limited
from pages import Page
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


def run_and_record(command: list[str], output: Path, gpu_name: str, gpu_count: int,
                   argv=None, timeout: float | None = None) -> int:
    """Run pytest `command` (its arguments after the interpreter), echo its output, and
    write its outcome to `output`, a failure before its report included; its exit code."""
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        code, tail, timed_out = run_limited([sys.executable, *command, f"--junitxml={junit}"],
                                            timeout)
        try:
            tests, problem = outcomes(junit), None
        except (OSError, ElementTree.ParseError) as exc:
            tests = {}
            problem = (f"pytest ended (exit code {code}) without its report"
                       + (f", stopped at its limit of {timeout:g} s" if timed_out else "")
                       + f": {type(exc).__name__}")
    counts = {kind: sum(v == kind for v in tests.values()) for kind in ("passed", "failed", "skipped")}
    result = {**results_header("gpu_tests.py", argv), "gpu_name": gpu_name,
              "gpu_count": gpu_count, "pytest": "python " + " ".join(command),
              "exit_code": code, "rows": [{"test": k, "outcome": v} for k, v in sorted(tests.items())],
              **counts}
    if problem:
        result.update(failure=problem, last_lines=tail)
    atomic_write_json(output, result)
    print(f"{output}: {problem or counts} on {gpu_name}")
    return code if code else (1 if problem else 0)


# ---------------------------------------------------------------- its page in docs/benchmarks

def gpu_tests_table(data: dict) -> str:
    return ("| passed | failed | skipped |\n|---:|---:|---:|\n"
            f"| {data['passed']} | {data['failed']} | {data['skipped']} |")


def gpu_tests_setting(data: dict) -> str:
    return f"`{data['pytest']}` on {data['gpu_name']} (one of {data['gpu_count']} GPUs)"


PAGES = [
    Page("gpu_tests", "The GPU tests on a GPU", "results/gpu_tests.json", gpu_tests_table,
         gpu_tests_setting, ""),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, help="seconds before pytest is stopped "
                        "(recorded as a failure); default: none")
    parser.add_argument("--output", type=Path, default=REPO / "results" / "gpu_tests.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_tests: no CUDA device here: run it on a GPU host (nothing written)",
              file=sys.stderr)
        return 2
    return run_and_record(COMMAND, args.output, torch.cuda.get_device_name(0),
                          torch.cuda.device_count(), argv, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
