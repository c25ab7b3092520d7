"""``AttentionBackend.forward(..., sliding_window=, logits_soft_cap=)`` on a mixed step
(decodes, a decode with drafts, prefill chunks after cached context; GQA) equals, for every
backend (torch, cpu, Triton), each query attended on its own: a window of ``W`` keys ending at
its position (transformers' rule), scores soft-capped before the softmax (Gemma 2's)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.attention import (
    AttentionMetadata,
    CpuAttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from pagedserve.gpu.batch import BatchLayout
from tests.triton_interpreter import KERNEL_DEVICE as DEVICE

BS, HKV, H, D = 4, 2, 6, 64
SEQ_LENS, Q_LENS = [9, 30, 14, 40, 11], [1, 1, 4, 16, 11]  # 2 decodes, drafts, 2 chunks


def _oracle(q, kc, vc, table, window, cap, scale):
    """Per query: its keys gathered, GQA repeated, masked and capped by hand."""
    out, row = torch.empty_like(q), 0
    for i, (s, n) in enumerate(zip(SEQ_LENS, Q_LENS, strict=True)):
        blocks = table[i, : -(-s // BS)].long()
        k = kc[blocks].flatten(0, 1)[:s].repeat_interleave(H // HKV, 1)  # [s, H, D]
        v = vc[blocks].flatten(0, 1)[:s].repeat_interleave(H // HKV, 1)
        for j in range(n):
            p = s - n + j
            sc = torch.einsum("hd,lhd->hl", q[row], k[: p + 1]) * scale
            if cap is not None:
                sc = cap * torch.tanh(sc / cap)
            if window is not None:
                sc[:, : max(0, p - window + 1)] = float("-inf")
            out[row] = torch.einsum("hl,lhd->hd", sc.softmax(-1), v[: p + 1])
            row += 1
    return out


def _step():
    g = torch.Generator().manual_seed(3)
    max_blocks = max(-(-s // BS) for s in SEQ_LENS)
    table = torch.randperm(len(SEQ_LENS) * max_blocks, generator=g).view(len(SEQ_LENS), -1)
    kc = torch.randn(table.numel(), BS, HKV, D, generator=g)
    vc = torch.randn(table.numel(), BS, HKV, D, generator=g)
    q = torch.randn(sum(Q_LENS), H, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()]).int()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(Q_LENS), dtype=torch.int64),  # no write here
        query_start_loc=qsl, seq_lens=torch.tensor(SEQ_LENS).int(), block_table=table.int(),
        layout=BatchLayout(num_decodes=2, num_spec_decodes=1, num_spec_decode_tokens=4,
                           num_prefills=2, num_prefill_tokens=27),
        max_query_len=16, max_seq_len=40)
    return q, kc, vc, meta


@pytest.mark.parametrize("window,cap", [(None, None), (8, None), (None, 4.0), (8, 4.0),
                                        (1, None), (64, 2.0)])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_mixed_step_matches_each_query_alone(backend, window, cap):
    q, kc, vc, meta = _step()
    want = _oracle(q, kc, vc, meta.block_table, window, cap, 0.125)
    if backend == "triton":
        b, dev = TritonAttentionBackend(torch.device(DEVICE)), DEVICE
    else:
        b, dev = (TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()), "cpu"
    meta.query_start_loc, meta.seq_lens, meta.block_table = (
        t.to(dev) for t in (meta.query_start_loc, meta.seq_lens, meta.block_table))
    got = b.forward(q.to(dev), (kc.to(dev), vc.to(dev)), meta, 0.125, sliding_window=window,
                    logits_soft_cap=cap)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_bad_window_or_cap_is_refused():
    q, kc, vc, meta = _step()
    for kw in ({"sliding_window": 0}, {"logits_soft_cap": 0.0}):
        with pytest.raises(ValueError):
            TorchAttentionBackend().forward(q, (kc, vc), meta, 0.125, **kw)
