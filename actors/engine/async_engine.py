"""The engine as the HTTP layer sees it: start the actors, run one request as a task.

``AsyncEngine.add_request`` + ``RequestStream`` (``actors/engine/request_stream.py``) are the
*request task* of DESIGN.md: the task owns the request's output queue, sends ``AddRequest`` to the
scheduler, detokenizes what comes back, applies stop strings and, when it stops reading early
(client gone, stop string matched), sends ``AbortRequest``, so the scheduler frees the blocks
before its next step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from transformers import PreTrainedTokenizerBase

from pagedserve.actors.beam.group import BeamSearchStream
from pagedserve.actors.beam.search import BeamSearch, BeamSearchParams
from pagedserve.actors.core.request import Request, RequestOutput
from pagedserve.actors.core.scheduler import Scheduler
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.engine.detokenizer import IncrementalDetokenizer
from pagedserve.actors.engine.pooling import PoolingOutput, pooling_scheduler_config, run_pooling
from pagedserve.actors.engine.protocol import EngineReplica, GenerateRequest
from pagedserve.actors.engine.request_stream import RequestMetrics, RequestStream
from pagedserve.actors.executor.base import Executor, make_executor
from pagedserve.actors.kv.events import KVEventSink
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.kv.sliding_window import longest_resident_tokens
from pagedserve.actors.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    GetStats,
    NotifyWhenIdle,
    ResetPrefixCache,
)
from pagedserve.actors.spec_decode.config import SpeculativeConfig
from pagedserve.actors.stats import EngineStats, StatLogger, StatsSnapshot
from pagedserve.actors.structured_output.manager import (
    CompiledConstraint,
    StructuredOutputManager,
)
from pagedserve.gpu import loader
from pagedserve.gpu.config import DraftModelConfig
from pagedserve.gpu.kv_connector.registry import make_scheduler_connector
from pagedserve.gpu.model_info import ModelInfo
from pagedserve.gpu.pooling.pooling_params import PoolingParams
from pagedserve.gpu.sample.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.kernels import cpu_ops

if TYPE_CHECKING:
    from pagedserve.actors.executor.multiproc import MultiprocExecutor

log = structlog.get_logger(__name__)


def _log_speculative(spec: SpeculativeConfig | None) -> None:
    """Say at start that speculative decoding is on, and how: it changes every step's work,
    and a server started from a script should show what it runs."""
    if spec is None:
        return
    ngram = spec.method == "ngram"
    log.info("speculative_decoding", method=spec.method,
             num_speculative_tokens=spec.num_speculative_tokens, draft_model=spec.model,
             prompt_lookup_max=spec.prompt_lookup_max if ngram else None,
             prompt_lookup_min=spec.prompt_lookup_min if ngram else None,
             disable_by_batch_size=spec.disable_by_batch_size)


class AsyncEngine(EngineReplica):
    """Owns the scheduler and executor actors. Create with ``await AsyncEngine.start(cfg)``."""

    def __init__(
        self, config: EngineConfig, info: ModelInfo, tokenizer: PreTrainedTokenizerBase,
        scheduler: Scheduler, executor: Executor | MultiprocExecutor,
        stat_loggers: list[StatLogger],
        structured_output: StructuredOutputManager,
    ):
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.executor = executor
        self._eos = frozenset(info.eos_token_ids)
        self.stat_loggers = stat_loggers  # shared with the scheduler; see add_stat_logger
        self.structured_output = structured_output

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model, size the KV cache and start both actors.

        Raises:
            loader.ModelLoadError: the model cannot be found or read.
            ValueError: settings that cannot work (e.g. ``max_model_len`` beyond the KV cache).
        """
        spec = config.scheduler.speculative
        draft = (DraftModelConfig(spec.model, spec.num_speculative_tokens)  # model: checked
                 if spec is not None and spec.method == "draft_model" and spec.model is not None
                 else None)
        executor = await make_executor(config.model, config.cache, config.parallel,
                                       config.scheduler.max_num_batched_tokens,
                                       config.scheduler.max_num_seqs, draft)
        info = await executor.load()
        try:
            return await cls._start_actors(config, executor, info)
        except BaseException:
            await executor.stop()  # worker processes, if any, end with it
            raise

    @classmethod
    async def _start_actors(cls, config: EngineConfig, executor: Executor | MultiprocExecutor,
                            info: ModelInfo) -> AsyncEngine:
        tokenizer = await asyncio.to_thread(loader.load_tokenizer, Path(info.path))
        capacity = info.num_blocks * info.block_size
        needed = longest_resident_tokens(info.max_model_len, info.block_size,
                                         info.kv_sliding_window,
                                         config.scheduler.max_num_batched_tokens)
        if capacity < needed:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({info.num_blocks} blocks), fewer than "
                f"one sequence may hold ({needed}, from max_model_len={info.max_model_len}): "
                f"raise --kv-cache-memory-bytes / --gpu-memory-utilization / "
                f"--num-gpu-blocks-override or lower --max-model-len"
            )
        scheduler_config, caching = pooling_scheduler_config(
            config.scheduler, info, config.cache.enable_prefix_caching)
        kv = KVCacheManager(info.num_blocks, info.block_size, caching,
                            config.cache.prefix_caching_hash_algo, info.kv_sliding_window)
        vocab_size = (await asyncio.to_thread(loader.load_config, Path(info.path))).vocab_size
        structured_output = StructuredOutputManager(
            tokenizer, vocab_size, info.eos_token_ids, config.structured_output)
        await structured_output.wait_ready()
        stat_loggers: list[StatLogger] = []
        connector = make_scheduler_connector(config.cache.kv_transfer_config, info.block_size)
        scheduler = Scheduler(scheduler_config, kv, executor, info.max_model_len, stat_loggers,
                              connector)
        executor.start()
        scheduler.start()
        log.info(
            "kv_cache_capacity",
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            num_tokens=capacity,
            max_model_len=info.max_model_len,
            max_concurrency=round(capacity / info.max_model_len, 2),
        )
        log.info(
            "engine_ready", model=info.path, dtype=info.dtype, device=info.device,
            quantization=info.quantization, load_seconds=round(info.load_seconds, 2),
            tensor_parallel_size=config.parallel.tensor_parallel_size,
            pipeline_parallel_size=config.parallel.pipeline_parallel_size,
        )
        _log_speculative(config.scheduler.speculative)
        return cls(config, info, tokenizer, scheduler, executor, stat_loggers,
                   structured_output)

    def add_stat_logger(self, logger: StatLogger) -> None:
        """Have ``logger`` see every step (from the scheduler) and every request update (from
        the request tasks). Meant for start-up, before requests arrive."""
        self.stat_loggers.append(logger)

    def add_kv_event_sink(self, sink: KVEventSink, engine_index: int | None = None) -> None:
        """Have ``sink`` get this engine's KV events, a batch per scheduler step
        (``actors/kv/event_publisher.py``), stamped ``engine_index`` when given. Start-up only."""
        if engine_index is not None:
            self.scheduler.kv_events.engine_index = engine_index
        self.scheduler.kv_events.add_sink(sink)

    async def submit(self, new: GenerateRequest) -> RequestStream:
        """``add_request`` (``EngineClient``'s): build the ``Request``, attach its grammar state
        and wait for the scheduler to accept it."""
        if self.info.runner == "pooling":  # its steps pool and never sample: it would not end
            raise ValueError("a pooling model (--runner pooling) does not generate: use encode")
        params, grammar = new.params, new.grammar
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request = Request(new.request_id, new.prompt_token_ids, params, queue,
                          eos_token_ids=self._eos, priority=new.priority,
                          cache_salt=new.cache_salt,  # the params only for a connector
                          kv_transfer_params=new.kv_transfer_params
                          if self.config.cache.kv_transfer_config is not None else None,
                          lora_request=new.lora_request)
        if grammar is not None:
            if grammar.spec != params.structured_outputs:
                raise ValueError("grammar was compiled for another constraint than "
                                 "params.structured_outputs")
            if not isinstance(grammar, CompiledConstraint):
                raise TypeError("grammar was compiled by another engine: compile it with "
                                "this engine's compile_grammar")
            request.structured_output = grammar.new_request()
        elif params.structured_outputs is not None:
            request.structured_output = self.structured_output.request_for(
                params.structured_outputs)
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.scheduler.send(AddRequest(request, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.scheduler.send(AbortRequest(new.request_id))
            raise
        detok = IncrementalDetokenizer(self.tokenizer, new.prompt_token_ids, params)
        return RequestStream(self.scheduler, request, detok, RequestMetrics(self.stat_loggers))

    async def beam_search(
        self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
        stop_token_ids: list[int] | None = None, priority: int = 0,
        cache_salt: str | None = None,
    ) -> BeamSearchStream:
        """Queue a beam search (transformers' rules, ``actors/beam/search.py``; its beams share
        KV blocks, ``actors/beam/group.py``) and return its handle once accepted.

        Args:
            stop_token_ids: ids that end a hypothesis as EOS does.

        Raises:
            EngineOverloaded, DuplicateRequestId: as ``add_request``.
        """
        search = BeamSearch(params, self._eos | frozenset(stop_token_ids or ()))
        # Greedy rows with the top logprobs the search ranks; it decides when beams stop.
        sampling = SamplingParams(temperature=0.0, logprobs=search.num_candidates,
                                  max_tokens=None, ignore_eos=True)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request = Request(request_id, prompt_token_ids, sampling, queue, eos_token_ids=self._eos,
                          priority=priority, cache_salt=cache_salt)
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.scheduler.send(AddRequest(request, accepted, beam_search=search))
        try:
            await accepted
        except asyncio.CancelledError:
            self.scheduler.send(AbortRequest(request_id))
            raise
        return BeamSearchStream(self.scheduler, request, RequestMetrics(self.stat_loggers))

    async def encode(
        self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
        priority: int = 0, cache_salt: str | None = None,
    ) -> PoolingOutput:
        """Run one pooling request (``--runner pooling``): its prompt's prefill through the
        scheduler, then its vector (``actors/engine/pooling.py``).

        Raises:
            ValueError: the model is not served by the pooling runner.
            EngineOverloaded, DuplicateRequestId: as ``add_request``.
            EngineShuttingDown, EngineError: the server aborted it, or it failed.
        """
        return await run_pooling(self.scheduler, self.info, self.stat_loggers, request_id,
                                 prompt_token_ids, params, priority, cache_salt)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledConstraint:
        """Compile (or find cached) a guided-decoding constraint before starting a request;
        pass the result to ``add_request`` (``grammar=``) with ``spec`` in its params.

        Raises:
            GrammarError: the constraint is invalid or took longer than the compile timeout.
        """
        return await self.structured_output.compile(spec)

    async def get_stats(self) -> EngineStats:
        """A snapshot from the scheduler actor, asked by message, with the model and the
        settings in force."""
        reply: asyncio.Future[StatsSnapshot] = asyncio.get_running_loop().create_future()
        self.scheduler.send(GetStats(reply))
        snap = await reply
        return EngineStats(snap.scheduler, snap.kv_cache, snap.steps, snap.throughput,
                           self.info, self.effective_config(), time.time())

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds; returns how many."""
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.scheduler.send(ResetPrefixCache(reply))
        return await reply

    async def drain(self, timeout: float) -> None:
        """End the requests still waiting to start at once, let the running ones finish for
        up to ``timeout`` seconds, then end the rest (their clients get an error saying the
        server is shutting down; 503 before the first token, in-band after).

        Raises:
            EngineDeadError: the engine died (its requests have failed already).
        """
        self.scheduler.send(AbortAll("server shutting down", unstarted_only=True))
        try:
            await asyncio.wait_for(self.wait_idle(), timeout)
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on; 3.10 is supported
            self.scheduler.send(AbortAll("server shutting down"))
            await self.wait_idle()  # answered after the AbortAll: the requests are gone

    async def wait_idle(self) -> None:
        """Until the scheduler says nothing is running or waiting."""
        reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.scheduler.send(NotifyWhenIdle(reply))
        await reply

    def effective_config(self) -> dict[str, Any]:
        """The settings in force: the flags as given, with what loading resolved (the model
        file, ``auto`` dtype and quantization, default ``max_model_len``, the KV pool's blocks
        and bytes, on the CPU what the kernels run, ``cpu_isa``: their tier with ``_vnni`` where
        the int8 kernel uses VNNI, ``cpu_ops.isa_level()``) filled in."""
        config = asdict(self.config)
        # The scheduler's own: a pooling encoder runs whole prompts (actors/engine/pooling.py).
        config["scheduler"] = asdict(self.scheduler.config)
        config["model"].update(model=self.info.source, dtype=self.info.dtype,
                               device=self.info.device, max_model_len=self.info.max_model_len,
                               quantization=self.info.quantization,
                               cpu_linear_paths=self.info.cpu_linear_paths,
                               weights_resident=self.info.weights_resident,
                               cpu_isa=cpu_ops.isa_level() if self.info.device == "cpu" else None)
        config["cache"].update(num_blocks=self.info.num_blocks,
                               kv_cache_memory_bytes=self.info.kv_cache_bytes)
        return config

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve any more (an actor crashed, a worker process died; its
        requests have failed), else ``None``."""
        return self.scheduler.failure or self.executor.failure

    async def wait_failed(self) -> None:
        """Until the engine has failed for good: the scheduler or the executor is dead."""
        waits = [asyncio.ensure_future(a.dead.wait()) for a in (self.scheduler, self.executor)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def shutdown(self) -> None:
        await self.scheduler.stop()
        await self.executor.stop()
        self.structured_output.shutdown()
