"""The token each request sampled last on this runner, for the steps the scheduler built ahead.

Under ``--async-scheduling`` (``actors/core/inflight.py``) the scheduler sends step k+1 before it
has step k's tokens: a decode of step k+1 carries ``PREV_SAMPLED`` as its input token, and
the runner, which ran step k just before on the same thread, puts in the token it sampled then.
vLLM V1's ``gpu_model_runner`` keeps the previous step's sampled ids on the device for the same
reason (read to learn only); here they are plain ints, as the batch is built on the host.
"""

from __future__ import annotations

from pagedserve.gpu.batch import PREV_SAMPLED, ModelRunnerOutput, ScheduledRequest


class PrevSampled:
    """Last sampled token per live request id."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def fill(self, reqs: list[ScheduledRequest]) -> None:
        """Replace each ``PREV_SAMPLED`` input token by the request's last sampled token.

        Raises:
            RuntimeError: a request to fill sampled nothing here before (a scheduler bug).
        """
        for r in reqs:
            if r.token_ids and r.token_ids[0] == PREV_SAMPLED:
                token = self._last.get(r.req_id)
                if token is None:
                    raise RuntimeError(f"request {r.req_id!r} was scheduled ahead of a token "
                                       "it never sampled")
                r.token_ids = [token]

    def record(self, runner_output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Keep each request's last token of ``out``; returns ``out``."""
        for req_id, tokens in runner_output.sampled_token_ids.items():
            if tokens:
                self._last[req_id] = tokens[-1]
        return runner_output

    def forget(self, req_id: str) -> None:
        self._last.pop(req_id, None)
