"""``EngineConfig``: every setting of one engine, grouped as the flags are
(``server/engine_args.py`` builds it from ``pagedserve serve``'s flags; an engine-core process
gets it over the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.structured_output.config import StructuredOutputConfig
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
