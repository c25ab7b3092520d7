#!/usr/bin/env bash
# --cpu-linear-mode exact against int8 end to end: ../shared/bench/loadgen.py at 1 and 8 streams
# on the native tier and the avx2 tier (PAGEDSERVE_CPU_ISA=avx2, which caps torch too), a fresh
# server per run, the modes alternating, ROUNDS rounds; one JSON line per run in OUT (loadgen's,
# labelled tier-mode-streams). A shared machine slows all alike only on average: compare the
# medians (loadtest/RESULTS.md "int8 activations"). Usage:
#   OUT=/tmp/int8-modes.jsonl ROUNDS=2 loadtest/int8_modes.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
LOADGEN=${LOADGEN:-$(ls "$here"/../../shared/bench/loadgen.py "$here"/../../../shared/bench/loadgen.py 2>/dev/null | head -1)}
: "${OUT:?}"
ROUNDS=${ROUNDS:-2}
TOKENS=${TOKENS:-64}
port=18993
echo "load $(cut -d' ' -f1-3 /proc/loadavg) on $(lscpu | sed -n 's/^Model name: *//p')"
wait_health() { for _ in $(seq 1 1200); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
for round in $(seq 1 "$ROUNDS"); do
  for tier in native avx2; do
    for mode in exact int8; do
      cap=(); [[ $tier == avx2 ]] && cap=(env PAGEDSERVE_CPU_ISA=avx2)
      setsid "${cap[@]}" "$here/../.venv/bin/pagedserve" serve --host 127.0.0.1 --port $port \
        --served-model-name smollm2 --cpu-linear-mode $mode >/tmp/int8-modes-server.log 2>&1 &
      pid=$!
      if wait_health; then
        for streams in 1 8; do
          "$here/../.venv/bin/python" "$LOADGEN" --base-url "http://127.0.0.1:$port/v1" \
            --model smollm2 --num-requests $((streams == 1 ? 8 : 16)) --concurrency $streams \
            --min-words 20 --max-words 120 --min-tokens "$TOKENS" --max-tokens "$TOKENS" \
            --seed 0 --label "$tier-$mode-$streams" --output "$OUT" | tail -1 | cut -c1-300
        done
      else echo "$tier $mode did not become healthy"; tail -20 /tmp/int8-modes-server.log; fi
      kill -TERM -- -$pid 2>/dev/null
      for _ in $(seq 1 40); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- -$pid 2>/dev/null; wait $pid 2>/dev/null
    done
  done
done
