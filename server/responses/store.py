"""Stored responses of ``/v1/responses``, for ``previous_response_id`` and ``GET
/v1/responses/{id}``: in memory, for the server's lifetime, at most ``max_size`` of them.

The bound is a count, not bytes: the least recently used response (created, continued or
fetched) is dropped when a new one would exceed it, and a ``previous_response_id`` naming a
dropped one is a 404, as for an id that never existed. Each entry holds its whole
conversation's text, so memory grows with ``max_size`` × conversation length. (vLLM keeps
its ``response_store`` in a plain dict without a bound; OpenAI keeps responses 30 days.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    """One finished response.

    Attributes:
        conversation: chat messages (``{"role", "content"}``; an assistant turn's
            ``tool_calls``, a ``tool`` turn's ``tool_call_id``) of every turn up to and
            including this response's output, without any turn's ``instructions``; the next
            turn's prompt starts with them.
        body: the Response object as the client received it.
    """

    conversation: list[dict[str, Any]]
    body: dict[str, Any]


class ResponseStore:
    """An LRU of ``StoredResponse`` by response id; ``max_size`` 0 stores nothing."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)
