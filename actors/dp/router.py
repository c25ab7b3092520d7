"""Which engine of a data-parallel group runs a request (the idea of llm-d's and SGLang's
cache-aware routers, and of vLLM's ``DPLBAsyncMPClient`` for the load side).

The router keeps, per engine, what the engine told it in KV events (``actors/kv/events.py``):
the set of block hashes it holds in its prefix cache, and its running and waiting counts,
pushed when they change. It never asks an engine anything per request.

Policies (``--data-parallel-routing``):

``prefix`` (default)
    hash the prompt's full blocks on the front, with the engines' function and salt
    (``actors/kv/hashing.py``), and pick the engine holding the longest run of the leading
    hashes; among equals, the lightest. Unless that run covers less than
    ``PREFIX_MIN_MATCH`` of the prompt's tokens (a chat template's system prompt, which every
    request shares: a block or two of a few hundred tokens saves little and would pull every
    request of a burst to the first engine that served one), or that engine's score (below)
    exceeds the lightest engine's by more than ``PREFIX_LOAD_THRESHOLD`` requests (its queue costs
    more than the prefill it saves): then the lightest wins. A prompt nobody holds goes to the
    lightest. The match-rate gate is SGLang's router's ``cache_threshold`` idea.
``least-load``
    the lightest engine.
``round-robin``
    each engine in turn.

An engine's load is the front's own count where the front keeps one (``count_from_front``:
the ``EngineCoreClient``'s requests sent and not finished, and the prompt tokens of those not
answered yet), else the engine's pushed running + waiting. Pushed counts lag by what is on the
wire: an ``EngineLoad`` that left an engine before a routed request reached it undoes the
router's count of that request, and a measured 32-request burst split 20 / 12 on that alone.

The router compares engines by a score (``EngineView.score``): that count plus, from the
front's count, the prompt tokens still to prefill over ``PROMPT_TOKENS_PER_REQUEST``, so a
burst splits its prefill work, not only its requests, evenly (a measured 32-request burst of
loadgen's prompts went 16 / 16 in requests but 4,161 / 2,483 in prompt tokens, and its last
first token came when the heavier engine's prefill ended). vLLM's ``DPLBAsyncMPClient``
weighs its counts too (waiting ones 4×). Ties go to the engine this router has sent fewer
requests to, so requests that arrive one by one to an idle group still spread. Engines marked
failed are never chosen. A routed request counts on its engine at once, so a burst that
arrives before any event or count is spread too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.actors.errors import EngineOverloaded
from pagedserve.actors.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
    KVEventBatch,
)
from pagedserve.actors.kv.hashing import HASH_FUNCTIONS, BlockHash, extend_block_hashes

ROUTING_POLICIES = ("prefix", "least-load", "round-robin")
# Requests (running + waiting) by which the engine holding a prompt's prefix may exceed the
# lightest engine and still get it. About a decode batch's worth on this project's CPU sizes:
# below it, re-using the prefix saves more than the wait costs.
PREFIX_LOAD_THRESHOLD = 8
# The share of a prompt's tokens the prefix holder's cached run must cover to win. Turn k of a
# conversation re-sends turns 1..k-1: past the first turns, most of it.
PREFIX_MIN_MATCH = 0.5
# Prompt tokens still to prefill that weigh as much as one more request in an engine's score.
# A burst's prompts all wait for prefill, so their tokens must outweigh their count for it to
# split its prefill work evenly: routed in arrival order (with jitter), loadgen's 32-prompt
# burst leaves the heavier engine 4.2 % over an even split at 256, 1.7 % at 64, 1.3 % at 32
# (medians of 300 orders). A waiting chat prompt (~230 tokens) then weighs under 4 requests,
# so one or two still leave a prefix holder within ``PREFIX_LOAD_THRESHOLD``.
PROMPT_TOKENS_PER_REQUEST = 64


class NoEngineLeft(EngineOverloaded):
    """Every engine of the group has failed: the server answers 503 (``server/openai/admission.py``
    maps an ``EngineOverloaded`` to an OpenAI-shaped 503), not a 500."""


@dataclass(slots=True)
class EngineView:
    """What the router knows of one engine, from its events.

    Attributes:
        cached: block hashes in its prefix cache (in use or evictable).
        num_running, num_waiting: its last ``EngineLoad``, plus requests routed since.
        num_unfinished: the front's count of its unfinished requests (``count_from_front``),
            plus requests routed since; ``None`` where the front keeps none.
        unanswered_tokens: prompt tokens of its requests without a first output yet (front's
            count, plus prompts routed since); 0 where the front keeps none.
        num_routed: requests this router sent it (tie-breaks, and the operators' view).
        failed: why it cannot serve (set by the front), else ``None``.
    """

    index: int
    cached: set[bytes] = field(default_factory=set)
    num_running: int = 0
    num_waiting: int = 0
    num_unfinished: int | None = None
    unanswered_tokens: int = 0
    num_routed: int = 0
    failed: str | None = None

    @property
    def load(self) -> int:
        """Requests on the engine: the front's count where kept, else the pushed one."""
        if self.num_unfinished is not None:
            return self.num_unfinished
        return self.num_running + self.num_waiting

    @property
    def score(self) -> float:
        """What the router compares, in requests: ``load``, plus the prompt tokens still to
        prefill over ``PROMPT_TOKENS_PER_REQUEST`` where the front keeps its count (the
        pushed counts have no token figure)."""
        if self.num_unfinished is None:
            return float(self.load)
        return self.num_unfinished + self.unanswered_tokens / PROMPT_TOKENS_PER_REQUEST


@dataclass(slots=True)
class RoutingDecision:
    """One request's route, for its log line.

    Attributes:
        engine: the chosen engine's index.
        policy: the policy that chose it.
        matched_blocks: leading prompt blocks the chosen engine holds (its expected hit);
            also counted under ``least-load`` and ``round-robin``.
        loads: every engine's load (``EngineView.load``: its unfinished requests) when it was
            chosen; -1 for a failed one.
        reason: ``prefix``, ``load`` (the prefix holder was too busy or held too little of
            the prompt, or none held any),
            ``least-load`` or ``round-robin``.
    """

    engine: int
    policy: str
    matched_blocks: int
    loads: list[int]
    reason: str

    def log_fields(self) -> dict[str, object]:
        return {"engine": self.engine, "routing": self.policy, "route_reason": self.reason,
                "matched_blocks": self.matched_blocks, "engine_loads": self.loads}


class DPRouter:
    """Args:
    num_engines: engines in the group, indexed 0..n-1 (``KVEventBatch.engine_index``).
    policy: one of ``ROUTING_POLICIES``.
    block_size, hash_algo: the engines' ``--block-size`` and ``--prefix-caching-hash-algo``.
    load_threshold: ``PREFIX_LOAD_THRESHOLD`` unless given.
    """

    def __init__(self, num_engines: int, policy: str = "prefix", block_size: int = 16,
                 hash_algo: str = "sha256", load_threshold: int = PREFIX_LOAD_THRESHOLD):
        if num_engines < 1:
            raise ValueError("a data-parallel group needs at least one engine")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: one of "
                             f"{', '.join(ROUTING_POLICIES)}")
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"unknown prefix-caching hash {hash_algo!r}")
        self.policy = policy
        self.block_size = block_size
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.load_threshold = load_threshold
        self.engines = [EngineView(i) for i in range(num_engines)]
        self._next = 0  # round-robin's turn

    # -- what the engines say -----------------------------------------------------------------

    def on_kv_events(self, batch: KVEventBatch) -> None:
        """A ``KVEventSink``: apply one engine's batch, in order."""
        view = self.engines[batch.engine_index]
        for event in batch.events:
            if isinstance(event, BlockStored):
                view.cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                view.cached.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                view.cached.clear()
            elif isinstance(event, EngineLoad):
                view.num_running, view.num_waiting = event.num_running, event.num_waiting

    def count_from_front(self, index: int, num_unfinished: int, unanswered_tokens: int) -> None:
        """The front's exact count of engine ``index``'s work, set before each ``route``
        (``EngineCoreClient.front_load``); it replaces the pushed counts as the load."""
        view = self.engines[index]
        view.num_unfinished, view.unanswered_tokens = num_unfinished, unanswered_tokens

    def mark_failed(self, index: int, reason: str) -> None:
        view = self.engines[index]
        view.failed = reason
        view.cached.clear()

    # -- the choice ---------------------------------------------------------------------------

    def prompt_hashes(self, prompt_token_ids: Sequence[int],
                      cache_salt: str | None = None) -> list[BlockHash]:
        """The prompt's full-block hashes, as every engine computes them."""
        hashes: list[BlockHash] = []
        extend_block_hashes(self.hash_fn, hashes, prompt_token_ids, self.block_size, cache_salt)
        return hashes

    def route(self, prompt_token_ids: Sequence[int],
              cache_salt: str | None = None) -> RoutingDecision:
        """Choose the engine for a prompt and count the request on it.

        Raises:
            NoEngineLeft: every engine has failed.
        """
        alive = [v for v in self.engines if v.failed is None]
        if not alive:
            raise NoEngineLeft("no engine left: every data-parallel engine has failed")
        hashes = self.prompt_hashes(prompt_token_ids, cache_salt)
        matched = {v.index: _leading_run(hashes, v.cached) for v in alive}
        lightest = min(alive, key=_by_load)
        if self.policy == "round-robin":
            chosen, reason = self._round_robin(alive), "round-robin"
        elif self.policy == "least-load":
            chosen, reason = lightest, "least-load"
        else:
            best = max(alive, key=lambda v: (matched[v.index], -v.score, -v.num_routed))
            covered = matched[best.index] * self.block_size
            if (covered > 0 and covered >= PREFIX_MIN_MATCH * len(prompt_token_ids)
                    and best.score - lightest.score <= self.load_threshold):
                chosen, reason = best, "prefix"
            else:
                chosen, reason = lightest, "load"
        decision = RoutingDecision(
            chosen.index, self.policy, matched[chosen.index],
            [v.load if v.failed is None else -1 for v in self.engines], reason)
        chosen.num_waiting += 1  # until the engine's next EngineLoad says better
        if chosen.num_unfinished is not None:  # until the front's next count
            chosen.num_unfinished += 1
            chosen.unanswered_tokens += len(prompt_token_ids)
        chosen.num_routed += 1
        return decision

    def _round_robin(self, alive: list[EngineView]) -> EngineView:
        n = len(self.engines)
        for step in range(n):
            view = self.engines[(self._next + step) % n]
            if view.failed is None:
                self._next = (view.index + 1) % n
                return view
        return alive[0]  # unreachable: alive is not empty


def _by_load(view: EngineView) -> tuple[float, int, int]:
    return (view.score, view.num_routed, view.index)


def _leading_run(hashes: list[BlockHash], cached: set[bytes]) -> int:
    """How many of ``hashes``, from the first, are in ``cached``."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n
