"""The structured-output manager's settings (``--structured-output-compile-timeout``).

Apart from ``structured_output`` (which needs torch and xgrammar) so that building
``pagedserve serve``'s flags imports neither: ``serve --help`` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StructuredOutputConfig:
    """Attributes:
    compile_timeout_s: longest a request waits for its grammar to compile before a 400 (the
        ``--structured-output-compile-timeout`` flag; its ``help`` metadata makes it one).
    cache_size: compiled grammars kept (LRU).
    num_compile_threads: threads compiling grammars (and xgrammar's threads per compile).
    """

    compile_timeout_s: float = field(default=5.0, metadata={
        "help": "seconds a guided-decoding grammar may take to compile before the request "
                "gets a 400",
        "flag": "--structured-output-compile-timeout",
    })
    cache_size: int = 256
    num_compile_threads: int = 2
