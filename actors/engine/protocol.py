"""``EngineClient``: the engine as the HTTP layer sees it (vLLM's ``vllm/engine/protocol.py``).

The server is handed one of three engines and is typed against this protocol only:

- ``AsyncEngine`` (``actors/engine/async_engine.py``): the scheduler and executor actors in
  this process;
- ``EngineCoreClient`` (``actors/engine_core/client.py``): one engine in its own process;
- ``DataParallelEngine`` (``actors/dp/engine.py``): a group of those, routed per request.

Each subclasses ``EngineClient`` explicitly. ``add_request`` is written here, once: its
arguments become one ``GenerateRequest``, which each engine's ``submit`` takes as a whole (the
group passes it on to the engine it routes to unchanged). ``generate`` is ``add_request`` and
its stream in one call. The streams, grammars and beam-search handles the engines return are
protocols too (``DeltaStream``, ``Grammar``, ``BeamSearchHandle``): in process they are the
request task's own objects, across the process boundary their wire twins.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # types only: an engine module imports this one, never the other way
    from transformers import PreTrainedTokenizerBase

    from pagedserve.actors.beam.search import BeamSearchOutput, BeamSearchParams
    from pagedserve.actors.engine.config import EngineConfig
    from pagedserve.actors.engine.pooling import PoolingOutput
    from pagedserve.actors.kv.events import KVEventSink
    from pagedserve.actors.stats import EngineStats, StatLogger
    from pagedserve.gpu.lora.request import LoRARequest
    from pagedserve.gpu.model_info import ModelInfo
    from pagedserve.gpu.pooling.pooling_params import PoolingParams
    from pagedserve.gpu.sample.sampler import TokenLogprobs
    from pagedserve.gpu.sample.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(slots=True)
class GenerationDelta:
    """One increment of a request's output.

    Attributes:
        text: new text (may be empty while a stop string or a multibyte character is pending).
        token_ids: tokens sampled since the last delta.
        finish_reason: ``stop``/``length`` on the last delta, else ``None``.
        num_prompt_tokens, num_output_tokens: usage so far.
        logprobs: one per token in ``token_ids``, when the request asked for them.
        prompt_logprobs: on the first delta of a request that asked, one per prompt token
            after the first.
        num_cached_tokens: on the first delta, prompt tokens found in the prefix cache.
        kv_transfer_params: on the last delta, the KV connector's reply (vLLM's fields).
        stop_reason: on the last delta, the stop string that ended the output (vLLM's
            ``CompletionOutput.stop_reason``; ``None`` for EOS, a stop token or a length).
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    stop_reason: str | None = None


class DeltaStream(Protocol):
    """One request's deltas, read by its request task (``async for``), then closed; closing a
    live stream aborts the request (``RequestStream``, ``RemoteRequestStream``)."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> DeltaStream: ...

    async def __anext__(self) -> GenerationDelta: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


class BeamSearchHandle(Protocol):
    """A beam search in flight: ``await result()`` once; ``close()`` before the end aborts it
    (``BeamSearchStream``, ``RemoteBeamSearchStream``)."""

    @property
    def request_id(self) -> str: ...

    async def result(self) -> BeamSearchOutput: ...

    def close(self) -> None: ...


class Grammar(Protocol):
    """A guided-decoding constraint compiled before its request starts (``compile_grammar``):
    ``CompiledConstraint`` in process, ``RemoteGrammar`` for an engine-core process."""

    @property
    def spec(self) -> StructuredOutputsParams: ...


@dataclass(slots=True)
class GenerateRequest:
    """``add_request``'s arguments as one value, as every engine takes them (``submit``).

    Attributes:
        priority: lower runs earlier under the ``priority`` scheduling policy.
        cache_salt: isolates the request's prefix-cache blocks from other salts.
        grammar: ``params.structured_outputs`` as ``compile_grammar`` compiled it; the request
            runs on it as is. Without it, a constraint in ``params`` is compiled (or found
            cached) by the engine and the scheduler parks the request until it is ready.
        kv_transfer_params: vLLM's disaggregated prefill/decode fields, for the KV connector
            (``gpu/kv_connector/``); its answer ends up on the last delta.
        lora_request: the adapter to run with (``--enable-lora``; checked by the caller:
            ``gpu/lora/peft.check_adapter``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    grammar: Grammar | None = None
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None


class EngineClient(Protocol):
    """What the HTTP layer calls. ``config``, ``info`` and ``tokenizer`` describe the model
    served; every engine of a data-parallel group serves the same."""

    config: EngineConfig
    info: ModelInfo
    tokenizer: PreTrainedTokenizerBase

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, cache_salt: str | None = None, grammar: Grammar | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> DeltaStream:
        """Queue a request and return its stream once the scheduler has accepted it, so a
        refusal becomes an HTTP error before any response starts. The arguments are
        ``GenerateRequest``'s.

        Raises:
            EngineOverloaded: the waiting queue is full.
            DuplicateRequestId: a live request has this id.
            ValueError: the model is served for pooling (``--runner pooling``), or ``grammar``
                is not the compile of ``params.structured_outputs``.
            EngineError: the engine is lost (an engine-core process).
        """
        return await self.submit(GenerateRequest(
            request_id, prompt_token_ids, params, priority, cache_salt, grammar,
            kv_transfer_params, lora_request))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, cache_salt: str | None = None, grammar: Grammar | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """``add_request`` and iterate its stream, in one call (for tools and tests). Closing
        the iteration closes the stream."""
        stream = await self.submit(GenerateRequest(
            request_id, prompt_token_ids, params, priority, cache_salt, grammar,
            kv_transfer_params, lora_request))
        async with aclosing(stream):
            async for delta in stream:
                yield delta

    async def submit(self, request: GenerateRequest) -> DeltaStream:
        """``add_request`` as each engine implements it."""
        ...

    async def beam_search(
        self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
        stop_token_ids: list[int] | None = None, priority: int = 0,
        cache_salt: str | None = None,
    ) -> BeamSearchHandle:
        """Queue a beam search and return its handle once accepted (``stop_token_ids``: ids
        that end a hypothesis as EOS does). Raises as ``add_request``."""
        ...

    async def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """Compile (or find cached) a guided-decoding constraint before starting a request;
        pass the result to ``add_request`` (``grammar=``) with ``spec`` in its params.

        Raises:
            GrammarError: the constraint is invalid or took longer than the compile timeout.
        """
        ...

    async def get_stats(self) -> EngineStats:
        """A snapshot of the scheduler's state, the model and the settings in force."""
        ...

    def effective_config(self) -> dict[str, Any]:
        """The settings in force: the flags as given, with what loading resolved."""
        ...

    def add_stat_logger(self, logger: StatLogger) -> None:
        """Have ``logger`` see every step and every request update. Start-up only."""
        ...

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds; returns how many."""
        ...

    async def drain(self, timeout: float) -> None:
        """End the requests still waiting at once, let the running ones finish for up to
        ``timeout`` seconds, then end the rest."""
        ...

    async def wait_idle(self) -> None:
        """Until nothing is running or waiting."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve any more, else ``None``."""
        ...

    async def wait_failed(self) -> None:
        """Until the engine has failed for good."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine (its processes too)."""
        ...


class EngineReplica(EngineClient, Protocol):
    """An engine a data-parallel group can hold (``AsyncEngine``, ``EngineCoreClient``): it
    also publishes its scheduler's KV events, the router's view of its prefix cache."""

    def add_kv_event_sink(self, sink: KVEventSink, engine_index: int | None = None) -> None:
        """Have ``sink`` get this engine's KV events, a batch per scheduler step, stamped
        ``engine_index`` when given. Start-up only."""
        ...


@runtime_checkable
class PoolingClient(Protocol):
    """An engine that serves pooling requests (``--runner pooling``): ``AsyncEngine`` only, so
    far; the pooling endpoints check for it."""

    async def encode(
        self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
        priority: int = 0, cache_salt: str | None = None,
    ) -> PoolingOutput: ...
