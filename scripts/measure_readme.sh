#!/usr/bin/env bash
# Every figure in README.md, measured one after another on a quiet machine (~40 min on
# 2 cores). Results land in results/ (JSON, Markdown, PNG) and profiles/.
# Usage: scripts/measure_readme.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
out=results
mkdir -p "$out"
step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

step "local strategies vs PyTorch peers, 224 px"
$PY scripts/bench_local.py --usecase SimpleBig --image-size 224 --rounds 4 \
    --variants fp32,fp32-cl,bf16-cl --output $out/bench_local-SimpleBig.json
$PY scripts/bench_local.py --usecase ComplexSmall --image-size 224 --rounds 3 --steps 3 \
    --strategies processes,layerwise --variants fp32,fp32-cl,bf16-cl \
    --output $out/bench_local-ComplexSmall-bf16.json
$PY scripts/bench_local.py --usecase ComplexSmall --image-size 224 --rounds 3 --steps 3 \
    --strategies processes,layerwise --variants fp32,fp32-cl \
    --output $out/bench_local-ComplexSmall.json
$PY scripts/bench_local.py --usecase ComplexSmall --image-size 224 --rounds 3 --steps 3 \
    --strategies intraop,layerwise --variants fp32,fp32-cl,fp32-cl-acc2,fp32-cl-acc4 \
    --output $out/bench_local-ComplexSmall-accumulate.json

step "freed memory kept against glibc's defaults, AlexNet 224 px"
$PY scripts/bench_memory_reuse.py --usecase SimpleBig --image-size 224 --strategy intraop \
    --rounds 5 --output $out/memory_reuse-SimpleBig.json

step "tuner at 224 px (profiles kept in profiles/)"
$PY -m hybriddl tune --usecase ComplexSmall --image-size 224 --profile-dir profiles
$PY -m hybriddl tune --usecase ComplexSmall --image-size 224 --accumulate 4 --profile-dir profiles
$PY -m hybriddl tune --usecase SimpleBig --image-size 224 --profile-dir profiles

step "tuner pick vs re-measured fastest, small image size"
for run in 1 2 3; do  # a miss is a finding: the check must pass 3 times in a row
  for uc in ComplexSmall SimpleBig; do
    $PY scripts/check_tune.py --usecase $uc --image-size 64 --steps 2 --rounds 3 --second-look 3 --warmup 1 --profile-dir runs/check-profiles --output $out/check_tune-$uc-run$run.json || true
  done
done

step "MPI layer: co-located ranks, 1-rank overhead, fp16 and overlap traffic"
$PY scripts/bench_mpi.py --usecase ComplexSmall --image-size 64 --output $out/bench_mpi-ComplexSmall.json

step "heartbeat between hosts: NIC bytes and step time, on and off (2 emulated hosts, needs root)"
$PY scripts/bench_heartbeat.py --output $out/bench_heartbeat.json

step "keyed dropout's cost"
$PY scripts/bench_dropout.py --rounds 9 --output $out/dropout_cost.json

step "averaging on 2 emulated hosts without a limit, float32 and fp16 (needs root)"
$PY scripts/bench_allreduce.py --hosts 2 --bandwidth none --mib 64 --compression none fp16 \
    --rounds 3 --repeats 5 --output $out/allreduce-2-nolimit.json

step "averaging on 2, 4, 8 emulated hosts at 1 and 10 Gbit/s, float32 and fp16 (needs root)"
$PY scripts/bench_allreduce.py --hosts 2 4 8 --bandwidth 1gbit 10gbit --mib 64 \
    --compression none fp16 --rounds 2 --repeats 5 --output $out/allreduce-1gbit-10gbit.json

step "averaging with and without --overlap, 2, 4, 8 emulated hosts at 1 Gbit/s (needs root)"
$PY scripts/bench_allreduce.py --hosts 2 4 8 --bandwidth 1gbit --mib 256 --backward --overlap off on \
    --rounds 2 --repeats 3 --output $out/allreduce-overlap-1gbit.json

step "strong scaling: compute at each host's share, communication on emulated hosts (needs root)"
$PY scripts/scaling.py compute --image-size 64 --batch-size 64 --rounds 2 --steps 2 \
    --output $out/scaling-compute-64px.json
for rate in 1gbit 10gbit; do
  $PY scripts/scaling.py communication --usecase SimpleBig --hosts 1 2 4 --bandwidth $rate \
      --memory-fraction 0.25 --output $out/scaling-communication-$rate.json
done
$PY scripts/scaling.py communication --usecase ComplexSmall --hosts 1 2 --bandwidth 1gbit 10gbit \
    --memory-fraction 0.25 --output $out/scaling-communication-ComplexSmall.json
# The cells beyond: 8 and 16 ranks (a gradient in parts where the buffers do not fit).
$PY scripts/scaling.py communication --usecase SimpleBig --hosts 8 --kind hybrid \
    --bandwidth 1gbit 10gbit --output $out/scaling-communication-SimpleBig-hybrid-8.json
$PY scripts/scaling.py communication --usecase SimpleBig --hosts 4 8 --kind flat \
    --bandwidth 1gbit 10gbit --output $out/scaling-communication-SimpleBig-flat-4-8.json
$PY scripts/scaling.py communication --usecase ComplexSmall --hosts 4 8 --kind hybrid \
    --bandwidth 1gbit 10gbit --output $out/scaling-communication-ComplexSmall-hybrid-4-8.json
$PY scripts/scaling.py communication --usecase ComplexSmall --hosts 2 4 8 --kind flat \
    --bandwidth 1gbit 10gbit --output $out/scaling-communication-ComplexSmall-flat-2-4-8.json
$PY scripts/scaling.py table $out/scaling-compute-64px.json $out/scaling-communication-1gbit.json \
    $out/scaling-communication-10gbit.json $out/scaling-communication-ComplexSmall.json \
    $out/scaling-communication-SimpleBig-*.json $out/scaling-communication-ComplexSmall-*.json \
    --output $out/scaling-64px.json

step "monitor overhead"
$PY scripts/bench_monitor.py --usecase ComplexSmall --image-size 64 --output $out/bench_monitor.json

step "streamed data at 2,000 / 20,000 / 100,000 images (generated under /tmp, ~10 min)"
$PY scripts/bench_data.py --output $out/bench_data.json

step "hybrid vs Horovod model vs DDP on 2 emulated hosts x 2 workers, 1 and 10 Gbit/s (needs root)"
for case in ComplexSmall SimpleBig; do
  for rate in 1gbit 10gbit; do
    $PY -m hybriddl compare --usecase $case --hosts 2 --workers-per-host 2 --image-size 64 --steps 3 --bandwidth $rate --output $out/compare-$case-$rate
  done
done

step "main job"
$PY -m hybriddl train --usecase ComplexSmall --image-size 64 --epochs 5 --profile-dir profiles --run-dir $out/main-job 2>&1 | tee $out/main-job.log
$PY -m hybriddl report $out/main-job --output $out/main-job-report
rm -f $out/main-job/model.pt $out/main-job/checkpoint.pt  # 0.5 GB and 1 GB: not results

step "main job with bf16 (accuracy against the fp32 run above)"
$PY -m hybriddl train --usecase ComplexSmall --image-size 64 --epochs 5 --precision bf16 \
    --strategy intraop --workers 2 --run-dir $out/main-job-bf16 2>&1 | tee $out/main-job-bf16.log
rm -f $out/main-job-bf16/model.pt $out/main-job-bf16/checkpoint.pt

step "the training pause for a VGG16 checkpoint"
$PY scripts/bench_checkpoint.py --usecase ComplexSmall --image-size 32 --rounds 3 \
    --output $out/checkpoint_pause.json
