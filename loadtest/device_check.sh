#!/usr/bin/env bash
# Device check on a bare CUDA machine (an H200), under 10 minutes: the steps' limits add up
# to 580 s, inside one 600 s device call. Prepare wheels/ first with
# loadtest/prepare_device_carry.sh and carry it along. Steps, each with its own time limit;
# a failed step is reported and the next one still runs:
#   1. install what the image lacks, from wheels/ only (no index);
#   2. the Triton kernel and backend tests, on CUDA (compiled, not interpreted);
#   3. copy bandwidth, then each kernel's time against its floor (bytes moved / bandwidth);
#   4. a serving benchmark: 64 concurrent requests, output tokens/s, decode step vs its floor,
#      with CUDA graphs and with --enforce-eager;
#   5. the parallel workers on CUDA (loadtest/device_check_parallel.py): tp=2 and pp=2 over
#      NCCL, one GPU per worker, when the machine has two or more GPUs, else tp=1 through the
#      same worker path, CUDA graphs on every rank (each rank says whether it captured them);
#      greedy float32 tokens against the eager tp=1 in the server's process;
#   6. the summary tables, printed last.
# The full log goes to $OUT/device_check.log (and the JSON results next to it) when OUT is set,
# else to artifacts/. DRY_RUN=1 runs the same steps on a CPU machine (tiny shapes, Triton
# interpreted): how the script itself is checked where there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-artifacts}
mkdir -p "$RESULTS"
exec > >(tee "$RESULTS/device_check.log") 2>&1
PY=${PY:-python3}
DRY=${DRY_RUN:+--dry-run}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
declare -A STATUS

step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  local t0=$SECONDS
  if declare -F "$1" >/dev/null; then "$@"; else timeout "$limit" "$@"; fi  # no timeout for functions
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  echo "=== $name: ${STATUS[$name]}"
}

install_missing() {
  "$PY" -m pip --version >/dev/null || return 1
  local missing=()
  for spec in structlog:structlog starlette:starlette sse_starlette:sse-starlette \
              hypercorn:hypercorn pydantic:pydantic anyio:anyio httpx:httpx pytest:pytest \
              pytest_asyncio:pytest-asyncio; do
    "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec##*:}")
  done
  echo "missing: ${missing[*]:-nothing}"
  [ ${#missing[@]} -eq 0 ] || "$PY" -m pip install -q --no-index --find-links wheels "${missing[@]}"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available())"
step install 40 install_missing
# The engine-parity test is left out on CUDA: there it would compare bf16 backends.
step kernel_tests 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels tests/gpu \
  -k "not engine"
step kernel_timings 90 "$PY" loadtest/device_check.py kernels $DRY
step serve 180 "$PY" loadtest/device_check.py serve $DRY
echo "GPUs: $(nvidia-smi -L 2>/dev/null | wc -l)"
step parallel 120 "$PY" loadtest/device_check_parallel.py $DRY
"$PY" loadtest/device_check.py summary
for name in install kernel_tests kernel_timings serve parallel; do
  echo "$name: ${STATUS[$name]:-not run}"
done
