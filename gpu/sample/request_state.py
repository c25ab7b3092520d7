"""What sampling reads of each live request beyond its logits: its seeded RNG and every token
computed so far (the penalties, ``min_tokens`` and the draft model read them), kept by the
model runner across steps and forgotten when the scheduler says the request ended."""

from __future__ import annotations

import torch

from pagedserve.gpu.batch import ScheduledRequest
from pagedserve.gpu.sample.sampler import SampleRow


class SamplingState:
    """Per live request: its ``torch.Generator`` (seeded, non-greedy requests only) and its
    token history. ``eos_token_ids``: the model's, stop ids unless ``ignore_eos``."""

    __slots__ = ("device", "eos_token_ids", "generators", "token_ids")

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # the runner's, once loaded
        self.eos_token_ids: list[int] = []
        self.generators: dict[str, torch.Generator] = {}
        self.token_ids: dict[str, list[int]] = {}

    def forget(self, req_id: str) -> None:
        self.generators.pop(req_id, None)
        self.token_ids.pop(req_id, None)

    def record(self, scheduled: list[ScheduledRequest]) -> None:
        """Each request's history after this step's tokens (and drafts) go in."""
        for r in scheduled:
            known = self.token_ids.setdefault(r.req_id, [])
            if r.prefix_token_ids is not None:
                known[:] = r.prefix_token_ids
            # Recompute after preemption rewrites the tail, as does the step after drafts.
            del known[r.num_computed_tokens :]
            known.extend(r.token_ids)
            known.extend(r.spec_token_ids)

    def generator(self, r: ScheduledRequest) -> torch.Generator | None:
        seed = r.sampling_params.seed
        if seed is None or r.sampling_params.greedy:
            return None
        if (gen := self.generators.get(r.req_id)) is None:
            gen = self.generators[r.req_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def row(self, r: ScheduledRequest, num_drafts: int = 0) -> SampleRow:
        """The sampling row after ``r``'s tokens and its first ``num_drafts`` drafts."""
        p = r.sampling_params
        # Slicing the history costs a copy per step: only for rows that read it.
        tokens = self.token_ids[r.req_id] if p.needs_history or p.min_tokens else []
        end = len(tokens) - len(r.spec_token_ids) + num_drafts
        return SampleRow(
            params=p, generator=self.generator(r),
            prompt_ids=tokens[: r.num_prompt_tokens],
            output_ids=tokens[r.num_prompt_tokens : end],
            stop_ids=[*self.eos_token_ids, *p.stop_token_ids] if not p.ignore_eos
            else list(p.stop_token_ids),
        )
