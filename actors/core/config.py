"""Scheduler settings, named as vLLM's flags.

A field whose metadata has ``help`` is also a ``pagedserve serve`` flag (``server/engine_args.py``
builds the flags from these fields), so its default lives only here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.actors.spec_decode.config import SpeculativeConfig, parse_speculative_config


@dataclass(slots=True)
class SchedulerConfig:
    """How many requests run, how much one step computes, who goes first."""

    max_num_seqs: int = field(default=256, metadata={"help": "running requests at most"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "tokens computed in one step at most (prefill chunks + decodes; chunked "
                "prefill splits longer prompts)",
    })
    policy: str = field(default="fcfs", metadata={
        "help": "fcfs, or priority (request field `priority`, lower runs earlier)",
        "flag": "--scheduling-policy", "choices": ("fcfs", "priority"),
    })
    max_waiting_requests: int | None = field(default=None, metadata={
        "help": "refuse new requests with 503 while this many wait", "default_text": "no limit",
    })
    async_scheduling: bool = field(default=False, metadata={
        "help": "build the next step while the model runs this one (each decoding request "
                "assumed to get one token); with -pp N, N batches in flight; not with "
                "--speculative-config or -tp alone",
    })
    # Not a flag: off for an encoder (``--runner pooling`` on BERT), whose bidirectional
    # attention needs each prompt whole in one step (vLLM turns it off for those too).
    enable_chunked_prefill: bool = True
    speculative: SpeculativeConfig | None = field(default=None, metadata={
        "help": 'speculative decoding as JSON: n-gram drafts, e.g. \'{"method": "ngram", '
                '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
                '"disable_by_batch_size": 8}\', or a draft model with the same tokenizer, '
                '\'{"method": "draft_model", "model": PATH_OR_ID, "num_speculative_tokens": 3}\'',
        "flag": "--speculative-config", "parse": parse_speculative_config,
        "default_text": "off",
    })
    # --max-loras when --enable-lora (set from the LoRA flags, ``server/engine_args.py``):
    # distinct adapters among the running requests at most; 0 without LoRA.
    max_loras: int = 0
