"""GrammarLimits: how long, how many at once and how many queued a node compiles structured
outputs' grammars (engine/grammar_jobs.py), how long a compile worker process may take to
start, how long it is kept idle and how large a compiled grammar it may send back
(engine/grammar_worker.py). The one place their defaults are written; imports nothing heavy
(engine/args.py, which the CLIs are generated from, reads them)."""
from __future__ import annotations

from dataclasses import dataclass

COMPILE_TIMEOUT_S = 5.0     # a compile running this long fails its requests; a request queued this long is busy
MAX_COMPILES = 2            # compiles running at once (a worker process each): one slow grammar leaves one free
MAX_QUEUED = 16             # compiles waiting for a thread; past them a new grammar is busy (retryable)
# a compile worker process loading xgrammar and the tokenizer this long is busy (and killed). Above the router's
# admission timeout (30 s) on purpose: a loaded 2-core machine took over 20 s, and the router's timeout abandons
# the request, not the worker start (README.md, structured output)
WORKER_START_TIMEOUT_S = 60.0
MAX_COMPILED_MIB = 64.0     # a compiled grammar's JSON over this is invalid (too large); the parent buffers no more
WORKER_IDLE_TIMEOUT_S = 300.0   # a compile worker process (~270 MiB) that compiled nothing this long ends; the next compile starts one (seconds)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    timeout_s: float = COMPILE_TIMEOUT_S    # see COMPILE_TIMEOUT_S
    max_compiles: int = MAX_COMPILES        # see MAX_COMPILES
    max_queued: int = MAX_QUEUED            # see MAX_QUEUED
    worker_start_timeout_s: float = WORKER_START_TIMEOUT_S     # see WORKER_START_TIMEOUT_S
    max_compiled_mib: float = MAX_COMPILED_MIB     # see MAX_COMPILED_MIB
    worker_idle_timeout_s: float = WORKER_IDLE_TIMEOUT_S   # see WORKER_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name, amount in (("grammar_compile_timeout_s", self.timeout_s),
                             ("grammar_worker_start_timeout_s", self.worker_start_timeout_s),
                             ("grammar_max_compiled_mib", self.max_compiled_mib),
                             ("grammar_worker_idle_timeout_s", self.worker_idle_timeout_s)):
            if not 0 < amount < float("inf"):
                raise ValueError(f"{name} must be > 0 and finite, got {amount!r}")
        for name, value in (("grammar_max_compiles", self.max_compiles), ("grammar_max_queued", self.max_queued)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if "compiles" in name else 0):
                raise ValueError(f"{name} must be an int >= {1 if 'compiles' in name else 0}, got {value!r}")

    @property
    def max_compiled_bytes(self) -> int:
        return int(self.max_compiled_mib * (1 << 20))

    def too_large(self) -> ValueError:
        """A compiled grammar over max_compiled_mib: the grammar's fault (a 400)."""
        return ValueError(f"invalid grammar: compiled, it is over {self.max_compiled_mib} MiB "
                          "(--grammar-max-compiled-mib)")
