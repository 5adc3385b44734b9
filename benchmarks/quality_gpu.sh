#!/usr/bin/env bash
# Issue #50's "Done when" on one lent H200: the blend quality benchmark (benchmarks/bench_blend_quality.py) on both
# real checkpoints, bf16 through the fast engine, plus the reference engine in float32 on a subset.
#
#   benchmarks/quality_gpu.sh QWEN_DIR GEMMA_DIR OUT [SPEED_JSON]
#
# QWEN_DIR, GEMMA_DIR: checkpoint directories converted with chunkwise.real_checkpoints.convert_gguf (an empty
# argument skips that model). OUT: where each model's bench_blend_quality.{md,json,png} go (OUT/qwen, OUT/gemma)
# and the logs. SPEED_JSON: benchmarks/bench_blend_speed.py's JSON for the TTFT axis; with SPEED=1 and no
# SPEED_JSON, its ttft case runs first (about a minute more) and writes OUT/speed.json.
# Environment knobs (defaults in brackets): TASKS [500] single-hop tasks, TWO_HOP [100] two-hop tasks,
# RATIOS [0,0.15,0.3,0.5], DEADLINE [200] seconds per model after which modes not started are skipped (named in
# the outputs), REQUIRE_ALL [1] refuse to run when a configuration is missing (conditioned chunks or the adaptive
# policy not merged), REF_TASKS [16] tasks for the reference check, PYTHON [python3].
set -euo pipefail
cd "$(dirname "$0")/.."
QWEN=${1:-} GEMMA=${2:-} OUT=${3:?usage: benchmarks/quality_gpu.sh QWEN_DIR GEMMA_DIR OUT [SPEED_JSON]}
SPEED_JSON=${4:-}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
began=$SECONDS

if [ -z "$SPEED_JSON" ] && [ "${SPEED:-0}" = 1 ]; then
    BENCH_BLEND_SPEED_JSON="$OUT/speed.json" $PY -m pytest benchmarks/bench_blend_speed.py -k ttft \
        --benchmark-only -q -s -p no:cacheprovider 2>&1 | tee "$OUT/speed.log"
    SPEED_JSON="$OUT/speed.json"
    echo "[quality_gpu] speed bench: $((SECONDS - began)) s"
fi

run() {   # name dir
    [ -n "$2" ] || return 0
    local t=$SECONDS
    $PY benchmarks/bench_blend_quality.py --model "$2" --engine fast --device cuda --dtype bfloat16 \
        --tasks "${TASKS:-500}" --two-hop-tasks "${TWO_HOP:-100}" --ratios "${RATIOS:-0,0.15,0.3,0.5}" \
        --deadline "${DEADLINE:-200}" --reference-tasks "${REF_TASKS:-16}" --reference-dtype float32 \
        $([ "${REQUIRE_ALL:-1}" = 1 ] && echo --require-all) \
        ${SPEED_JSON:+--speed-json "$SPEED_JSON"} --out "$OUT/$1" 2>&1 | tee "$OUT/$1.log"
    echo "[quality_gpu] $1: $((SECONDS - t)) s"
}
run qwen "$QWEN"
run gemma "$GEMMA"
echo "[quality_gpu] total $((SECONDS - began)) s"
