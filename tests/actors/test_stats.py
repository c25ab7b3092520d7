"""StepHistory: the admin view's step list and token rates."""

from __future__ import annotations

from pagedserve.actors.stats import StepHistory, StepStats, Throughput


def step(t: float, prefill: int, decode: int, generated: int) -> StepStats:
    return StepStats(t, prefill // 10 + decode, prefill, decode, generated, 0.004)


def test_rates_cover_the_window_and_fall_to_zero_when_idle():
    h = StepHistory(maxlen=3, window_s=10.0)
    h.append(step(100.0, 40, 0, 1))
    h.append(step(101.0, 0, 4, 4))
    h.append(step(105.0, 20, 2, 3))
    assert h.throughput(now=105.0) == Throughput(window_s=10.0, prompt_tokens_per_s=6.0,
                                                 generation_tokens_per_s=0.8)
    # the first step leaves the window after 10 s, the last one after 15
    assert h.throughput(now=110.5).prompt_tokens_per_s == 2.0
    assert h.throughput(now=110.5).generation_tokens_per_s == 0.7
    idle = h.throughput(now=115.5)
    assert idle.prompt_tokens_per_s == 0 and idle.generation_tokens_per_s == 0
    h.append(step(116.0, 0, 1, 1))
    assert h.throughput(now=116.0).generation_tokens_per_s == 0.1
    # only the last `maxlen` steps are listed
    assert [s.num_prefill_tokens for s in h.recent] == [0, 20, 0]
    assert h.recent[-1] == StepStats(116.0, 1, 0, 1, 1, 0.004)
