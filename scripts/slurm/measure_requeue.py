"""The requeue round trip on the local SLURM cluster, and that it changes nothing.

    python scripts/slurm/measure_requeue.py --usecase SimpleBig --image-size 64 --max-steps 6

Starts a 2-node cluster (scripts/slurm/cluster.sh, as root), runs scripts/slurm/train.sbatch
twice with the same arguments: once uninterrupted, once sent SIGUSR1 (what SLURM sends at
--signal=B:USR1@LEAD) right after its first step's checkpoint. Times signal -> checkpoint
-> requeued job running -> the resumed run's first step (its checkpoint, --checkpoint-every 1),
compares the two runs' final parameters, writes results/slurm_requeue-<usecase>.json and
stops the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm" / "cluster.sh"
JOB = REPO / "scripts" / "slurm" / "train.sbatch"
DEADLINE_SECONDS = 600


def job_fields(job_id: str, env: dict) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                           text=True, check=True, env=env)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def poll(what: str, condition, interval: float = 0.02):
    deadline = time.monotonic() + DEADLINE_SECONDS
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"measure_requeue.py: no {what} after {DEADLINE_SECONDS} s")
        time.sleep(interval)
    return value


def submit(env: dict, workdir: Path, run_dir: Path, train_args: list[str]) -> str:
    done = subprocess.run(["sbatch", "--parsable", "--nodes", "2", "--output",
                           str(workdir / "job-%j.out"), str(JOB), *train_args],
                          capture_output=True, text=True, check=True, cwd=workdir,
                          env={**env, "HYBRIDDL_RUN_DIR": str(run_dir)})
    return done.stdout.strip().split(";")[0]


def finished(job_id: str, env: dict) -> dict:
    def ended():
        fields = job_fields(job_id, env)
        return fields if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED") else None
    fields = poll(f"end of job {job_id}", ended, 0.2)
    if fields["JobState"] != "COMPLETED":
        raise SystemExit(f"job {job_id} {fields['JobState']}:\n"
                         + Path(fields["StdOut"]).read_text()[-3000:])
    return fields


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--usecase", default="SimpleBig")
    parser.add_argument("--image-size", default="64")
    parser.add_argument("--max-steps", default="6")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    train_args = ["--usecase", args.usecase, "--image-size", args.image_size, "--max-steps",
                  args.max_steps, "--dropout", "0", "--strategy", "sequential",
                  "--checkpoint-every", "1", "--monitor-interval", "0"]
    started = subprocess.run([str(CLUSTER), "start", "--nodes", "2"], capture_output=True,
                             text=True, check=True)
    env = {**os.environ, "SLURM_CONF": re.search(r"SLURM_CONF=(\S+)", started.stdout).group(1),
           "HYBRIDDL": f"{sys.executable} -m hybriddl",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "HYBRIDDL_LAUNCHER_ARGS": "--mca btl tcp,self --mca btl_tcp_if_include lo"}
    try:
        with tempfile.TemporaryDirectory(prefix="measure-requeue-") as tmp:
            workdir = Path(tmp)
            plain_dir, requeued_dir = workdir / "uninterrupted", workdir / "requeued"
            plain = submit(env, workdir, plain_dir, train_args)
            finished(plain, env)

            job = submit(env, workdir, requeued_dir, train_args)
            checkpoint = requeued_dir / "checkpoint.pt"
            poll("first checkpoint", checkpoint.exists)
            signalled_at = time.time()
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, env=env)
            fields = poll("requeue", lambda: (f := job_fields(job, env))["Restarts"] == "1" and f)
            stop_checkpoint_at = mtime(checkpoint)  # the stop's checkpoint, written before
            poll("requeued job pending",
                 lambda: job_fields(job, env)["JobState"] != "RUNNING", 0.02)
            poll("requeued job running",
                 lambda: job_fields(job, env)["JobState"] == "RUNNING", 0.02)
            running_at = time.time()
            poll("resumed run's first step", lambda: mtime(checkpoint) > running_at)
            first_step_at = mtime(checkpoint)
            fields = finished(job, env)
            output = Path(fields["StdOut"]).read_text()

            plain_model = torch.load(plain_dir / "model.pt", weights_only=True)
            requeued_model = torch.load(requeued_dir / "model.pt", weights_only=True)
            difference = max(float((requeued_model[k] - plain_model[k]).abs().max()
                                   / plain_model[k].abs().max().clamp_min(1e-12))
                             for k in plain_model)
            metrics = json.loads((requeued_dir / "metrics.json").read_text())
    finally:
        subprocess.run([str(CLUSTER), "stop"], check=True)
    result = {
        "command": "python scripts/slurm/measure_requeue.py " + " ".join(sys.argv[1:]),
        "train_args": train_args,
        "nodes": metrics["config"]["hosts"]["names"],
        "resumed_at": metrics["resumes"],
        "restarts": int(fields["Restarts"]),
        "seconds_signal_to_checkpoint": round(stop_checkpoint_at - signalled_at, 2),
        "seconds_checkpoint_to_requeued_job_running": round(running_at - stop_checkpoint_at, 2),
        "seconds_running_to_first_resumed_step": round(first_step_at - running_at, 2),
        "seconds_signal_to_first_resumed_step": round(first_step_at - signalled_at, 2),
        "max_relative_parameter_difference_vs_uninterrupted": difference,
        "job_output_tail": output[-1500:],
    }
    output_path = Path(args.output or REPO / "results" / f"slurm_requeue-{args.usecase}.json")
    output_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "job_output_tail"}, indent=2))
    return 0 if difference <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
