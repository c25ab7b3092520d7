"""Per-request sampling parameters (vLLM's ``vllm/sampling_params.py``, trimmed)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: per-request seed; the same seed and prompt give the same output.
        max_tokens: output tokens at most; ``None`` means up to ``max_model_len``.
        stop: strings that end the output (excluded from it), matched across token boundaries.
        stop_token_ids: token ids that end the output besides EOS.
        ignore_eos: keep generating past EOS (benchmarks).
        skip_special_tokens: leave special tokens out of the text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
