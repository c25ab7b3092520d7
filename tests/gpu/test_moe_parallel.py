"""Tensor parallelism over a mixture of experts: every rank holds every expert, sliced along
``moe_intermediate_size`` (column-parallel gate/up rows, row-parallel down columns), the
router whole; a size that does not divide the experts' width is refused in one line."""

from __future__ import annotations

import pytest
from transformers import Qwen3MoeConfig

from pagedserve.gpu.parallel.layout import check_layout, local_config, rank_layout
from pagedserve.gpu.parallel.weights import shard_plan

CONFIG = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=100)


def test_each_rank_holds_a_slice_of_every_expert():
    lay = rank_layout(CONFIG, 2, 1, 1)
    assert lay.moe_intermediate == (48, 96) and lay.intermediate == (64, 128)
    local = local_config(CONFIG, lay)
    assert (local.moe_intermediate_size, local.intermediate_size, local.num_experts) == (
        48, 64, 8)
    plan = shard_plan(CONFIG, lay)
    e = "model.layers.0.mlp.experts.5"
    assert plan(f"{e}.gate_proj.weight", (96, 64)) == (0, 48, 96, None, False)
    assert plan(f"{e}.up_proj.weight", (96, 64)) == (0, 48, 96, None, False)
    assert plan(f"{e}.down_proj.weight", (64, 96)) == (1, 48, 96, None, False)
    assert plan("model.layers.0.mlp.gate.weight", (8, 64)) == (0, 0, 8, None, False)
    # a dense layer's MLP still splits by intermediate_size
    assert plan("model.layers.1.mlp.gate_proj.weight", (128, 64)) == (0, 64, 128, None, False)


def test_a_size_that_cuts_the_experts_width_is_refused():
    config = Qwen3MoeConfig(**{**CONFIG.to_dict(), "moe_intermediate_size": 98})
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 does not divide the "
                       "experts' intermediate size 98; sizes that work for this model: 1, 2$"):
        check_layout(config, 4, 1)
