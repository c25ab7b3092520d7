"""A small draft model that proposes tokens for the target to verify (speculative decoding's
second proposer, after n-gram lookup; the idea of vLLM's ``vllm/v1/spec_decode/draft_model.py``).

It runs in the model runner, at the start of a step, for the decodes the scheduler gave ``k``
draft slots (``spec_token_ids`` holding placeholders): it catches its own K/V up with the
request's tokens, then decodes ``k`` tokens greedily (argmax, so the proposal is a point mass
and the rejection sampler's ``q = 1`` rule holds), writing them into the slots before the
target's verify pass.

Its K/V lives in its own per-layer tensors in the target's block-table layout: the same
block ids, so the scheduler's allocation (which already covers the drafts' positions) serves
both. Per request it keeps ``computed``, how many leading tokens have valid draft K/V:

* after drafting at positions ``T .. T+k-1`` (``T`` = tokens before the drafts), the draft has
  written K/V up to ``T + k - 2`` (its last draft is never fed back);
* after the verify accepts ``a`` drafts, the tokens at ``T .. T+a-1`` are the drafts it fed,
  so ``computed = T + min(a, k - 1)``: rollback is bookkeeping, the stale slots past it are
  overwritten by the next catch-up;
* when the request's K/V was rebuilt (preemption by recompute, or an admission that reused
  prefix-cache blocks, whose draft K/V may never have been written) it restarts from 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch

from pagedserve.gpu import gguf_load, kv_cache, loader
from pagedserve.gpu.attention import AttentionBackend
from pagedserve.gpu.batch import ScheduledRequest, order_batch
from pagedserve.gpu.config import DraftModelConfig
from pagedserve.gpu.cpu import gemm as cpu_gemm
from pagedserve.gpu.layer_ops import get_layer_ops
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.step_inputs import prepare_inputs

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class DraftTimes:
    """Seconds spent drafting (draft forward passes) since the last ``take``."""

    seconds: float = 0.0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


class DraftModel:
    """The draft model, its K/V tensors and each request's ``computed`` count. Driven by the
    model runner from its one thread."""

    def __init__(self, config: DraftModelConfig):
        self.config = config
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.hf_config = None
        self.block_size = 0
        self.vocab_size = 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.computed: dict[str, int] = {}
        self.times = DraftTimes()

    def load(self, target_path, target_vocab_size: int, backend: AttentionBackend,
             max_model_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Load the draft next to the target (same device, dtype, attention backend), before
        the KV cache is sized: the budget pays for both caches (``bytes_per_block``).

        Raises:
            ValueError: its tokenizer differs from the target's (drafts would be other tokens).
            loader.ModelLoadError: it cannot be found or read.
        """
        resolved = loader.resolve_model(self.config.model)
        check_same_tokenizer(resolved.path, target_path)
        hf_config = loader.load_config(resolved.path)
        ops = get_layer_ops(backend.name, dtype)
        if resolved.gguf_file is not None:  # de-quantized from the file, our way
            model, _ = gguf_load.load_gguf_model(resolved.gguf_file, hf_config, backend,
                                                 max_model_len, ops, device, dtype, None)
        else:
            cls = registry.model_class(hf_config)
            model = cls.build(hf_config, backend, max_model_len, ops, device,
                                           dtype)
            loader.load_weights(model, resolved.path)
        if cpu_gemm.can_pack(dtype, device):
            cpu_gemm.pack_linears(model)
        self.model = model.eval()
        self.hf_config = hf_config
        self.device, self.dtype = device, dtype
        self.vocab_size = min(hf_config.vocab_size, target_vocab_size)
        log.info("draft_model_loaded", model=str(resolved.path),
                 layers=hf_config.num_hidden_layers)

    def bytes_per_block(self, block_size: int) -> int:
        """The draft's K/V bytes per block (what each of the target's blocks costs on top)."""
        return kv_cache.bytes_per_block(self.hf_config, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> int:
        """Its K/V tensors, the target's block count and size. Returns their bytes."""
        self.block_size = block_size
        self.kv_caches = kv_cache.allocate_kv_caches(self.hf_config, num_blocks, block_size,
                                                     self.dtype, self.device)
        return sum(t.nbytes for kv in self.kv_caches for t in kv)

    def forget(self, req_id: str) -> None:
        self.computed.pop(req_id, None)

    def reset_if_rebuilt(self, r: ScheduledRequest) -> None:
        """Call for every scheduled request before its step: a request whose K/V was rebuilt
        (``prefix_token_ids`` set at admission, or fewer tokens computed than the draft
        has) restarts from position 0."""
        rebuilt = r.num_computed_tokens < self.computed.get(r.req_id, 0)
        if rebuilt or r.prefix_token_ids is not None:
            self.computed[r.req_id] = 0

    @torch.inference_mode()
    def propose_step(self, scheduled: list[ScheduledRequest],
                     history: dict[str, list[int]]) -> None:
        """Fill the draft slots (placeholders from the scheduler) of the step's decodes that
        have them; every request's draft K/V is reset if it was rebuilt. ``history``: each
        request's tokens as the runner has seen them (``SamplingState.token_ids``)."""
        drafting = []
        for r in scheduled:
            self.reset_if_rebuilt(r)
            if r.spec_token_ids:
                drafting.append(r)
        if not drafting:
            return
        tokens = {r.req_id: history[r.req_id][: r.num_computed_tokens] + r.token_ids
                  for r in drafting}  # a decode's tokens: the runner has seen all before it
        self.propose(drafting, tokens)

    def propose(self, reqs: list[ScheduledRequest], tokens: dict[str, list[int]]) -> None:
        """Fill each request's ``spec_token_ids`` (placeholders, ``k`` of them) with drafts.

        Args:
            reqs: decodes with draft slots; ``token_ids[0]`` (the last sampled token) sits at
                ``num_computed_tokens``.
            tokens: each request's tokens up to and including that one.
        """
        start = time.perf_counter()
        steps = [ScheduledRequest(
            req_id=r.req_id, token_ids=tokens[r.req_id][self.computed.get(r.req_id, 0):],
            num_computed_tokens=self.computed.get(r.req_id, 0), block_ids=r.block_ids,
            sampling_params=r.sampling_params, sample=True) for r in reqs]
        drafts: dict[str, list[int]] = {r.req_id: [] for r in reqs}
        k_of = {r.req_id: len(r.spec_token_ids) for r in reqs}
        while steps:
            ordered = order_batch(steps)
            logits = self.model(prepare_inputs(ordered, self.block_size, self.device),
                                self.kv_caches)
            picked = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            steps = []
            for s, t in zip(ordered, picked, strict=True):
                drafts[s.req_id].append(t)
                if len(drafts[s.req_id]) < k_of[s.req_id]:  # feed it back for the next
                    steps.append(ScheduledRequest(
                        req_id=s.req_id, token_ids=[t],
                        num_computed_tokens=s.num_computed_tokens + len(s.token_ids),
                        block_ids=s.block_ids, sampling_params=s.sampling_params, sample=True))
        for r in reqs:
            r.spec_token_ids[:] = drafts[r.req_id]
        self.times.seconds += time.perf_counter() - start

    def accepted(self, r: ScheduledRequest, num_accepted: int) -> None:
        """After the verify: the draft K/V that holds accepted tokens stays valid."""
        k = len(r.spec_token_ids)
        self.computed[r.req_id] = r.num_computed_tokens + 1 + min(num_accepted, k - 1)


def check_same_tokenizer(draft_path, target_path) -> None:
    """Raise ``ValueError`` unless both tokenizers map the same strings to the same ids."""
    draft = loader.load_tokenizer(draft_path)
    target = loader.load_tokenizer(target_path)
    if draft.get_vocab() != target.get_vocab():
        raise ValueError(
            f"--speculative-config: the draft model's tokenizer ({draft_path}) differs from the "
            f"target's ({target_path}): drafts must be the target's token ids")
