"""Content while no call has started: what can be sent now without sending the start of a
call marker (or whitespace that may only precede one)."""

from __future__ import annotations

from pagedserve.server.tools.parsers.base import hold_back_prefix


def text_before(text: str, marker: str, final: bool) -> str:
    """``text`` when it is all there; else all but a tail that could begin ``marker`` and
    trailing whitespace (dropped from content if a call follows)."""
    if final:
        return text
    return text[:hold_back_prefix(text, marker)].rstrip()
