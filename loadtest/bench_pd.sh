#!/bin/bash
# Disaggregated prefill/decode against one colocated instance, same run, same CPUs, same
# seeded workload (../shared/bench/loadgen.py at 8 streams):
#
#   colocated: one instance, 2 threads, cores 0-1
#   P/D:       prefill (1 thread, core 0) + decode (1 thread, core 1), a connector between
#              them, `pagedserve proxy` in front (cores 0-1: it only relays)
#
# One JSON line per setup in $OUT (TTFT p50/p99, ITL p50/p99, output tok/s, ...), then a table.
#
#   bash loadtest/bench_pd.sh                       # TCPConnector, 32 requests
#   CONNECTOR=SharedStorageConnector REQUESTS=64 bash loadtest/bench_pd.sh
#
# MODEL defaults to the embedded SmolLM2-135M-Instruct; extra `serve` flags go in SERVE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
# The shared loadgen sits beside the main checkout (../shared), or two up from a worktree.
if [ -z "${LOADGEN:-}" ]; then
  for LOADGEN in ../shared/bench/loadgen.py ../../shared/bench/loadgen.py; do
    [ -f "$LOADGEN" ] && break
  done
fi
OUT=${OUT:-artifacts/bench_pd.jsonl}
CONNECTOR=${CONNECTOR:-TCPConnector}
REQUESTS=${REQUESTS:-32}
STREAMS=${STREAMS:-8}
MAX_TOKENS=${MAX_TOKENS:-128}
BASE=${BASE_PORT:-8310}  # colocated BASE, prefill BASE+1, decode BASE+2, proxy BASE+3, KV BASE+4
MODEL_ARGS=(${MODEL:+"$MODEL"} --served-model-name smollm2 ${SERVE_ARGS:-})
PY=.venv/bin/python
mkdir -p "$(dirname "$OUT")" artifacts; : > "$OUT"
KV_DIR=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true
            rm -rf "$KV_DIR"; }
trap cleanup EXIT

wait_up() { for _ in $(seq 1 600); do curl -sf "localhost:$1/health" >/dev/null && return; sleep 0.5; done
            echo "port $1 never came up" >&2; exit 1; }
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; pids=(); }
kv_config() {  # role → --kv-transfer-config JSON
  if [ "$CONNECTOR" = TCPConnector ]; then
    extra="{\"host\": \"127.0.0.1\", \"port\": $((BASE + 4))}"
  else
    extra="{\"shared_storage_path\": \"$KV_DIR\"}"
  fi
  echo "{\"kv_connector\": \"$CONNECTOR\", \"kv_role\": \"$1\", \"kv_connector_extra_config\": $extra}"
}
load() {  # url label
  $PY "$LOADGEN" --base-url "$1/v1" --model smollm2 --num-requests "$REQUESTS" \
    --concurrency "$STREAMS" --max-tokens "$MAX_TOKENS" --seed 0 --warmup 2 --label "$2" \
    --output "$OUT" > /dev/null
}

# 1. colocated
PAGEDSERVE_CPU_THREADS=2 taskset -c 0,1 .venv/bin/pagedserve serve "${MODEL_ARGS[@]}" \
  --port "$BASE" > artifacts/bench_pd-colocated.log 2>&1 & pids+=($!)
wait_up "$BASE"
load "http://127.0.0.1:$BASE" "colocated-2threads"
stop_all

# 2. prefill + decode through the proxy
PAGEDSERVE_CPU_THREADS=1 taskset -c 0 .venv/bin/pagedserve serve "${MODEL_ARGS[@]}" \
  --port $((BASE + 1)) --kv-transfer-config "$(kv_config kv_producer)" \
  > artifacts/bench_pd-prefill.log 2>&1 & pids+=($!)
PAGEDSERVE_CPU_THREADS=1 taskset -c 1 .venv/bin/pagedserve serve "${MODEL_ARGS[@]}" \
  --port $((BASE + 2)) --kv-transfer-config "$(kv_config kv_consumer)" \
  > artifacts/bench_pd-decode.log 2>&1 & pids+=($!)
taskset -c 0,1 .venv/bin/pagedserve proxy --prefill "http://127.0.0.1:$((BASE + 1))" \
  --decode "http://127.0.0.1:$((BASE + 2))" --port $((BASE + 3)) \
  > artifacts/bench_pd-proxy.log 2>&1 & pids+=($!)
wait_up $((BASE + 1)); wait_up $((BASE + 2)); wait_up $((BASE + 3))
load "http://127.0.0.1:$((BASE + 3))" "pd-$CONNECTOR-1+1threads"
curl -s "localhost:$((BASE + 2))/admin/stats" | $PY -c \
  'import json, sys; print("decode kv_transfer:", json.dumps(json.load(sys.stdin)["scheduler"].get("kv_transfer")))'
stop_all

$PY - "$OUT" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| setup | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | ITL p99/p50 | output tok/s | errors |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    itl50, itl99 = r["itl_ms_p50"], r["itl_ms_p99"]
    print(f"| {r['label']} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {itl50:.1f} | "
          f"{itl99:.1f} | {itl99 / itl50:.1f}x | {r['output_tok_per_s']:.1f} | {r['errors']} |")
EOF
