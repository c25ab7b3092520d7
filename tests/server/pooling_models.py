"""Tiny random BERT checkpoints (an embedding model and a cross-encoder) with a real WordPiece
tokenizer, and transformers' pooled hidden states: the oracle of the pooling tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
)

WORDS = ("the a of and to in is it that was for on are with as his they be at one have this "
         "from or had by hot word but what some we can out other were all there when up use "
         "your how said an each she which do their time if will way about many then them "
         "paris capital france city river cat dog sat mat sun rain cold warm blue red").split()


def _tokenizer(path: Path) -> BertTokenizerFast:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", "!", *letters,
             *(f"##{c}" for c in letters), *WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(path)
    return tok


def _config(tok: BertTokenizerFast, **kw) -> BertConfig:
    return BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                      type_vocab_size=2, **kw)


def save_bert(path: Path, seed: int = 7) -> Path:
    tok = _tokenizer(path)
    torch.manual_seed(seed)
    BertModel(_config(tok)).save_pretrained(path)
    return path


def save_cross_encoder(path: Path, seed: int = 11) -> Path:
    tok = _tokenizer(path)
    torch.manual_seed(seed)
    BertForSequenceClassification(_config(tok, num_labels=1)).save_pretrained(path)
    return path


@torch.no_grad()
def hf_embeddings(path: Path, texts: list[str], pooling: str, normalize: bool = True,
                  ids: list[list[int]] | None = None) -> list[torch.Tensor]:
    """transformers' final hidden states of each text alone (float32), pooled (``LAST``,
    ``MEAN`` or ``CLS``) and L2-normalised."""
    from transformers import AutoTokenizer

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for prompt in ids if ids is not None else [tok(t)["input_ids"] for t in texts]:
        h = model(torch.tensor([prompt])).last_hidden_state[0]
        v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
        out.append(F.normalize(v, dim=-1) if normalize else v)
    return out


@torch.no_grad()
def hf_cross_scores(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """A cross-encoder's sigmoid score of each pair alone (sentence-transformers' way)."""
    model = BertForSequenceClassification.from_pretrained(path).eval()
    tok = BertTokenizerFast.from_pretrained(path)
    return [model(**tok(a, b, return_tensors="pt")).logits[0, 0].sigmoid().item()
            for a, b in pairs]
