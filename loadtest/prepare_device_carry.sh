#!/usr/bin/env bash
# Prepare what loadtest/device_check.sh needs on a bare GPU machine without internet.
# Run HERE (package registry reachable), after `make .venv/.installed`:
#
#     bash loadtest/prepare_device_carry.sh          # fills wheels/ (git-ignored, ~15 MB)
#
# then run the check with the device tool, carrying that folder:
#
#     run(command="bash loadtest/device_check.sh", carry=["wheels"], timeout_s=540)
#
# wheels/ gets:
#   *.whl     what the device image lacks (it has torch, triton, transformers and their deps):
#             the serving stack and pytest, for CPython 3.10 to 3.13 on manylinux x86_64;
#   smollm2/  the default model's config and tokenizer, without weights (the 98 MB GGUF does
#             not fit the tool's 64 MiB carry: the benchmark builds a random-weight model of
#             the same shape there, which times the same for a fixed output length).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=wheels
PKGS=(structlog starlette sse-starlette hypercorn pydantic anyio httpx pytest pytest-asyncio
      exceptiongroup taskgroup tomli)  # the last three: what 3.10 needs (markers are
                                       # not evaluated for the target version)
mkdir -p "$DEST"
for v in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download -q --dest "$DEST" --only-binary=:all: --implementation cp \
    --python-version "$v" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "${PKGS[@]}"
done
"$PY" - "$DEST/smollm2" <<'PYEOF'
import shutil, sys
from pathlib import Path
from gpu import loader

src, dst = loader.resolve_model(None).path, Path(sys.argv[1])
dst.mkdir(parents=True, exist_ok=True)
for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja"):
    if (src / f).exists():
        shutil.copy(src / f, dst / f)
print("smollm2 config + tokenizer ->", dst)
PYEOF
du -sh "$DEST"
