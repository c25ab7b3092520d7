"""Model runner: turns a ``SchedulerOutput`` into batch tensors, runs the model, samples.

After vLLM V1's ``vllm/v1/worker/gpu_model_runner.py``: one forward pass per step over the
flattened batch of every scheduled request (prefill chunks and decodes together).
"""

from __future__ import annotations

import time

import structlog
import torch
from transformers import PretrainedConfig

from pagedserve.gpu import gguf_linear, gguf_load, kv_cache, loader
from pagedserve.gpu.attention import AttentionBackend
from pagedserve.gpu.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, order_batch
from pagedserve.gpu.config import CacheConfig, DraftModelConfig, ModelConfig
from pagedserve.gpu.cpu import memory
from pagedserve.gpu.cpu.thread_governor import ThreadGovernor
from pagedserve.gpu.cuda_graph import CudaGraphRunner
from pagedserve.gpu.dtype_choice import (
    keeps_gguf_in_place,
    pick_dtype,
)
from pagedserve.gpu.kv_connector import worker_step
from pagedserve.gpu.lora.manager import LoRAManager, lora_kernel
from pagedserve.gpu.model_builder import build_model, eos_token_ids
from pagedserve.gpu.model_info import ModelInfo
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.adapters import CausalLMForEmbedding
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.parallel import weights as parallel_weights
from pagedserve.gpu.parallel.comm import ParallelContext
from pagedserve.gpu.pooling.pooling_runner import PoolingRunner
from pagedserve.gpu.prev_sampled import PrevSampled
from pagedserve.gpu.sample import prompt_logprobs
from pagedserve.gpu.sample.grammar_bitmask import apply_grammar_bitmask
from pagedserve.gpu.sample.request_state import SamplingState
from pagedserve.gpu.sample.sampler import SampleRow, sample
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.gpu.spec_decode.draft_model import DraftModel
from pagedserve.gpu.spec_decode.rejection_sampler import verify_drafts
from pagedserve.gpu.step_inputs import prepare_inputs

log = structlog.get_logger(__name__)


class ModelRunner:
    """Owns the model, its KV cache tensors and the per-request RNGs. Not thread-safe: the
    executor actor calls it from its one worker thread.

    ``load`` builds it in steps: pick the device and dtype, build the model
    (``_build_model``), size and allocate the KV cache (``_size_kv_cache``), capture the decode
    graphs (``_capture_cuda_graphs``, CUDA only). Until then the fields it sets are empty.
    """

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig,
        max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
        draft: DraftModelConfig | None = None, parallel: ParallelContext | None = None,
    ):
        """``max_num_batched_tokens``/``max_num_seqs``: the scheduler's limits, i.e. the largest
        step, which the CUDA path profiles (KV sizing) and captures (decode graphs).
        ``draft``: a draft model for speculative decoding (``gpu/spec_decode/draft_model.py``);
        ``parallel``: this rank's share of a tensor/pipeline-parallel model (``gpu/worker.py``)."""
        self.parallel = parallel
        self.model_config = model_config
        self.cache_config = cache_config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.block_size = cache_config.block_size
        # load(): where, and in which dtype.
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv_dtype = torch.float32  # the K/V cache tensors' (--kv-cache-dtype)
        # _build_model()
        self.hf_config: PretrainedConfig | None = None
        self.max_model_len = 0
        self.attn_backend: AttentionBackend | None = None
        self.model: LlamaForCausalLM | None = None
        self.quantization: str | None = None  # "gguf": the file's quantized blocks are kept
        self.gguf_weights: gguf_load.GGUFWeights | None = None  # read from a GGUF in place
        self.eos_token_ids: list[int] = []
        # _size_kv_cache()
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer
        # _capture_cuda_graphs()
        self.cuda_graphs: CudaGraphRunner | None = None
        # Per live request: its seeded RNG and every token computed so far (penalties read
        # them), its last sampled token (the input of a step built ahead: --async-scheduling).
        self.sampling = SamplingState()
        self.prev_sampled = PrevSampled()
        self.draft = DraftModel(draft) if draft is not None else None
        self.kv_connector: worker_step.ConnectorStep | None = None  # load(), when configured
        self.lora: LoRAManager | None = None  # _build_model(), with --enable-lora
        self.pooling: PoolingRunner | None = None  # --runner pooling: steps pool, never sample

    def load(self) -> ModelInfo:
        """Resolve, load and size everything. Raises ``loader.ModelLoadError``, ``ValueError``."""
        start = time.perf_counter()
        mc = self.model_config
        self.device = torch.device(mc.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device here "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
        resolved = loader.resolve_model(mc.model)
        # A float draft model runs torch's matmuls: those want float32 where bfloat16 is
        # emulated, so only a draft-free GGUF in place turns --dtype auto to bfloat16.
        in_place = self.draft is None and keeps_gguf_in_place(
            self._quantization_flag(), resolved, self.device)
        self.dtype = pick_dtype(mc.dtype, self.device, in_place)
        self.kv_dtype = kv_cache.cache_dtype(self.cache_config.kv_cache_dtype, self.dtype)
        self.sampling.device = self.device
        self.threads = ThreadGovernor.start() if self.device.type == "cpu" else None
        torch.manual_seed(mc.seed)
        model_bytes = self._build_model(resolved)
        if self.draft is not None:  # loaded first: the KV budget pays for its cache too
            self.draft.load(resolved.path, self.hf_config.vocab_size, self.attn_backend,
                            self.max_model_len, self.device, self.dtype)
        self._size_kv_cache(model_bytes)
        self.kv_connector = worker_step.build_worker_connector(
            self.cache_config.kv_transfer_config, self.kv_caches, self.parallel)
        if self.device.type == "cpu":
            self._log_memory()
        # LoRA steps map rows to adapters per step: eager (graphs capture no mapping).
        if (self.device.type == "cuda" and not mc.enforce_eager and self.pooling is None
                and self.lora is None):
            self._capture_cuda_graphs()
        log.info("attention_backend", name=self.attn_backend.name,
                 cuda_graphs=self.cuda_graphs is not None)
        return self._model_info(resolved, time.perf_counter() - start)

    def _quantization_flag(self) -> str | None:
        """``--quantization`` for this layout: across ranks the blocks are kept only when
        asked for (unset: de-quantized, as before)."""
        q = self.model_config.quantization
        return q if self.parallel is None else q or "none"

    def _build_model(self, resolved: loader.ResolvedModel) -> int:
        """The model with its weights (``gpu/model_builder.py``), its LoRA adapters'
        layers around the final linears (packed, quantized or a shard) with
        ``--enable-lora``, and its pooling head with ``--runner pooling``. Returns the bytes
        the weights take."""
        mc = self.model_config
        built = build_model(resolved, mc, self.cache_config, self.parallel, self.device,
                            self.dtype, self.kv_dtype, self._quantization_flag())
        self.hf_config, self.max_model_len = built.hf_config, built.max_model_len
        self.attn_backend, self.quantization = built.attn_backend, built.quantization
        self.gguf_weights = built.gguf_weights
        model = built.model
        if mc.lora is not None:
            layout = None if self.parallel is None else self.parallel.layout
            shard = None if layout is None else parallel_weights.shard_plan(self.hf_config,
                                                                            layout)
            self.lora = LoRAManager(model, mc.lora, self.hf_config, self.dtype, self.device,
                                    shard, lora_kernel(self.device, self.dtype, mc.lora))
        self.model = model.eval()
        self.eos_token_ids = eos_token_ids(resolved.path, self.hf_config)
        self.sampling.eos_token_ids = self.eos_token_ids
        if built.runner == "pooling":
            self._build_pooling(resolved)
        return built.model_bytes

    def _build_pooling(self, resolved: loader.ResolvedModel) -> None:
        """``--runner pooling``: the model's final hidden states go to a pooler (a decoder
        through its embedding adapter, an encoder as it is)."""
        if self.draft is not None:
            raise ValueError("--speculative-config does not apply to a pooling model")
        model = (self.model if hasattr(self.model, "hidden_states")
                 else CausalLMForEmbedding(self.model))
        self.pooling = PoolingRunner(model, self.hf_config, self.model_config.pooler_config,
                                     resolved.path, self.block_size, self.device)

    def _log_memory(self) -> None:
        """What the resident memory is made of, once loading has let go of what it freed."""
        memory.release_freed_memory()
        fields = memory.resident_breakdown(self.model, self.kv_caches).as_log()
        if self.gguf_weights is not None:
            fields |= self.gguf_weights.as_log()
        log.info("memory", **fields, weights=gguf_linear.weights_kind(self.model, self.dtype),
                 kv="pages resident as blocks are first written")

    def weights_resident(self) -> dict | None:
        """``/admin/stats``' account of the weights (``gguf_load.GGUFWeights.stats``), None for
        a model not read from a GGUF file."""
        if self.gguf_weights is None:
            return None
        return self.gguf_weights.stats(gguf_linear.weights_kind(self.model, self.dtype))

    def _size_kv_cache(self, model_bytes: int) -> None:
        """As many blocks as the budget holds (on CUDA, after profiling the largest step), then
        the per-layer K/V tensors."""
        cc = self.cache_config
        if self.pooling is not None and not self.pooling.info.needs_kv_cache:
            self.num_blocks = self.pooling.num_virtual_blocks(  # an encoder: no K/V tensors
                self.max_model_len, self.max_num_batched_tokens, self.max_num_seqs)
            return
        activation_bytes = None
        if self.device.type == "cuda" and kv_cache.needs_profiling(cc):
            activation_bytes = self._profile_activation_bytes()
        draft_per_block = self.draft.bytes_per_block(self.block_size) if self.draft else 0
        kv_config = self.model.kv_config  # this rank's KV heads and layers
        self.num_blocks = kv_cache.num_blocks_for(
            kv_config, cc, self.kv_dtype, self.device, model_bytes, activation_bytes,
            draft_per_block,
        )
        self.kv_caches = kv_cache.allocate_kv_caches(
            kv_config, self.num_blocks, self.block_size, self.kv_dtype, self.device
        )
        if self.draft is not None:  # the same block ids, its own tensors
            self.draft.allocate(self.num_blocks, self.block_size)

    def _model_info(self, resolved: loader.ResolvedModel, load_seconds: float) -> ModelInfo:
        return ModelInfo(
            served_name=resolved.default_served_name,
            path=str(resolved.path),
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            eos_token_ids=self.eos_token_ids,
            load_seconds=load_seconds,
            vocab_size=self.hf_config.vocab_size,
            attention_backend=self.attn_backend.name,
            quantization=self.quantization or "none",
            cpu_linear_paths=gguf_linear.linear_paths(self.model),
            weights_resident=self.weights_resident(),
            source=str(resolved.gguf_file or resolved.path),
            kv_cache_bytes=sum(t.nbytes for kv in self.kv_caches for t in kv)
            + sum(t.nbytes for kv in (self.draft.kv_caches if self.draft else []) for t in kv),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            runner="generate" if self.pooling is None else "pooling",
            pooling=None if self.pooling is None else self.pooling.info,
            kv_sliding_window=self.kv_sliding_window(),
        )

    def kv_sliding_window(self) -> int | None:
        """The window in tokens past which the scheduler may release a request's blocks: the
        model's when every layer has one (``registry.kv_sliding_window``), unless a draft
        model (its own layers read the same block ids in full) or a KV connector (it saves
        and loads whole block lists) is on: then the windows only mask."""
        if self.draft is not None or self.cache_config.kv_transfer_config is not None:
            return None
        return registry.kv_sliding_window(self.hf_config)

    def _dummy_requests(self, num_tokens: int, num_seqs: int) -> list[ScheduledRequest]:
        """``num_seqs`` prompts sharing ``num_tokens`` tokens, on consecutive blocks from 0, in
        batch order (one-token prompts are decodes, and come first)."""
        reqs, next_block = [], 0
        for i in range(num_seqs):
            n = num_tokens // num_seqs + (i < num_tokens % num_seqs)
            nb = -(-n // self.block_size)
            reqs.append(ScheduledRequest(
                req_id=f"profile-{i}", token_ids=[0] * n, num_computed_tokens=0,
                block_ids=list(range(next_block, next_block + nb)),
                sampling_params=SamplingParams(temperature=0.0), sample=True,
            ))
            next_block += nb
        return order_batch(reqs)

    @torch.inference_mode()
    def _profile_activation_bytes(self) -> int:
        """Peak memory of the largest step beyond what is allocated (CUDA): one forward pass of
        ``max_num_batched_tokens`` tokens over ``max_num_seqs`` prompts, sampled, with a scratch
        KV cache just big enough for it (vLLM's ``profile_run``)."""
        num_tokens = min(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        num_seqs = max(1, min(self.max_num_seqs, num_tokens))
        reqs = self._dummy_requests(num_tokens, num_seqs)
        scratch = kv_cache.allocate_kv_caches(
            self.hf_config, max(b for r in reqs for b in r.block_ids) + 1, self.block_size,
            self.kv_dtype, self.device,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        if self.pooling is not None:  # prefill only: the forward and the pooler
            logits = self.pooling.execute(reqs, scratch)
        else:
            logits = self.model(prepare_inputs(reqs, self.block_size, self.device), scratch)
            sample(logits, [SampleRow(r.sampling_params, None, [], [], []) for r in reqs])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, logits
        torch.cuda.empty_cache()
        log.info("profiled_step", num_tokens=num_tokens, num_seqs=num_seqs,
                 activation_mib=round(peak / 2**20, 1))
        return peak

    def _capture_cuda_graphs(self) -> None:
        """Decode graphs (``gpu/cuda_graph.py``); under parallelism every rank calls this at
        load, together, and captures the same batch sizes in the same order."""
        if self.attn_backend.name != "triton":
            log.warning("cuda_graphs_off", reason="only the triton attention backend is captured")
            return
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        start = time.perf_counter()
        self.cuda_graphs = CudaGraphRunner(
            self.model, self.kv_caches, self.max_num_seqs, max_blocks_per_seq, self.block_size,
            self.device,
        )
        log.info("cuda_graphs_ready", seconds=round(time.perf_counter() - start, 2),
                 rank=None if self.parallel is None else self.parallel.layout.rank)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step; with a KV connector, between its loads and saves (``worker_step``)."""
        if self.kv_connector is None:
            return self._execute_model(scheduler_output)
        return self.kv_connector.run(scheduler_output, self._execute_model)

    def _forget(self, req_ids: set[str]) -> None:
        """The requests that ended since the last step: drop what was kept for them."""
        for req_id in req_ids:
            self.sampling.forget(req_id)
            self.prev_sampled.forget(req_id)
            if self.draft is not None:
                self.draft.forget(req_id)
            if self.pooling is not None:
                self.pooling.forget(req_id)

    def _forward(self, reqs: list[ScheduledRequest], wants_prompt_lps: bool) -> torch.Tensor:
        """The step's logits: a captured decode graph's when one fits, else an eager pass.
        Prompt logprobs take extra logits rows, which a captured graph does not compute.
        Replay or not is decided from the step alone: under parallelism every rank gets the
        same step, so all replay (and meet in the graphs' collectives) or all run eagerly."""
        if (self.cuda_graphs is not None and not wants_prompt_lps
                and self.cuda_graphs.can_run(reqs)):
            return self.cuda_graphs.run(reqs)
        if self.cuda_graphs is not None:
            self.cuda_graphs.batch.invalidate()
        if self.lora is not None:
            self.lora.set_step(reqs)
        return self.model(prepare_inputs(reqs, self.block_size, self.device), self.kv_caches)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass and sampling for every scheduled request."""
        self._forget(scheduler_output.finished_req_ids)
        # Beams' copy-on-write (the draft's KV shares the block ids).
        kv_cache.copy_blocks(self.kv_caches, scheduler_output.blocks_to_copy)
        if self.draft is not None and self.draft.kv_caches:
            kv_cache.copy_blocks(self.draft.kv_caches, scheduler_output.blocks_to_copy)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput({})
        if self.threads is not None:  # fewer CPU threads while another process holds a core
            self.threads.tick()
        if self.pooling is not None:
            return self.pooling.execute(scheduler_output.scheduled, self.kv_caches)
        if self.draft is not None:
            self.draft.propose_step(scheduler_output.scheduled, self.sampling.token_ids)
        verify_start = time.perf_counter()
        self.prev_sampled.fill(scheduler_output.scheduled)
        self.sampling.record(scheduler_output.scheduled)
        reqs = order_batch(scheduler_output.scheduled)
        wants_prompt_lps = any(r.prompt_logprobs is not None for r in reqs)
        logits = self._forward(reqs, wants_prompt_lps)
        sampled_reqs = [r for r in reqs if r.sample]
        prompt_lps: dict[str, prompt_logprobs.PromptLogprobsChunk] = {}
        if wants_prompt_lps and logits is not None:
            num_rows = sum(len(r.spec_token_ids) + 1 for r in sampled_reqs)
            logits, prompt_lps = prompt_logprobs.split_logits(logits, reqs, num_rows)
        if not sampled_reqs or logits is None:  # None: another rank samples
            return ModelRunnerOutput({}, prompt_logprobs=prompt_lps)
        if scheduler_output.grammar_bitmask is not None:
            self._apply_grammar(logits, scheduler_output, sampled_reqs)
        if any(r.spec_token_ids for r in sampled_reqs):
            runner_output = verify_drafts(logits, sampled_reqs, self.sampling.row, self.draft)
            runner_output.prompt_logprobs = prompt_lps
            runner_output.verify_seconds = time.perf_counter() - verify_start
            if self.draft is not None:
                runner_output.draft_seconds = self.draft.times.take()
            return runner_output
        sampled = sample(logits, [self.sampling.row(r) for r in sampled_reqs])
        return self.prev_sampled.record(ModelRunnerOutput(
            {r.req_id: [t] for r, t in zip(sampled_reqs, sampled.token_ids)},
            {r.req_id: [lp] for r, lp in zip(sampled_reqs, sampled.logprobs) if lp is not None},
            prompt_lps,
        ))

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, scheduler_output: SchedulerOutput,
                       reqs: list[ScheduledRequest]) -> None:
        """Mask each guided row with its bitmask row: one logits row per request, k + 1 with
        drafts, and a guided request with drafts has k + 1 consecutive bitmask rows from its
        ``structured_output_request_ids`` entry (the grammar's state after each draft)."""
        first = scheduler_output.structured_output_request_ids
        keys = [(r.req_id, j) for r in reqs for j in range(len(r.spec_token_ids) + 1)]
        rows = {f"{rid}/{j}": first[rid] + j for rid, j in keys if rid in first}
        apply_grammar_bitmask(logits, scheduler_output.grammar_bitmask, rows,
                              [f"{rid}/{j}" for rid, j in keys])
