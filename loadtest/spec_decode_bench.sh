#!/bin/bash
# Speculative decoding side by side, same run: off / n-gram / a draft model, at 1 and 8 streams,
# temperature 0.7 (top_p 0.95), with the shared seeded workload (../shared/bench/loadgen.py).
# One JSON line per run in $OUT; the draft acceptance figures (/admin/stats) in $OUT.accept.
#
#   DRAFT=/path/to/draft bash loadtest/spec_decode_bench.sh
#
# DRAFT defaults to SmolLM2 itself (acceptance as high as it gets; no speed-up possible). A
# cheaper draft: the first 8 of SmolLM2's 30 layers (see loadtest/RESULTS.md for how it was made).
set -euo pipefail
cd "$(dirname "$0")/.."
LOADGEN=${LOADGEN:-../shared/bench/loadgen.py}
OUT=${OUT:-artifacts/spec_decode.jsonl}
PORT=${PORT:-8090}
DRAFT=${DRAFT:-$(.venv/bin/python -c 'from pagedserve.gpu import loader; print(loader.resolve_model(None).path)')}
mkdir -p "$(dirname "$OUT")"; : > "$OUT"; : > "$OUT.accept"
for cfg in off ngram draft; do
  case $cfg in
    off) SPEC=() ;;
    ngram) SPEC=(--speculative-config '{"method":"ngram","num_speculative_tokens":3}') ;;
    draft) SPEC=(--speculative-config "{\"method\":\"draft_model\",\"model\":\"$DRAFT\",\"num_speculative_tokens\":3}") ;;
  esac
  .venv/bin/pagedserve serve --port "$PORT" --served-model-name smollm2 "${SPEC[@]}" \
    > "artifacts/spec-server-$cfg.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
  for level in "1 8" "8 32"; do
    read -r streams requests <<< "$level"
    .venv/bin/python "$LOADGEN" --base-url "http://127.0.0.1:$PORT/v1" --model smollm2 \
      --num-requests "$requests" --concurrency "$streams" --max-tokens 128 --seed 0 \
      --extra-body '{"temperature": 0.7, "top_p": 0.95}' --label "$cfg-c$streams" \
      --output "$OUT" > /dev/null
    # Cumulative over the server's life: subtract the previous level's line for this level's.
    echo "$cfg-c$streams $(curl -s "localhost:$PORT/admin/stats" | .venv/bin/python -c \
      'import json, sys; print(json.dumps(json.load(sys.stdin)["scheduler"]["spec_decode"]))')" \
      >> "$OUT.accept"
  done
  kill "$pid"; wait "$pid" || true
done
