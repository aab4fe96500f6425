#!/usr/bin/env bash
# One device call of the GPU plan: `bash scripts/gpu_check.sh STAGE` on the H200 (logs and JSON go to $OUT).
#   tests    tests/gpu (default inductor + CUDA graphs; ~6 min)
#   bench    scripts/bench.py for the models in $MODELS (default: all three real shapes)
#   spec     scripts/bench_spec.py: MTP k=3 tau=3 and DFlash k=15 tau=6.5 in one process on $SPEC_MODEL
#            (default 27B, default inductor + CUDA graphs; SPEC_ARGS adds options, e.g. --batch 2)
# Prefix with the wheel install line from README (fla and torchao are not on the machine).
set -uo pipefail
stage=${1:?stage: tests | bench | spec}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$stage" in
  tests) python -m pytest -q -s -p no:warnings tests/gpu 2>&1 | tee "$out/gpu_tests.log" \
           | grep -E "passed|failed|FAILED|Error|divergence|agreed|identical|tau" ;;
  bench) python scripts/bench.py --models ${MODELS:-qwen3.5-9b qwen3.5-27b qwen3.5-35b-a3b} ${BENCH_ARGS:-} \
           --out-dir "$out" 2>&1 | grep -v "^\[transformers\]" | tail -20 ;;
  spec)  m=${SPEC_MODEL:-qwen3.5-27b}
         python scripts/bench_spec.py --model "$m" --no-autotune ${SPEC_ARGS:-} --json "$out/spec_$m.json" 2>&1 \
           | grep -v "^\[transformers\]" | tee "$out/spec_$m.log" | grep -vE '^ *"|^[{}]'; cat "$out/spec_$m.json" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
