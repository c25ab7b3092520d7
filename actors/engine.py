"""The engine as the HTTP layer sees it: start the actors, run one request as a task.

``AsyncEngine.generate`` is the *request task* of DESIGN.md: it owns the request's output queue,
sends ``AddRequest`` to the scheduler, detokenizes what comes back, applies stop strings and,
in its ``finally``, sends ``AbortRequest`` when the request did not end by itself (client gone,
stop string matched), so the scheduler frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from transformers import PreTrainedTokenizerBase

from actors.config import SchedulerConfig
from actors.detokenizer import IncrementalDetokenizer
from actors.executor import Executor
from actors.kv_cache_manager import KVCacheManager
from actors.messages import AbortRequest, AddRequest, GetStats, ResetPrefixCache
from actors.request import Request, RequestOutput
from actors.scheduler import Scheduler
from actors.structured_output import GrammarError, StructuredOutputConfig, StructuredOutputManager
from gpu import loader
from gpu.config import CacheConfig, ModelConfig
from gpu.model_runner import ModelInfo, ModelRunner
from gpu.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["AsyncEngine", "EngineConfig", "EngineError", "GenerationDelta", "GrammarError"]

log = structlog.get_logger(__name__)


class EngineError(RuntimeError):
    """A request failed inside the engine (its step raised); other requests carry on."""


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)


@dataclass(slots=True)
class GenerationDelta:
    """One increment of a request's output.

    Attributes:
        text: new text (may be empty while a stop string or a multibyte character is pending).
        token_ids: tokens sampled since the last delta.
        finish_reason: ``stop``/``length`` on the last delta, else ``None``.
        num_prompt_tokens, num_output_tokens: usage so far.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


class AsyncEngine:
    """Owns the scheduler and executor actors. Create with ``await AsyncEngine.start(cfg)``."""

    def __init__(
        self, config: EngineConfig, info: ModelInfo, tokenizer: PreTrainedTokenizerBase,
        scheduler: Scheduler, executor: Executor, structured_output: StructuredOutputManager,
    ):
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.executor = executor
        self._eos = frozenset(info.eos_token_ids)
        self.structured_output = structured_output

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model, size the KV cache and start both actors.

        Raises:
            loader.ModelLoadError: the model cannot be found or read.
            ValueError: settings that cannot work (e.g. ``max_model_len`` beyond the KV cache).
        """
        executor = Executor(ModelRunner(config.model, config.cache))
        info = await executor.load()
        tokenizer = await asyncio.to_thread(loader.load_tokenizer, info.path)
        capacity = info.num_blocks * info.block_size
        if capacity < info.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({info.num_blocks} blocks), fewer than "
                f"max_model_len={info.max_model_len}: raise --kv-cache-memory-bytes / "
                f"--gpu-memory-utilization / --num-gpu-blocks-override or lower --max-model-len"
            )
        kv = KVCacheManager(
            info.num_blocks, info.block_size, config.cache.enable_prefix_caching,
            config.cache.prefix_caching_hash_algo,
        )
        vocab_size = (await asyncio.to_thread(loader.load_config, Path(info.path))).vocab_size
        structured_output = StructuredOutputManager(
            tokenizer, vocab_size, info.eos_token_ids, config.structured_output)
        scheduler = Scheduler(config.scheduler, kv, executor, info.max_model_len)
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
            load_seconds=round(info.load_seconds, 2),
        )
        return cls(config, info, tokenizer, scheduler, executor, structured_output)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Run one request, yielding text deltas until it finishes.

        Args:
            priority: lower runs earlier under the ``priority`` scheduling policy.
            cache_salt: isolates the request's prefix-cache blocks from other salts.

        Raises:
            EngineError: the request failed inside the engine.
        """
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request = Request(request_id, prompt_token_ids, params, queue, eos_token_ids=self._eos,
                          priority=priority, cache_salt=cache_salt)
        if params.structured_outputs is not None:
            request.structured_output = self.structured_output.request_for(
                params.structured_outputs)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self.scheduler.send(AddRequest(request))
        num_output = 0
        ended_in_engine = False
        try:
            while True:
                out = await queue.get()
                ended_in_engine = out.finish_reason is not None
                if out.finish_reason in ("error", "abort"):
                    raise EngineError(out.error or f"request {out.finish_reason}")
                num_output += len(out.new_token_ids)
                text = detok.update(out.new_token_ids, final=ended_in_engine)
                finish = detok.stop_reason or out.finish_reason
                yield GenerationDelta(
                    text, out.new_token_ids, finish, len(prompt_token_ids), num_output
                )
                if finish is not None:
                    return
        finally:
            if not ended_in_engine:
                self.scheduler.send(AbortRequest(request_id))

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile (or find cached) a guided-decoding constraint before starting a request.

        Raises:
            GrammarError: the constraint is invalid or took longer than the compile timeout.
        """
        await self.structured_output.compile(spec)

    async def get_stats(self) -> dict[str, Any]:
        """A snapshot from the scheduler actor, asked by message."""
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.scheduler.send(GetStats(reply))
        stats = await reply
        stats["model"] = {"name": self.info.served_name, "path": self.info.path,
                          "dtype": self.info.dtype, "device": self.info.device,
                          "max_model_len": self.info.max_model_len}
        stats["time"] = time.time()
        return stats

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds; returns how many."""
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.scheduler.send(ResetPrefixCache(reply))
        return await reply

    async def shutdown(self) -> None:
        await self.scheduler.stop()
        await self.executor.stop()
        self.structured_output.shutdown()
