"""Seeded request workloads for ``bench_serving.py``: loadgen (the llama.cpp comparison),
random, shared-prefix and ShareGPT-style files."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

# The llama.cpp comparison workload's vocabulary and tasks (fixed: they define the workload).
WORDS = (
    "the of and to in is that it was for on are as with his they at be this "
    "from have or by one had not but what all were when we there can an your "
    "which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because "
    "does part even place well such here take why things help put years different "
    "away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us "
    "left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want "
    "school important until form food keep children feet land side without boy "
    "once animals life enough took sometimes four head above kind began almost "
    "live page got earth need far hand high year mother light parts country father "
    "let night following picture being study second eyes soon times story boys "
    "since white days ever paper hard near sentence better best across during today "
    "others however sure means knew try told young miles sun ways thing whole hear "
    "example heard several change answer room sea against top turned learn point "
    "city play toward five using himself usually river garden morning winter bread "
    "mountain window music village table letter machine quiet simple question"
).split()
TASKS = (
    "Summarize the following text.",
    "Continue the story below.",
    "Rewrite the following passage in simpler words.",
    "List the main ideas in this text.",
    "Explain what the following paragraph is about.",
    "Write a short reply to this message.",
)


@dataclass(slots=True)
class BenchRequest:
    messages: list[dict]
    max_tokens: int


def _text(rng: random.Random, n_words: int) -> str:
    """``n_words`` words in sentences of 6-16 words, each capitalised and ending in a dot."""
    words: list[str] = []
    in_sentence, target = 0, rng.randint(6, 16)
    for _ in range(n_words):
        w = rng.choice(WORDS)
        words.append(w.capitalize() if in_sentence == 0 else w)
        in_sentence += 1
        if in_sentence >= target:
            words[-1] += "."
            in_sentence, target = 0, rng.randint(6, 16)
    if words and not words[-1].endswith("."):
        words[-1] += "."
    return " ".join(words)


def loadgen_workload(n: int, seed: int) -> list[BenchRequest]:
    """Request ``i`` is the same for any ``n > i``: a coin picks a short (20-80 words) or long
    (150-400) prompt, then a task, the text, and max_tokens uniform in 32-256."""
    rng = random.Random(f"workload:{seed}")
    out = []
    for _ in range(n):
        n_words = rng.randint(20, 80) if rng.random() < 0.5 else rng.randint(150, 400)
        task = rng.choice(TASKS)
        text = _text(rng, n_words)
        max_tokens = rng.randint(32, 256)
        out.append(BenchRequest([{"role": "user", "content": f"{task}\n\n{text}"}], max_tokens))
    return out


def _range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def random_workload(n: int, seed: int, input_len: str, output_len: str,
                    prefix_words: int = 0) -> list[BenchRequest]:
    rng = random.Random(f"random:{seed}")
    system = []
    if prefix_words:
        prefix_rng = random.Random(f"prefix:{seed}")
        system = [{"role": "system", "content": "You are a helpful assistant. Background notes "
                   "follow. " + _text(prefix_rng, prefix_words)}]
    (in_lo, in_hi), (out_lo, out_hi) = _range(input_len), _range(output_len)
    out = []
    for _ in range(n):
        user = {"role": "user", "content": _text(rng, rng.randint(in_lo, in_hi))}
        out.append(BenchRequest(system + [user], rng.randint(out_lo, out_hi)))
    return out


def sharegpt_workload(path: str, n: int, seed: int, output_len: str) -> list[BenchRequest]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    prompts = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        first = next((t for t in turns if t.get("from") in ("human", "user")), None)
        if first and first.get("value"):
            prompts.append(first["value"])
    rng = random.Random(f"sharegpt:{seed}")
    rng.shuffle(prompts)
    lo, hi = _range(output_len)
    return [BenchRequest([{"role": "user", "content": p}], rng.randint(lo, hi))
            for p in prompts[:n]]


def build_workload(args, n: int) -> list[BenchRequest]:
    if args.dataset == "loadgen":
        return loadgen_workload(n, args.seed)
    if args.dataset == "random":
        return random_workload(n, args.seed, args.input_len, args.output_len)
    if args.dataset == "shared-prefix":
        return random_workload(n, args.seed, args.input_len, args.output_len, args.prefix_words)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            sys.exit("bench_serving: --dataset sharegpt needs --dataset-path FILE.json")
        return sharegpt_workload(args.dataset_path, n, args.seed, args.output_len)
    sys.exit(f"bench_serving: unknown dataset {args.dataset!r}")
