"""``GET /metrics``: Prometheus text under vLLM's metric names, prefixed ``pagedserve:`` (or
``vllm:`` with ``--metrics-prefix vllm``, so that dashboards built for vLLM read it unchanged).

Each app owns a ``CollectorRegistry`` (never the process-global one), so several servers in
one process keep their own counts. Two kinds of figure:

- events, counted as they happen by ``PrometheusStatLogger`` (an engine ``StatLogger``): tokens,
  finished requests by reason, TTFT / ITL / e2e / queue-time histograms, tokens per step;
- per finished request (vLLM's ``FinishedRequestStats``): prompt and output lengths, the
  output cap, prefill / decode / inference time and time per output token;
- with data parallelism, every series per engine (label ``engine="k"``), and whether each
  engine is up and how many requests the router sent it;
- levels and totals the scheduler owns (queue lengths, KV usage, preemptions, prefix-cache
  queries and hits), read from a fresh ``GetStats`` snapshot at scrape time, so they are never
  stale when the server has gone idle; and ``cache_config_info``, the KV cache settings as
  labels of a constant 1.

vLLM's older dashboards also query ``gpu_cache_usage_perc`` (now ``kv_cache_usage_perc``, served
under both names), ``cpu_cache_usage_perc`` and ``num_requests_swapped`` (always 0: pagedserve
never swaps, a preempted request is recomputed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.actors.stats import (
    EngineStats,
    FinishedRequest,
    RequestUpdate,
    SpecDecodeStats,
    StepStats,
)

PREFIX = "pagedserve:"  # the default --metrics-prefix, with its colon
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")

# Seconds; close to vLLM's buckets so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets for lengths in tokens)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# (attribute, name, help, buckets) of the histograms observed as events happen; the lengths'
# buckets depend on max_model_len.
def _histogram_specs(lengths: tuple[int, ...]) -> list[tuple[str, str, str, tuple]]:
    return [
        ("ttft", "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
        ("itl", "inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS),
        # vLLM V1's older name for the same per-token observations (its dashboards query it).
        ("tpot", "time_per_output_token_seconds",
         "Time between two output tokens (inter_token_latency_seconds).", TPOT_BUCKETS),
        ("e2e", "e2e_request_latency_seconds", "Arrival to end of a request.", REQUEST_BUCKETS),
        ("queue_time", "request_queue_time_seconds", "Arrival to first scheduled step.",
         REQUEST_BUCKETS),
        ("iteration_tokens", "iteration_tokens_total", "Tokens computed per step.",
         TOKEN_BUCKETS),
        # Once per finished engine request (``record_request``), but ``request_params_n``: once
        # per client request (a request with ``n > 1`` runs as ``n`` engine requests; only the
        # first carries its ``n``, see ``SamplingParams.n``).
        ("request_prompt_tokens", "request_prompt_tokens",
         "Prompt tokens of a finished request.", lengths),
        ("request_generation_tokens", "request_generation_tokens",
         "Output tokens of a finished request.", lengths),
        ("request_max_tokens", "request_max_num_generation_tokens",
         "Output tokens a finished request could have had at most (its max_tokens).", lengths),
        ("request_n", "request_params_n", "The n of a finished request.", N_BUCKETS),
        ("prefill_time", "request_prefill_time_seconds", "First scheduled step to first token.",
         REQUEST_BUCKETS),
        ("decode_time", "request_decode_time_seconds", "First token to last token.",
         REQUEST_BUCKETS),
        ("inference_time", "request_inference_time_seconds",
         "First scheduled step to last token.", REQUEST_BUCKETS),
        ("request_tpot", "request_time_per_output_token_seconds",
         "A request's decode time over its tokens after the first.", TPOT_BUCKETS),
    ]


class EngineMetrics:
    """One engine's event series (a ``StatLogger``): the app's counters and histograms bound to
    its label values (``model_name``, and ``engine`` with data parallelism). Its attributes
    are the bound children, named as in ``_histogram_specs``."""

    def __init__(self, parents: dict[str, Any], values: tuple[str, ...]):
        self.values = values
        self.request_success = parents["request_success"]
        self.pooling_success = parents["pooling_success"]
        for attr, parent in parents.items():
            if attr not in ("request_success", "pooling_success"):
                setattr(self, attr, parent.labels(*values))
        for reason in FINISH_REASONS:  # shown as 0 before the first one happens
            self.request_success.labels(*values, reason)

    def record_step(self, step: StepStats) -> None:
        self.iteration_tokens.observe(step.num_tokens)
        for q in step.queue_times_s:
            self.queue_time.observe(q)

    def record_request(self, update: RequestUpdate) -> None:
        if update.pooling:  # apart from generation: no tokens out, no TTFT
            self.prompt_tokens.inc(update.num_prompt_tokens)
            if update.finish_reason is not None:
                self.pooling_success.labels(*self.values, update.finish_reason).inc()
            if update.e2e_s is not None:
                self.pooling_e2e.observe(update.e2e_s)
            return
        if update.num_prompt_tokens:
            self.prompt_tokens.inc(update.num_prompt_tokens)
        if update.num_generation_tokens:
            self.generation_tokens.inc(update.num_generation_tokens)
        if update.ttft_s is not None:
            self.ttft.observe(update.ttft_s)
        if update.itl_s is not None:
            self.itl.observe(update.itl_s)
            self.tpot.observe(update.itl_s)
        if update.finish_reason is not None:
            self.request_success.labels(*self.values, update.finish_reason).inc()
        if update.e2e_s is not None:
            self.e2e.observe(update.e2e_s)
        if update.finished is not None:
            self._record_finished(update.finished)

    def _record_finished(self, done: FinishedRequest) -> None:
        self.request_prompt_tokens.observe(done.num_prompt_tokens)
        self.request_generation_tokens.observe(done.num_generation_tokens)
        self.request_max_tokens.observe(done.max_tokens)
        if done.n > 0:  # 0: another choice of a request with n > 1, counted once already
            self.request_n.observe(done.n)
        for histogram, value in ((self.prefill_time, done.prefill_s),
                                 (self.decode_time, done.decode_s),
                                 (self.inference_time, done.inference_s),
                                 (self.request_tpot, done.time_per_output_token_s)):
            if value is not None:
                histogram.observe(value)


class PrometheusStatLogger:
    """Counts engine events into the app's registry; ``render`` writes the exposition.

    With ``num_engines`` > 1 (data parallelism) every series carries ``engine="k"`` as well
    (the totals are ``sum without (engine)``, as for vLLM's data-parallel metrics), each engine
    reports to its own ``for_engine(k)`` logger, and the snapshot figures come from each
    engine's part of ``DataParallelStats``. With one engine the exposition has no ``engine``
    label, as before data parallelism.
    """

    def __init__(self, model_name: str, prefix: str = "pagedserve",
                 cache_info: dict | None = None, max_model_len: int = 16384,
                 num_engines: int = 1):
        self.model_name = model_name
        self.prefix = prefix + ":"
        self.registry = CollectorRegistry()
        per_engine = num_engines > 1
        self._snapshot = _SnapshotCollector(model_name, self.prefix, cache_info or {},
                                            per_engine)
        self.registry.register(self._snapshot)
        labels = ["model_name", "engine"] if per_engine else ["model_name"]
        parents: dict[str, Any] = {
            "prompt_tokens": Counter(self.prefix + "prompt_tokens", "Prefilled prompt tokens.",
                                     labels, registry=self.registry),
            "generation_tokens": Counter(self.prefix + "generation_tokens", "Generated tokens.",
                                         labels, registry=self.registry),
            "request_success": Counter(
                self.prefix + "request_success", "Finished requests, by finish reason.",
                [*labels, "finished_reason"], registry=self.registry),
            "pooling_success": Counter(
                self.prefix + "pooling_request_success",
                "Finished pooling requests (embeddings, scores), by finish reason.",
                [*labels, "finished_reason"], registry=self.registry),
            "pooling_e2e": Histogram(
                self.prefix + "pooling_request_latency_seconds",
                "Arrival to end of a pooling request.", labels, buckets=REQUEST_BUCKETS,
                registry=self.registry),
        }
        for attr, name, doc, buckets in _histogram_specs(buckets_1_2_5(max_model_len)):
            parents[attr] = Histogram(self.prefix + name, doc, labels, buckets=buckets,
                                      registry=self.registry)
        self.engines = [EngineMetrics(parents, (model_name, str(k)) if per_engine
                                      else (model_name,)) for k in range(num_engines)]

    def for_engine(self, k: int) -> EngineMetrics:
        """The ``StatLogger`` of engine ``k``'s series."""
        return self.engines[k]

    # -- StatLogger (the first engine's series; the only one without data parallelism) ------

    def record_step(self, step: StepStats) -> None:
        self.engines[0].record_step(step)

    def record_request(self, update: RequestUpdate) -> None:
        self.engines[0].record_request(update)

    # -- exposition ---------------------------------------------------------------------------

    def render(self, snapshot: EngineStats) -> bytes:
        """The exposition, with the scheduler's figures taken from ``snapshot`` (a
        ``GetStats`` reply fetched for this scrape)."""
        self._snapshot.snapshot = snapshot
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Gauges and scheduler-owned totals, from the snapshot handed to ``render``; and the
    constant ``cache_config_info``. Per engine (label ``engine``) when ``per_engine``, with
    ``data_parallel_engine_up`` and ``data_parallel_routed_requests`` added."""

    def __init__(self, model_name: str, prefix: str, cache_info: dict, per_engine: bool = False):
        self.model_name = model_name
        self.prefix = prefix
        self.cache_info = {k: str(v) for k, v in cache_info.items()}
        self.per_engine = per_engine
        self.labels = ["model_name", "engine"] if per_engine else ["model_name"]
        self.snapshot: EngineStats | None = None

    def _parts(self) -> list[tuple[list[str], EngineStats]]:
        """(label values, stats) per series: the one engine, or each live engine."""
        snap = self.snapshot
        if snap is None:
            return []
        engines = getattr(snap, "engines", None) if self.per_engine else None
        if engines is None:
            return [([self.model_name, "0"] if self.per_engine else [self.model_name], snap)]
        return [([self.model_name, str(k)], s) for k, s in enumerate(engines) if s is not None]

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:  # registration calls collect() once to learn the names
            return
        parts = self._parts()
        for name, doc, get in _SNAPSHOT_GAUGES:
            yield self._family(GaugeMetricFamily, name, doc, [(v, get(s)) for v, s in parts])
        keys = sorted(self.cache_info)
        info = GaugeMetricFamily(self.prefix + "cache_config_info", "KV cache settings.",
                                 labels=["model_name", *keys])
        info.add_metric([self.model_name, *(self.cache_info[k] for k in keys)], 1)
        yield info
        for name, doc, get in _SNAPSHOT_COUNTERS:
            yield self._family(CounterMetricFamily, name, doc, [(v, get(s)) for v, s in parts])
        yield from self._spec_decode([(v, s.scheduler.spec_decode) for v, s in parts])
        yield from self._lora([(v, s.scheduler) for v, s in parts])
        routing = getattr(self.snapshot, "routing", None)
        if self.per_engine and routing is not None:
            yield from self._routing(routing)

    def _routing(self, routing: list) -> Iterator[Metric]:
        up = [([self.model_name, str(r.index)], 0 if r.failed else 1) for r in routing]
        yield self._family(GaugeMetricFamily, "data_parallel_engine_up",
                           "1 while the engine serves, 0 once it failed.", up)
        routed = [([self.model_name, str(r.index)], r.num_routed) for r in routing]
        yield self._family(CounterMetricFamily, "data_parallel_routed_requests",
                           "Requests the router sent to the engine.", routed)

    def _spec_decode(self, parts: list[tuple[list[str], SpecDecodeStats]]) -> Iterator[Metric]:
        """vLLM's ``spec_decode`` names (drafts, tokens, accepted per position), and the time
        spent drafting and verifying."""
        for name, doc, attr in _SPEC_COUNTERS:
            yield self._family(CounterMetricFamily, name, doc,
                               [(v, getattr(sd, attr)) for v, sd in parts])
        per_pos = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, per draft position.",
                                      labels=[*self.labels, "position"])
        for values, sd in parts:
            for pos, n in enumerate(sd.accepted_per_pos):
                per_pos.add_metric([*values, str(pos)], n)
        yield per_pos

    def _lora(self, parts: list[tuple[list[str], Any]]) -> Iterator[Metric]:
        """vLLM's ``lora_requests_info``: the adapters of the running and waiting requests
        (comma-joined names) and ``max_lora`` as labels, the snapshot's time as the value;
        only with --enable-lora."""
        parts = [(v, sched) for v, sched in parts if sched.max_lora]
        if not parts:
            return
        info = GaugeMetricFamily(self.prefix + "lora_requests_info",
                                 "Running and waiting LoRA adapters.",
                                 labels=[*self.labels, "max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"])
        for values, sched in parts:
            info.add_metric([*values, str(sched.max_lora),
                             ",".join(sorted(sched.waiting_lora_adapters)),
                             ",".join(sorted(sched.running_lora_adapters))], time.time())
        yield info

    def _family(self, kind, name: str, doc: str, samples: list[tuple[list[str], float]]):
        family = kind(self.prefix + name, doc, labels=self.labels)
        for values, value in samples:
            family.add_metric(values, value)
        return family


_SNAPSHOT_GAUGES = (
    ("num_requests_running", "Requests in the running batch.",
     lambda s: s.scheduler.num_running),
    ("num_requests_waiting", "Requests waiting to be scheduled.",
     lambda s: s.scheduler.num_waiting),
    ("num_requests_swapped", "Always 0: preempted requests are recomputed.", lambda s: 0),
    ("kv_cache_usage_perc", "KV cache usage (1 = full).", lambda s: s.kv_cache.usage),
    ("gpu_cache_usage_perc", "KV cache usage (1 = full); vLLM's older name of "
     "kv_cache_usage_perc, whatever the device.", lambda s: s.kv_cache.usage),
    ("cpu_cache_usage_perc", "Always 0: no CPU swap space.", lambda s: 0),
)
_SNAPSHOT_COUNTERS = (
    ("num_preemptions", "Preemptions (recompute).", lambda s: s.scheduler.num_preemptions_total),
    ("prefix_cache_queries", "Prefix-cache queries, in tokens.",
     lambda s: s.kv_cache.prefix_cache_queries),
    ("prefix_cache_hits", "Prefix-cache hits, in tokens.", lambda s: s.kv_cache.prefix_cache_hits),
)
_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Verify passes of a request with drafts.", "num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens scored.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
    ("spec_decode_draft_seconds", "Time spent proposing drafts.", "draft_seconds"),
    ("spec_decode_verify_seconds", "Time of the steps that verified drafts.", "verify_seconds"),
)
