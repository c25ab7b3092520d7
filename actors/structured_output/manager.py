"""Guided decoding (structured output) with xgrammar: compile, cache, match, mask.

How a guided request flows, and why:

* **Compile off the event loop.** ``StructuredOutputManager`` owns one xgrammar
  ``GrammarCompiler`` and a small thread pool. The ``TokenizerInfo`` is built once, in that pool,
  when the engine starts: from the served tokenizer, with the model config's ``vocab_size`` (the
  logits' width, which can exceed ``len(tokenizer)``; the extra ids are never allowed), and with
  every end-of-turn token the model uses among the stop tokens (``<|im_end|>``, ``<|eot_id|>``,
  ``<|endoftext|>``, ... besides ``eos_token_id``), so a finished grammar can end the turn.
* **Cache.** Compiles are cached in an LRU of *futures* keyed by the constraint kind and its
  canonical text (a JSON schema re-serialised without whitespace; key order is kept because it
  fixes the order of the generated properties). Concurrent requests with the same schema share
  one compile; a failed compile is cached as a failure (compiling is deterministic). The cache
  is touched only from the event loop thread.
* **Errors before the stream.** The HTTP handler awaits ``compile()`` (bounded by
  ``--structured-output-compile-timeout``) before it starts the request, so an invalid schema, an
  unsupported keyword, a malformed regex or a compile that takes too long is a 400 naming the
  problem, and the server carries on (a compile that timed out keeps running in the pool and
  stays cached; the pool is never blocked on by anyone).
* **Compiled once, handed on.** ``compile()`` returns a ``CompiledConstraint``, which the handler
  passes to ``AsyncEngine.add_request``: the request takes that compile as it is, with no second
  look-up in the cache (which could since have evicted it). Each of ``n`` choices gets its own
  matcher over the one compiled grammar.
* **The scheduler never waits.** A ``Request`` carries a ``StructuredOutputRequest`` holding the
  compile future. From the handler it is already done; when it is not (a caller of
  ``AsyncEngine.generate`` that passed only ``SamplingParams.structured_outputs``),
  the scheduler parks the request in ``WAITING_FOR_GRAMMAR`` and serves the others; the
  future's done-callback posts ``GrammarReady`` to the scheduler's mailbox (thread-safely),
  which moves the request to the waiting queue, or fails it if the compile failed.
* **Per step.** One ``GrammarMatcher`` per request, owned by the scheduler actor through the
  request. For the guided requests that sample this step the scheduler fills one row each of
  an int32 bitmask on the CPU (``grammar_bitmask``); the batch carries it to the model runner,
  which applies it to the logits before sampling. A batch without guided requests builds
  nothing. Sampled tokens advance the matchers (``advance``); a terminated matcher finishes its
  request with ``stop`` (``actors/structured_output/step.py``).
* **Preemption.** Matchers advance only on sampled tokens. Recompute preemption re-runs the
  forward pass over the request's known tokens without sampling them again, so the matcher,
  which has consumed exactly ``output_token_ids``, is already in the right state: nothing to
  roll back or replay.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagedserve.actors.structured_output.config import StructuredOutputConfig  # noqa: F401
from pagedserve.actors.structured_output.request import StructuredOutputRequest
from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams

log = structlog.get_logger(__name__)

# End-of-turn tokens of common chat templates; those in the vocabulary become stop tokens.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                       "<|endoftext|>", "<|end_of_text|>", "</s>")

# JSON Schema keywords xgrammar accepts but silently ignores: a request using them would get
# output that does not validate, so it is refused instead.
UNSUPPORTED_JSON_KEYWORDS = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "if", "then", "else",
    "dependentRequired", "dependentSchemas", "dependencies",
})
# Keywords whose value is a schema / a list of schemas / a map of schemas (walked for the check).
_SUBSCHEMA = ("additionalProperties", "items", "not", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")

# With free whitespace on, a run of whitespace between JSON tokens is capped at this many
# characters: enough for indented output, not enough to pad until max_tokens.
MAX_JSON_WHITESPACE = 16


class GrammarError(ValueError):
    """The constraint cannot be compiled (bad schema, unsupported keyword, malformed regex or
    grammar, or a compile over the time limit). The message says which and why."""


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int]) -> list[int]:
    """EOS ids of the model plus every known end-of-turn token in the tokenizer's vocabulary."""
    ids = set(eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)


def cache_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, canonical text) of a constraint; raises ``GrammarError`` for invalid params."""
    kinds = spec.kinds()
    if len(kinds) != 1:
        raise GrammarError(
            "exactly one structured-output constraint (json, regex, choice, grammar, "
            f"json_object) must be given, got {', '.join(kinds) or 'none'}")
    kind = kinds[0]
    ws = "compact" if spec.disable_any_whitespace else "any"
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise GrammarError("the JSON schema must be a JSON object")
        if isinstance(schema, dict):
            check_json_schema(schema)
        return f"json/{ws}", json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if kind == "json_object":
        return f"json/{ws}", '{"type":"object"}'
    if kind == "choice":
        if not spec.choice or not all(isinstance(c, str) for c in spec.choice):
            raise GrammarError("choice must be a non-empty list of strings")
        # An EBNF alternation of JSON-escaped literals (xgrammar's string escapes).
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return "choice", f"root ::= {alts}"
    if kind == "structural_tag":
        return kind, spec.structural_tag  # type: ignore[return-value]
    return kind, spec.regex if kind == "regex" else spec.grammar  # type: ignore[return-value]


def check_json_schema(schema: dict[str, Any], path: str = "#") -> None:
    """Refuse keywords xgrammar would ignore (see ``UNSUPPORTED_JSON_KEYWORDS``)."""
    for key in UNSUPPORTED_JSON_KEYWORDS.intersection(schema):
        raise GrammarError(f"unsupported JSON schema keyword '{key}' at {path}")
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), dict):
            check_json_schema(schema[key], f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            if isinstance(sub, dict):
                check_json_schema(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    check_json_schema(sub, f"{path}/{key}/{name}")


def _clean(e: Exception) -> str:
    """xgrammar's C++ errors without their ``[time] file.cc:line:`` prefix."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
    return text.splitlines()[0] if text else type(e).__name__


class StructuredOutputManager:
    """Compiles and caches grammars (see the module docstring). Create on the event loop."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int],
        config: StructuredOutputConfig | None = None,
    ):
        self.config = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids(tokenizer, eos_token_ids)
        self._pool = ThreadPoolExecutor(self.config.num_compile_threads,
                                        thread_name_prefix="pagedserve-grammar")
        self._compiler: Future[xgr.GrammarCompiler] = self._pool.submit(
            self._build_compiler, tokenizer)
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()

    async def wait_ready(self) -> None:
        """Wait for the one-time tokenizer set-up (xgrammar's ``TokenizerInfo``, ~0.2-0.3 s of
        mostly Python for a 49k vocabulary). The engine awaits it before it says ready: run
        beside the first requests, it shared the GIL with the forward pass, and a first 300-token
        prefill on one thread took 304-475 ms against 218-255 ms once it was done. A set-up that
        failed is logged, not raised: only guided requests need it, and they get its error."""
        try:
            await asyncio.wrap_future(self._compiler)
        except Exception as e:  # noqa: BLE001 - reported to the guided requests that need it
            log.warning("grammar_tokenizer_failed", error=_clean(e))

    def _build_compiler(self, tokenizer: PreTrainedTokenizerBase) -> xgr.GrammarCompiler:
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        log.info("grammar_tokenizer_ready", vocab_size=self.vocab_size,
                 stop_token_ids=self.stop_token_ids,
                 seconds=round(time.perf_counter() - start, 3))
        return xgr.GrammarCompiler(info, max_threads=self.config.num_compile_threads,
                                   cache_enabled=False)  # our LRU caches

    def submit(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compile future for ``spec`` (cached, else started). Never raises: an invalid
        ``spec`` gives a future holding its ``GrammarError``."""
        try:
            key = cache_key(spec)
        except GrammarError as e:
            failed: Future[xgr.CompiledGrammar] = Future()
            failed.set_exception(e)
            return failed
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        fut = self._pool.submit(self._compile, key)
        self._cache[key] = fut
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)
        return fut

    def _compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        kind, text = key
        compiler = self._compiler.result()
        start = time.perf_counter()
        try:
            if kind.startswith("json/"):
                compact = kind == "json/compact"
                grammar = compiler.compile_json_schema(
                    text, any_whitespace=not compact,
                    max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "structural_tag":
                grammar = compiler.compile_structural_tag(text)
            else:
                grammar = compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError for every parse/convert error
            raise GrammarError(f"invalid {kind.split('/')[0]} constraint: {_clean(e)}") from e
        log.debug("grammar_compiled", kind=kind, seconds=round(time.perf_counter() - start, 4))
        return grammar

    async def compile(self, spec: StructuredOutputsParams) -> CompiledConstraint:
        """Compile (or find cached) within the compile timeout; the result starts requests
        (``CompiledConstraint.new_request``) without another look-up.

        Raises:
            GrammarError: invalid constraint, or compiling took longer than the timeout.
        """
        # The one-time tokenizer set-up is start-up, not this request's compile: done already
        # where the engine awaited ``wait_ready``; a manager used alone waits for it here.
        await asyncio.wrap_future(self._compiler)
        compiling = self.submit(spec)
        fut = asyncio.wrap_future(compiling)
        done, _ = await asyncio.wait({fut}, timeout=self.config.compile_timeout_s)
        if not done:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed later
            raise GrammarError(
                f"compiling the grammar took longer than {self.config.compile_timeout_s:g}s "
                "(--structured-output-compile-timeout)")
        fut.result()  # raises the compile's GrammarError
        return CompiledConstraint(spec, compiling)

    def request_for(self, spec: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.submit(spec))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    """A constraint compiled for this engine's tokenizer, from ``StructuredOutputManager.compile``.

    The HTTP handler holds it from its compile check to ``AsyncEngine.add_request``, so a request
    runs on the very compile that was checked. ``future`` is done and holds a grammar.
    """

    spec: StructuredOutputsParams
    future: Future[xgr.CompiledGrammar]

    def new_request(self) -> StructuredOutputRequest:
        """Grammar state for one more request (its own matcher over this grammar)."""
        return StructuredOutputRequest(self.future)
