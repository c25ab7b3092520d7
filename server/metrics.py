"""``GET /metrics``: Prometheus text under vLLM's metric names, prefixed ``pagedserve:`` (or
``vllm:`` with ``--metrics-prefix vllm``, so that dashboards built for vLLM read it unchanged).

Each app owns a ``CollectorRegistry`` (never the process-global one), so several servers in
one process keep their own counts. Two kinds of figure:

- events, counted as they happen by ``PrometheusStatLogger`` (an engine ``StatLogger``): tokens,
  finished requests by reason, TTFT / ITL / e2e / queue-time histograms, tokens per step;
- per finished request (vLLM's ``FinishedRequestStats``): prompt and output lengths, the
  output cap, prefill / decode / inference time and time per output token;
- levels and totals the scheduler owns (queue lengths, KV usage, preemptions, prefix-cache
  queries and hits), read from a fresh ``GetStats`` snapshot at scrape time, so they are never
  stale when the server has gone idle; and ``cache_config_info``, the KV cache settings as
  labels of a constant 1.

vLLM's older dashboards also query ``gpu_cache_usage_perc`` (now ``kv_cache_usage_perc``, served
under both names), ``cpu_cache_usage_perc`` and ``num_requests_swapped`` (always 0: pagedserve
never swaps, a preempted request is recomputed).
"""

from __future__ import annotations

from collections.abc import Iterator

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


class PrometheusStatLogger:
    """Counts engine events into the app's registry; ``render`` writes the exposition."""

    def __init__(self, model_name: str, prefix: str = "pagedserve",
                 cache_info: dict | None = None, max_model_len: int = 16384):
        self.model_name = model_name
        self.prefix = prefix + ":"
        self.registry = CollectorRegistry()
        self._snapshot = _SnapshotCollector(model_name, self.prefix, cache_info or {})
        self.registry.register(self._snapshot)
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(self.prefix + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(self.prefix + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.").labels(model_name)
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens.").labels(model_name)
        self.request_success = Counter(
            self.prefix + "request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # shown as 0 before the first one happens
            self.request_success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.",
                             ITL_BUCKETS)
        # vLLM V1's older name for the same per-token observations (its dashboards query it).
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time between two output tokens (inter_token_latency_seconds).",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to end of a request.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled step.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per step.",
                                          TOKEN_BUCKETS)
        self._per_request(histogram, buckets_1_2_5(max_model_len))

    def _per_request(self, histogram, lengths: tuple[int, ...]) -> None:
        """The histograms observed once per finished engine request (``record_request``),
        but ``request_params_n``: once per client request (a request with ``n > 1`` runs as
        ``n`` engine requests; only the first carries its ``n``, see ``SamplingParams.n``)."""
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", lengths)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output tokens of a finished request.", lengths)
        self.request_max_tokens = histogram(
            "request_max_num_generation_tokens", "Output tokens a finished request could have "
            "had at most (its max_tokens).", lengths)
        self.request_n = histogram("request_params_n", "The n of a finished request.",
                                   N_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled step to first token.", REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First token to last token.", REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "First scheduled step to last token.", REQUEST_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "A request's decode time over its tokens after the first.",
                                      TPOT_BUCKETS)

    # -- StatLogger ---------------------------------------------------------------------------

    def record_step(self, step: StepStats) -> None:
        self.iteration_tokens.observe(step.num_tokens)
        for q in step.queue_times_s:
            self.queue_time.observe(q)

    def record_request(self, update: RequestUpdate) -> None:
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
            self.request_success.labels(self.model_name, update.finish_reason).inc()
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

    # -- exposition ---------------------------------------------------------------------------

    def render(self, snapshot: EngineStats) -> bytes:
        """The exposition, with the scheduler's figures taken from ``snapshot`` (a
        ``GetStats`` reply fetched for this scrape)."""
        self._snapshot.snapshot = snapshot
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Gauges and scheduler-owned totals, from the snapshot handed to ``render``; and the
    constant ``cache_config_info``."""

    def __init__(self, model_name: str, prefix: str, cache_info: dict):
        self.model_name = model_name
        self.prefix = prefix
        self.cache_info = {k: str(v) for k, v in cache_info.items()}
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:  # registration calls collect() once to learn the names
            return
        sched, kv = self.snapshot.scheduler, self.snapshot.kv_cache
        yield self._gauge("num_requests_running", "Requests in the running batch.",
                          sched.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                          sched.num_waiting)
        yield self._gauge("num_requests_swapped", "Always 0: preempted requests are recomputed.",
                          0)
        yield self._gauge("kv_cache_usage_perc", "KV cache usage (1 = full).", kv.usage)
        yield self._gauge("gpu_cache_usage_perc", "KV cache usage (1 = full); vLLM's older name "
                          "of kv_cache_usage_perc, whatever the device.", kv.usage)
        yield self._gauge("cpu_cache_usage_perc", "Always 0: no CPU swap space.", 0)
        keys = sorted(self.cache_info)
        info = GaugeMetricFamily(self.prefix + "cache_config_info", "KV cache settings.",
                                 labels=["model_name", *keys])
        info.add_metric([self.model_name, *(self.cache_info[k] for k in keys)], 1)
        yield info
        yield self._counter("num_preemptions", "Preemptions (recompute).",
                            sched.num_preemptions_total)
        yield self._counter("prefix_cache_queries", "Prefix-cache queries, in tokens.",
                            kv.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prefix-cache hits, in tokens.",
                            kv.prefix_cache_hits)
        yield from self._spec_decode(sched.spec_decode)

    def _spec_decode(self, sd: SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's ``spec_decode`` names (drafts, tokens, accepted per position), and the time
        spent drafting and verifying."""
        yield self._counter("spec_decode_num_drafts", "Verify passes of a request with drafts.",
                            sd.num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens scored.",
                            sd.num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            sd.num_accepted_tokens)
        per_pos = CounterMetricFamily(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, per draft position.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(sd.accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos
        yield self._counter("spec_decode_draft_seconds", "Time spent proposing drafts.",
                            sd.draft_seconds)
        yield self._counter("spec_decode_verify_seconds",
                            "Time of the steps that verified drafts.", sd.verify_seconds)

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        g = GaugeMetricFamily(self.prefix + name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c
