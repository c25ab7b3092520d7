"""Logits in float32 from a bfloat16 model: the ``lm_head`` of a GGUF model takes float32 rows
(its kernels multiply in float32 or int8 either way), so its output is never rounded to
bfloat16 first, and two tokens whose logits differ by less than a bfloat16 step (a greedy
near tie) are still told apart."""

from __future__ import annotations

import torch

from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.gguf_linear import GGUFLinear
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.step_inputs import prepare_inputs
from tests.gpu.test_tensor_parallel import _steps


def test_a_bfloat16_gguf_model_gives_unrounded_float32_logits(tiny_gguf_path):
    for mode in ("exact", "int8"):
        runner = ModelRunner(ModelConfig(model=str(tiny_gguf_path), dtype="bfloat16",
                                         max_model_len=64, quantization="gguf",
                                         cpu_linear_mode=mode),
                             CacheConfig(num_gpu_blocks_override=8, block_size=8), 64, 4)
        runner.load()
        assert isinstance(runner.model.lm_head, GGUFLinear)
        with torch.inference_mode():
            for step in _steps():
                logits = runner.model(prepare_inputs(step, runner.block_size, runner.device),
                                      runner.kv_caches)
                assert logits.dtype == torch.float32
                # bfloat16 output cast up would equal its own rounding everywhere
                rounded = logits.bfloat16().float()
                assert (logits != rounded).float().mean() > 0.9, mode
