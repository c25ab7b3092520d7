"""Our model built straight from a GGUF file: no de-quantized copy, no converted cache.

The model is built on the meta device (nothing allocated), then each module is replaced by
one holding the file's tensors (``gguf_file.open_gguf`` maps the file):

- a quantized linear becomes a ``GGUFLinear`` with one part per GGUF tensor; in the ``exact``
  mode each part is a view of the file's rows (q/k kept in llama.cpp's interleave, undone on
  the output), in ``int8`` the kernel's panels (``gguf_q8_repack``; q/k un-interleaved first,
  consecutive parts of one type stacked into one panel set);
- a mixture of experts' 3-D ``ffn_{gate,up,down}_exps`` become a ``gguf_moe.GGUFFusedMoE``
  whose parts are per-expert views of them (its router, ``ffn_gate_inp``, a linear as above);
- ``token_embd`` stays quantized (``GGUFEmbedding``), and a tied ``lm_head`` multiplies by the
  same tensor;
- a type the mode's kernel does not read is de-quantized for that tensor only (a ``float``
  part), named in one log line: the exact kernel reads every type of ``gguf_ops.GGUF_TYPES``,
  the int8 one those with panels (``GGUF_PACKED_BYTES``); Q2_K, Q3_K, IQ4_NL and IQ4_XS have
  none yet, and the exact kernel's scalar decoder for them is 10-17x slower than a bfloat16
  copy (``loadtest/RESULTS.md``), so ``int8`` / ``auto`` de-quantize them and only ``exact``
  keeps them in place; norms and biases are float.

With no plan (``--quantization none``) every tensor is de-quantized into plain ``nn.Linear`` /
``nn.Embedding`` modules, our way (gguf-py's ``quants.dequantize``, as transformers does).

A pipeline stage (``-pp`` without ``-tp``) builds its model the same way from its layers of the
file: nothing is split inside a tensor, so nothing is copied (a mixture of experts' 3-D tensors
included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from torch import nn
from tqdm import tqdm
from transformers import PretrainedConfig

from pagedserve.gpu import gguf_file as gf
from pagedserve.gpu.cpu.linear_bands import LinearPlan
from pagedserve.gpu.fused_moe import FusedMoE
from pagedserve.gpu.gguf_linear import (
    GGUFEmbedding,
    GGUFLinear,
    LinearPart,
    gguf_parts,
    quantized_part,
    unpermute,
)
from pagedserve.gpu.gguf_moe import GGUFFusedMoE
from pagedserve.gpu.loader import ModelLoadError
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from pagedserve.gpu.parallel.comm import ParallelContext
from pagedserve.gpu.parallel.layers import PPMissingLayer
from pagedserve.kernels import gguf_ops

log = structlog.get_logger(__name__)

@dataclass(slots=True)
class GGUFWeights:
    """What a GGUF load left resident: ``quantized`` bytes (file rows and panels), ``float``
    bytes (norms, biases, de-quantized fallbacks), the file's ``file_tensor_bytes``, and the
    ``dequantized`` tensors ``{name: GGML type name}``."""

    quantized: int = 0
    float: int = 0
    file_tensor_bytes: int = 0
    dequantized: dict[str, str] = field(default_factory=dict)

    def as_log(self) -> dict:
        mib = 2**20
        return {"weights_quantized_mib": round(self.quantized / mib, 1),
                "weights_float_mib": round(self.float / mib, 1),
                "file_tensors_mib": round(self.file_tensor_bytes / mib, 1)}

    def stats(self, kind: str) -> dict:
        """``/admin/stats``' ``weights_resident``: ``kind`` (``gguf_linear.weights_kind``) and
        the bytes."""
        return {"kind": kind, "quantized_bytes": self.quantized, "float_bytes": self.float,
                "file_tensor_bytes": self.file_tensor_bytes,
                "dequantized_tensors": len(self.dequantized),
                "dequantized_types": sorted(set(self.dequantized.values()))}


class _Builder:
    """Makes our modules from one open file for one mode (``plan`` None: all float)."""

    def __init__(self, f: gf.GGUFFile, config: PretrainedConfig, dtype: torch.dtype,
                 plan: LinearPlan | None):
        self.f, self.config, self.dtype, self.plan = f, config, dtype, plan
        self.dequantized: dict[str, str] = {}

    def tensor(self, name: str):
        t = self.f.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.f.path}: tensor {name} is missing from the file")
        return t

    def float_tensor(self, name: str) -> torch.Tensor:
        """De-quantized, q/k un-interleaved (biases too, as transformers does)."""
        t = self.tensor(name)
        values = gf.dequantized(t, self.dtype)
        heads = gf.interleaved_heads(name, self.f.arch, self.config)
        return unpermute(values, heads) if heads else values

    def kept(self, qtype: int) -> bool:
        """Whether the plan's kernel reads ``qtype`` in place (see the module docstring)."""
        if self.plan is None:
            return False
        return qtype in (gguf_ops.GGUF_TYPES if self.plan.path == "exact"
                         else gguf_ops.GGUF_PACKED_BYTES)

    def linear(self, names: list[str], biases: list[str] | None) -> nn.Module:
        ts = [self.tensor(n + ".weight") for n in names]
        k = gf.in_features(ts[0])
        if any(gf.in_features(t) != k for t in ts):
            raise ModelLoadError(f"{self.f.path}: {', '.join(names)} differ in input width")
        bias = None if biases is None else torch.cat([self.float_tensor(b) for b in biases])
        kernel = [self.kept(int(t.tensor_type)) for t in ts]
        if self.plan is None or not any(kernel):
            if self.plan is not None:
                self.dequantized.update({t.name: t.tensor_type.name for t in ts})
            return _float_linear(torch.cat([self.float_tensor(t.name) for t in ts]), bias)
        return GGUFLinear(self._parts(ts, k), k, bias, self.plan)

    def _parts(self, ts: list, k: int) -> list[LinearPart]:
        parts: list[LinearPart] = []
        pending: list[torch.Tensor] = []  # int8: consecutive rows of one type, stacked

        def flush(qtype: int) -> None:
            if pending:
                rows = torch.cat(pending) if len(pending) > 1 else pending[0]
                parts.append(quantized_part(rows, qtype, k, "int8"))
                pending.clear()

        last = None
        for t in ts:
            qtype, heads = int(t.tensor_type), gf.interleaved_heads(t.name, self.f.arch,
                                                                      self.config)
            if not self.kept(qtype):
                flush(last)
                self.dequantized[t.name] = t.tensor_type.name
                parts.append(LinearPart("float", self.float_tensor(t.name), qtype,
                                        gf.out_features(t)))
            elif self.plan.path == "exact":
                parts.append(LinearPart("exact", gf.rows_view(t), qtype, gf.out_features(t),
                                        heads))
            else:
                if qtype != last:
                    flush(last)
                rows = gf.rows_view(t)
                pending.append(unpermute(rows, heads) if heads else rows)
            last = qtype
        flush(last)
        return parts

    def experts(self, i: int, want: FusedMoE) -> nn.Module:
        """Layer ``i``'s experts shaped as ``want`` (the model's): per expert, a part over
        its slice of each 3-D tensor, kept in place where the plan's kernel reads the type,
        de-quantized (that tensor only) where not; all float without a plan."""
        ts = [self.tensor(f"blk.{i}.{s}.weight") for s in gf.MOE_EXPERTS]
        e, h, inter = want.num_experts, want.hidden, want.intermediate
        shapes = [tuple(int(d) for d in t.shape) for t in ts]
        if shapes != [(h, inter, e), (h, inter, e), (inter, h, e)]:
            raise ModelLoadError(f"{self.f.path}: layer {i}'s experts have GGUF shapes "
                                 f"{shapes}; the config says {e} experts of {inter} over {h}")
        if self.plan is None:
            gate, up, down = (gf.dequantized(t, self.dtype) for t in ts)
            with torch.device("meta"):
                module = FusedMoE(e, h, inter, want.ops)
            module.gate_up_proj = nn.Parameter(torch.cat((gate, up), dim=1),
                                               requires_grad=False)
            module.down_proj = nn.Parameter(down, requires_grad=False)
            return module
        return GGUFFusedMoE(*(self._expert_parts(t) for t in ts), h, inter, want.ops)

    def _expert_parts(self, t) -> list[LinearPart]:
        qtype, k, out = int(t.tensor_type), gf.in_features(t), gf.out_features(t)
        if not self.kept(qtype):
            self.dequantized[t.name] = t.tensor_type.name
            values = gf.dequantized(t, self.dtype)  # [E, out, in]
            return [LinearPart("float", w, qtype, out) for w in values]
        rows = gf.expert_rows(t)  # [E, out, row_bytes], a view of the file
        return [quantized_part(r, qtype, k, self.plan.path) for r in rows]

    def embedding_and_head(self, tied: bool) -> tuple[nn.Module, nn.Module]:
        """``token_embd`` and ``lm_head`` (``output``, else the tied ``token_embd``)."""
        emb = self.tensor("token_embd.weight")
        qtype, k = int(emb.tensor_type), gf.in_features(emb)
        tied = tied or "output.weight" not in self.f.tensors
        if self.plan is None or qtype not in gguf_ops.GGUF_TYPES or (
                tied and not self.kept(qtype)):  # a tied head runs the plan's kernel
            if self.plan is not None:
                self.dequantized[emb.name] = emb.tensor_type.name
            embed = nn.Embedding.from_pretrained(self.float_tensor(emb.name), freeze=True)
            head = (_float_linear(embed.weight, None) if tied
                    else self.linear(["output"], None))
            return embed, head
        rows = gf.rows_view(emb)
        head = self.linear(["output"], None) if not tied else None
        part = LinearPart("exact", rows, qtype, rows.shape[0])
        if tied and self.plan.path == "int8":
            part = quantized_part(rows, qtype, k, "int8")  # panels: read back for lookups
        embed = GGUFEmbedding(part, k, self.dtype)
        if tied:  # the same part: one copy of the table
            head = GGUFLinear([part], k, None, self.plan)
        return embed, head


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
        weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _check_shape(name: str, got: nn.Module, want: nn.Module) -> None:
    for attr in ("in_features", "out_features", "embedding_dim", "num_embeddings"):
        if hasattr(want, attr) and getattr(got, attr, None) != getattr(want, attr):
            raise ModelLoadError(f"GGUF tensor for {name}: {attr} {getattr(got, attr, None)}, "
                                 f"the config says {getattr(want, attr)}")


def _norm_weight(b: _Builder, name: str) -> nn.Parameter:
    """A norm's weight; Gemma's with llama.cpp's stored ``+ 1`` taken off (in float32:
    exact for the stored ``1 + w``, so ``GemmaRMSNorm``'s ``1 + w`` gives it back)."""
    shift = gf.NORM_SHIFT.get(b.f.arch)
    if not shift:
        return nn.Parameter(b.float_tensor(name), requires_grad=False)
    weight = gf.dequantized(b.tensor(name), torch.float32) - shift
    return nn.Parameter(weight.to(b.dtype), requires_grad=False)


def load_gguf_model(path: Path, config: PretrainedConfig, backend, max_positions: int, ops,
                    device: torch.device, dtype: torch.dtype, plan: LinearPlan | None,
                    parallel: ParallelContext | None = None,
                    ) -> tuple[LlamaForCausalLM, GGUFWeights]:
    """The model of GGUF file ``path`` (``config`` from its metadata, ``loader``), on
    ``device`` (the CPU when ``plan`` is set: the kernels run there) in ``dtype``; ``plan``:
    the mode the quantized layers are made for, None: every tensor de-quantized.
    ``parallel``: a pipeline stage (tensor-parallel size 1): only its layers, and the
    embedding / final norm / ``lm_head`` where it runs them, are read from the file (views of
    it, as in one process); the others stay ``PPMissingLayer``s.

    Raises:
        ModelLoadError: a tensor is missing or has another shape than the config says.
        ValueError: a tensor gguf-py cannot de-quantize where no kernel reads it.
    """
    f = gf.open_gguf(path)
    if f.arch not in gf.READ_ARCHS:
        raise ModelLoadError(
            f"{path.name}: GGUF architecture '{f.arch}' is not read yet (GGUF: "
            f"{', '.join(gf.READ_ARCHS)}); serve the model's safetensors checkpoint instead")
    if parallel is not None and parallel.layout.tp_size != 1:
        raise ValueError("a GGUF file is read in place by pipeline stages only; tensor-"
                         "parallel ranks read their share (parallel/gguf_ranks.py)")
    with torch.device("meta"):
        model = registry.model_class(config)(config, backend, max_positions, ops, parallel)
    b = _Builder(f, config, dtype, plan)
    qwen_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    layers = model.model.layers
    for i in tqdm(range(len(layers)), desc=f"loading {path.name}", unit="layer", delay=1.0,
                  leave=False):
        layer = layers[i]
        if isinstance(layer, PPMissingLayer):  # another stage's
            continue
        moe = isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)
        if moe:
            layer.mlp.gate = b.linear([f"blk.{i}.{gf.MOE_ROUTER}"], None)
            _check_shape(f"layer {i} router", layer.mlp.gate, nn.Linear(
                config.hidden_size, config.num_experts, device="meta"))
            layer.mlp.experts = b.experts(i, layer.mlp.experts)
        for target, shorts in gf.layer_linears(f.arch, f.tensors, i).items():
            if moe and target.startswith("mlp."):
                continue
            names = [f"blk.{i}.{s}" for s in shorts]
            biases = ([f"{n}.bias" for n in names]
                      if target == "self_attn.qkv_proj" and qwen_bias else None)
            parent_name, leaf = target.split(".")
            parent = getattr(layer, parent_name)
            module = b.linear(names, biases)
            _check_shape(f"layer {i} {target}", module, getattr(parent, leaf))
            setattr(parent, leaf, module)
        for short, attr in gf.layer_norms(f.arch).items():
            getattr(layer, attr).weight = _norm_weight(b, f"blk.{i}.{short}.weight")
        for short, attr in gf.HEAD_NORMS.items():  # Qwen3's q/k norms
            if hasattr(layer.self_attn, attr):
                getattr(layer.self_attn, attr).weight = _norm_weight(
                    b, f"blk.{i}.{short}.weight")
    _load_ends(b, model, config)
    model.model.rotary_emb.init_tables(torch.device("cpu"))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{path}: no tensor in the file for {', '.join(left[:5])}")
    if device.type != "cpu":
        model = model.to(device)
    f.release_pages()
    weights = _weights(model, f, b.dequantized)
    if b.dequantized:
        log.info("gguf_tensors_dequantized", tensors=len(b.dequantized),
                 types=sorted(set(b.dequantized.values())), names=sorted(b.dequantized),
                 reason="no kernel multiplies these types in place")
    return model, weights


def _load_ends(b: _Builder, model: LlamaForCausalLM, config: PretrainedConfig) -> None:
    """``token_embd``, ``lm_head`` and the final norm, those this stage runs (all of them in
    one process; a tied head shares the embedding's part where both are on one stage)."""
    embed, head = b.embedding_and_head(bool(getattr(config, "tie_word_embeddings", False)))
    if not isinstance(model.model.embed_tokens, PPMissingLayer):
        _check_shape("token_embd", embed, model.model.embed_tokens)
        model.model.embed_tokens = embed
    if not isinstance(model.lm_head, PPMissingLayer):
        _check_shape("lm_head", head, model.lm_head)
        model.lm_head = head
    if not isinstance(model.model.norm, PPMissingLayer):
        model.model.norm.weight = _norm_weight(b, "output_norm.weight")


def _weights(model: nn.Module, f: gf.GGUFFile, dequantized: dict[str, str]) -> GGUFWeights:
    seen: set[int] = set()
    quantized = floats = 0
    for part in gguf_parts(model):
        seen.add(part.weight.data_ptr())
        if part.path == "float":
            floats += part.nbytes
        else:
            quantized += part.nbytes
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            floats += t.nbytes
    return GGUFWeights(quantized, floats, f.tensor_bytes, dict(dequantized))
