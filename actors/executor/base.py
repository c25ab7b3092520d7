"""The executor actor: owns the model runner and runs each step on one dedicated thread, so the
event loop keeps serving HTTP and SSE while the forward pass runs. ``make_executor`` picks it,
or for a tensor/pipeline-parallel model the multi-process (``actors/executor/multiproc.py``) or Ray
(``actors/executor/ray.py``) one.

Steps are queued to the thread as they arrive: with a step built ahead (``--async-scheduling``,
``actors/core/inflight.py``) the thread goes from one forward pass to the next without waiting for
the event loop, and the runner fills the input tokens the scheduler did not have yet."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pagedserve.actors.actor import Actor
from pagedserve.actors.errors import EngineDeadError
from pagedserve.actors.messages import ExecuteModel, ExecutorMessage
from pagedserve.gpu import loader
from pagedserve.gpu.config import CacheConfig, DraftModelConfig, ModelConfig, ParallelConfig
from pagedserve.gpu.model_info import ModelInfo
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.parallel.gguf_shard import gguf_split_problem
from pagedserve.gpu.parallel.layout import check_layout

if TYPE_CHECKING:
    from pagedserve.actors.executor.multiproc import MultiprocExecutor


class Executor(Actor[ExecutorMessage]):
    name = "executor"
    fills_prev_sampled = True  # the runner takes PREV_SAMPLED from its last step

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        # failure / dead (Actor's): set only if this loop crashes; a failed step fails its
        # requests (the scheduler reruns them one by one) and the engine serves on.
        # One thread: the runner and its tensors are only ever touched from it.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-executor")

    async def load(self) -> ModelInfo:
        """Load the model on the worker thread (before the actor loop starts)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.runner.load)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg: ExecuteModel = await self.mailbox.get()
            try:
                self._submit(loop, msg)
            except Exception as e:  # the loop dies (Actor._main); this step's caller learns it
                self.refuse(msg, EngineDeadError(f"the executor crashed: {type(e).__name__}: {e}"))
                raise

    def _submit(self, loop: asyncio.AbstractEventLoop, msg: ExecuteModel) -> None:
        """Queue the step on the runner's thread; its output or error answers ``msg.reply``."""
        step = loop.run_in_executor(self._thread, self.runner.execute_model,
                                    msg.scheduler_output)
        step.add_done_callback(functools.partial(_answer, msg.reply))

    async def stop(self) -> None:
        await super().stop()
        self._thread.shutdown(wait=True, cancel_futures=True)


def _answer(reply: asyncio.Future, step: asyncio.Future) -> None:
    """Pass a finished step's output or error to the scheduler's ``reply``."""
    if reply.done():
        return
    if step.cancelled():
        reply.cancel()
    elif (error := step.exception()) is not None:
        reply.set_exception(error)
    else:
        reply.set_result(step.result())


async def make_executor(model: ModelConfig, cache: CacheConfig, parallel: ParallelConfig,
                        max_num_batched_tokens: int, max_num_seqs: int,
                        draft: DraftModelConfig | None = None,
                        ) -> Executor | MultiprocExecutor:
    """The executor for ``parallel``: in this process for one rank, else worker processes
    (``mp``) or Ray actors (``ray``), after checking the model splits that way. ``draft``: the
    speculative draft model (one rank only).

    Raises:
        ValueError: the layout cannot split the model (one line: which count, and why), a
            draft model is asked for with several ranks, ``--quantization gguf`` would cut a
            GGUF block across ranks (``gguf_split_problem``), a GGUF file holds experts
            under tensor parallelism, or
            Ray is asked for and not installed.
    """
    if parallel.world_size == 1:
        return Executor(ModelRunner(model, cache, max_num_batched_tokens, max_num_seqs, draft))
    if draft is not None:
        raise ValueError("--speculative-config method draft_model runs on one rank: use "
                         "method ngram with --tensor-parallel-size/--pipeline-parallel-size")
    resolved = await asyncio.to_thread(loader.resolve_model, model.model)
    config = await asyncio.to_thread(loader.load_config, resolved.path)
    num_experts: int = getattr(config, "num_experts", 0)
    if resolved.gguf_file is not None and num_experts and parallel.tensor_parallel_size > 1:
        raise ValueError("a GGUF mixture of experts splits over pipeline stages only: its 3-D "
                         "expert tensors are not split across tensor-parallel ranks; use "
                         "--pipeline-parallel-size without --tensor-parallel-size, or serve "
                         "the safetensors checkpoint")
    # With --quantization gguf the workers would refuse a block-cutting split too, one line each.
    check_layout(config, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                 gguf_split_problem if model.quantization == "gguf" else None)
    if parallel.distributed_executor_backend == "ray":
        from pagedserve.actors.executor.ray import RayExecutor

        return RayExecutor(model, cache, parallel, max_num_batched_tokens, max_num_seqs)
    from pagedserve.actors.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(model, cache, parallel, max_num_batched_tokens, max_num_seqs)
