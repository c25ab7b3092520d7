"""The server's own settings: what the HTTP layer serves (``ServingConfig``) and how the process
listens and stops (``ServerConfig``).

Each field with a ``help`` in its metadata is a ``pagedserve serve`` flag; ``engine_args`` builds
the flags from these fields and from the engine's config dataclasses (the metadata keys are
described there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.gpu.config import EMBEDDED_SERVED_NAME
from pagedserve.server.generation_config import GenerationDefaults, parse_override
from pagedserve.server.lora_modules import LoRAModulePath, parse_lora_module
from pagedserve.server.tools.parsers import TOOL_PARSERS

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# The embedded model's name without the org: the OpenAI Agents SDK reads ``a/b`` as
# ``provider/model`` ("UserError: Unknown prefix"), so a slash-free name must be served too.
EMBEDDED_ALIAS = EMBEDDED_SERVED_NAME.rsplit("/", 1)[-1]


def default_served_names(model_name: str) -> tuple[str, ...]:
    """The names served when ``--served-model-name`` is not given: the model's own name, and
    for the embedded model also its slash-free alias."""
    if model_name == EMBEDDED_SERVED_NAME:
        return (model_name, EMBEDDED_ALIAS)
    return (model_name,)


@dataclass(slots=True)
class ServingConfig:
    """What the OpenAI routes serve and who may call them. ``served_model_name``: the names
    clients may send as ``model`` (vLLM's ``nargs='+'``), the first one reported in answers;
    the CLI resolves its default once the model is loaded (``default_served_names``). A single
    string is one name."""

    served_model_name: tuple[str, ...] = field(metadata={
        "help": "names clients may send as `model` (several allowed; answers report the first)",
        "nargs": "+",
        "default_text": f"{EMBEDDED_SERVED_NAME} and {EMBEDDED_ALIAS} for the embedded model, "
                        "else the model as given",
    })
    chat_template: str | None = field(default=None, metadata={
        "help": "Jinja chat template (file path or inline) overriding the tokenizer's",
        "default_text": "the tokenizer's",
    })
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "let the model decide when to call tools (`tool_choice: auto`); on already "
                "unless --disable-tool-parser-detection (then it needs --tool-call-parser)",
    })
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "how tool calls are read from the model's output: the format of its family",
        "choices": tuple(TOOL_PARSERS),
        "default_text": "chosen from the model's chat template",
    })
    disable_tool_parser_detection: bool = field(default=False, metadata={
        "help": "do not choose a tool-call parser from the model: `tool_choice: auto` then "
                "needs --enable-auto-tool-choice and --tool-call-parser, as in vLLM",
    })
    enable_log_requests: bool = field(default=False, metadata={
        "help": "log prompt and output text (never logged otherwise)",
    })
    # The admin routes fall back to the API key when no admin key is set.
    api_key: str | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer <key>` (or `x-api-key: <key>`) on the API "
                "routes (/v1/*, /invocations, "
                "/tokenize, /detokenize, /version, /reset_prefix_cache); probes, pages and "
                "the schema stay open",
        "env": "PAGEDSERVE_API_KEY",
        "default_text": "$PAGEDSERVE_API_KEY, else none",
    })
    enable_server_load_tracking: bool = field(default=False, metadata={
        "help": "count generation requests in flight for GET /load (else it shows 0)",
    })
    metrics_prefix: str = field(default="pagedserve", metadata={
        "help": "prefix of /metrics names (`vllm` serves vLLM's names, `vllm:NAME`, for its "
                "dashboards)",
        "choices": ("pagedserve", "vllm"),
    })
    admin_key: str | None = field(default=None, metadata={
        "help": "bearer key for /admin/stats, /admin/events and /metrics; unset = the API key, "
                "if any, else open",
        "env": "PAGEDSERVE_ADMIN_KEY",
        "default_text": "$PAGEDSERVE_ADMIN_KEY",
    })
    generation_config: str = field(default="auto", metadata={
        "help": "request defaults (temperature, top_p, top_k, min_p, repetition_penalty; "
                "max_new_tokens as max_tokens) for fields a request omits: auto = the "
                "model's generation_config.json (the embedded model: max_new_tokens 512), "
                "vllm = none, or a folder with a generation_config.json (its max_new_tokens "
                "then caps every request)",
    })
    override_generation_config: dict | None = field(default=None, metadata={
        "help": "JSON merged over --generation-config's values, e.g. "
                "'{\"max_new_tokens\": 512}' (a max_new_tokens here caps every request's "
                "max_tokens)",
        "parse": parse_override,
    })
    # Resolved by the CLI from the two flags above and the model's folder.
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    lora_modules: tuple[LoRAModulePath, ...] | None = field(default=None, metadata={
        "help": "LoRA adapters to serve (with --enable-lora), each name=path or "
                '\'{"name": N, "path": P, "base_model_name": M}\'; requests pick one by '
                "`model`",
        "nargs": "+", "parse": parse_lora_module, "default_text": "none",
    })
    max_logprobs: int = field(default=20, metadata={
        "help": "most top logprobs a request may ask per token (`logprobs`, `top_logprobs`, "
                "`prompt_logprobs`; -1 in a request means the whole vocabulary); -1 = no cap",
    })
    enable_prompt_tokens_details: bool = field(default=False, metadata={
        "help": "answer `usage.prompt_tokens_details` (`cached_tokens`: prompt tokens the "
                "prefix cache held); else it is null, as in vLLM",
    })
    max_stored_responses: int = field(default=1000, metadata={
        "help": "responses of /v1/responses kept in memory for previous_response_id (least "
                "recently used dropped first; 0 = none)",
    })

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = (self.served_model_name,)
        self.served_model_name = tuple(self.served_model_name)
        if not self.served_model_name:
            raise ValueError("--served-model-name needs at least one name")

    @property
    def model_name(self) -> str:
        """The name answers report as ``model`` (and metrics label): the first served one."""
        return self.served_model_name[0]


@dataclass(slots=True)
class ServerConfig:
    """Where the process listens, how much it reads, how it stops and what it logs."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    max_request_body_bytes: int = field(default=DEFAULT_MAX_REQUEST_BODY_BYTES, metadata={
        "help": "larger request bodies get 413",
    })
    shutdown_timeout: float = field(default=10.0, metadata={
        "help": "seconds running requests may take to finish after SIGTERM (a second "
                "SIGTERM/SIGINT: none)",
    })
    disable_access_log: bool = field(default=False, metadata={
        "help": "no `access` log line per request (method, path, status, duration, request id)",
        "aliases": ("--disable-uvicorn-access-log",),
    })
    log_level: str = field(default="info", metadata={
        "help": "log level", "choices": ("debug", "info", "warning", "error"),
    })
