"""The executor actor: owns the model runner and runs each step on one dedicated thread, so the
event loop keeps serving HTTP and SSE while the forward pass runs."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pagedserve.actors.actor import Actor
from pagedserve.actors.messages import ExecuteModel
from pagedserve.gpu.model_runner import ModelInfo, ModelRunner


class Executor(Actor):
    name = "executor"

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
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
                out = await loop.run_in_executor(
                    self._thread, self.runner.execute_model, msg.scheduler_output
                )
            except Exception as e:
                if not msg.reply.done():
                    msg.reply.set_exception(e)
                continue
            if not msg.reply.done():
                msg.reply.set_result(out)

    async def stop(self) -> None:
        await super().stop()
        self._thread.shutdown(wait=True, cancel_futures=True)
