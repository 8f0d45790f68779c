"""Router configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

ROUTINGS = ("cost", "affinity")
LOCAL_PREFILL_TOKENS = 64       # the threshold sweep in bench/README.md: all of RAG's gain (its questions are
                                # 4-64 tokens), the fewest chats pulled onto the decode node (mixed workload)
ADMISSION_FIRST_WAIT_S = 0.05   # least wait for room before asking a decode node that looks full again
ADMISSION_MAX_WAIT_S = 1.0      # most wait between two such asks (the timer doubles up to it)
MAX_KV_MOVE_TIMEOUT_S = 60.0    # a remove waits up to 2 x kv_move_timeout_s: `pdserve remove` waits 2 x this
MIN_KEY_CHARS = 16              # the shortest API, admin or metrics key the router accepts (`pdserve secret` prints 64)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"                 # loopback unless an address is given
    port: int = 8000                        # the HTTP port of the OpenAI API, /health and /metrics
    api_key: str | None = None              # when set, /v1/* needs `Authorization: Bearer <api_key>`; else $PDSERVE_API_KEY (a flag is visible in ps)
    served_model_name: str | None = None    # name clients use; None: the backend's model name
    default_max_tokens: int = 16            # /v1/completions default (OpenAI's); chat defaults to the context
    heartbeat_timeout_s: float = 10.0       # a node silent this long is taken out: > the longest engine step (a 2048-token CPU prefill chunk takes seconds), and on a decode node > a KV move's ship (up to 7 s, decode_node/mover.py MAX_LOOP_STALL_S) plus a step
    affinity_blocks_per_node: int = 8192    # LRU capacity of block hashes remembered per prefill node
    prefill_load_weight: float = 1.0        # queued blocks vs. prefix-cache hits in the prefill choice
    policy_seed: int = 0                    # seeds the decode node's power-of-two choice
    routing: str = "cost"                   # disaggregated: cost (decode node by cached overlap and load from the nodes' KV events, short uncached tails prefilled on it) | affinity (prefill node by prefix affinity, decode node by load, every prompt through a prefill node)
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS  # routing cost: a decode node prefills a prompt itself when at most this many of its tokens are not cached there (0: never)
    decode_load_weight: float = 1.0         # routing cost: a decode node's blocks in use vs. the prompt blocks it lacks
    decode_balance_abs: int = 32            # routing cost: when the busiest decode node runs more than this many sequences above the idlest
    decode_balance_rel: float = 1.5         #   and more than this many times as many, the idlest takes the request whatever it caches (sgl-router's guard)
    kv_index_max_blocks: int = 1 << 18      # routing cost: (node, block hash) entries the router's KV index keeps, least recent dropped first
    control_endpoint: str = "tcp://127.0.0.1:0"  # disaggregated: where nodes connect; port 0 = any free
    admission_timeout_s: float = 30.0       # disaggregated: longest wait for a decode reservation
    max_retries: int = 3                    # disaggregated: new attempts of a request after failures (an operator's remove or drain moves use none)
    kv_move_timeout_s: float = 5.0          # disaggregated: a decode node removed or past its drain deadline moves each running request with its KV blocks, waiting this long for its pause and another node's reservation, else re-prefills it (0: always re-prefill)
    cluster_secret_file: str | None = None  # disaggregated: the node network's secret (mode 0600); else $PDSERVE_CLUSTER_SECRET, else `pdserve up` makes one
    max_body_bytes: int = 8 << 20           # HTTP: largest request body (a 400 beyond it)
    max_prompt_chars: int = 1 << 20         # HTTP: characters of all prompts / chat messages, before tokenizing
    max_prompt_token_ids: int = 1 << 18     # HTTP: token ids of all prompts given as ids
    max_stop_strings: int = 16              # HTTP: stop strings per request
    max_stop_chars: int = 256               # HTTP: characters of one stop string
    max_n: int = 128                        # HTTP: completions per prompt
    max_logit_bias: int = 300               # HTTP: logit_bias entries (OpenAI's cap)
    max_grammar_chars: int = 1 << 16        # HTTP: characters of a structured output's schema, regex, choices or grammar
    max_grammar_depth: int = 64             # HTTP: how deep a JSON schema's arrays and objects nest (its compile time grows with the cube; the wire's cap is 128)
    max_logprobs: int = 20                  # HTTP: completions `logprobs` / chat `top_logprobs`
    max_logprob_cells: int = 1 << 20        # HTTP: prompts x n x (logprobs + 1) x tokens scored, per request
    metrics_api_key: str | None = None      # when set, /metrics needs `Authorization: Bearer <metrics_api_key>` (or the admin key); else $PDSERVE_METRICS_KEY; unset: the admin key, else the API key, else open
    tokenizer_workers: int = 2              # HTTP: threads that tokenize and build large responses off the event loop
    max_stream_buffer_bytes: int = 4 << 20  # HTTP: unsent output one request may buffer; beyond it the request ends
    stream_stall_timeout_s: float = 30.0    # HTTP: a client that accepts no data this long is cut and its request aborted
    header_timeout_s: float = 10.0          # HTTP: longest wait for a request's complete headers
    body_timeout_s: float = 30.0            # HTTP: longest wait for a request's complete body
    keep_alive_timeout_s: float = 5.0       # HTTP: idle keep-alive connections close after this
    max_connections: int = 512              # HTTP: open connections; at the limit a new one takes the slot of the one waiting longest for its request's headers or body, else gets a 503
    max_refusals: int = 64                  # HTTP: 503s being sent at once to connections over max_connections; beyond them a connection is closed unanswered
    reserved_fds: int = 128                 # file descriptors HTTP clients never take: node sockets (about one a node), files the router opens
    shutdown_grace_s: float = 30.0          # SIGTERM: open streams get this long, then end with an error event
    trust_chat_control_tokens: bool = False  # chat: parse special tokens typed in messages (trusted clients only)
    admin_api_key: str | None = None        # /admin/* (drain, remove, list nodes) needs `Authorization: Bearer <admin_api_key>`; else $PDSERVE_ADMIN_KEY; unset: /admin/* answers 403

    def __post_init__(self) -> None:
        _require(bool(self.host), "host must be a non-empty string")
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        for name in KEY_VARIABLES:
            _check_key(name, getattr(self, name))
        _require(self.served_model_name is None or bool(self.served_model_name),
                 "served_model_name must be None or non-empty")
        _require(self.default_max_tokens >= 1,
                 f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        _require(self.heartbeat_timeout_s > 0,
                 f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        _require(self.affinity_blocks_per_node >= 1,
                 f"affinity_blocks_per_node must be >= 1, got {self.affinity_blocks_per_node}")
        _require(self.prefill_load_weight >= 0,
                 f"prefill_load_weight must be >= 0, got {self.prefill_load_weight}")
        _require(self.routing in ROUTINGS, f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        _require(self.local_prefill_tokens >= 0 and self.decode_load_weight >= 0 and self.kv_index_max_blocks >= 1,
                 "local_prefill_tokens and decode_load_weight must be >= 0, kv_index_max_blocks >= 1")
        _require(self.decode_balance_abs >= 0 and self.decode_balance_rel >= 1.0,
                 "decode_balance_abs must be >= 0 and decode_balance_rel >= 1")
        _require(self.control_endpoint.startswith(("tcp://", "ipc://")),
                 f"control_endpoint must be a tcp:// or ipc:// address, got {self.control_endpoint!r}")
        _require(self.admission_timeout_s > 0,
                 f"admission_timeout_s must be > 0, got {self.admission_timeout_s}")
        _require(self.max_retries >= 0, f"max_retries must be >= 0, got {self.max_retries}")
        _require(0 <= self.kv_move_timeout_s <= MAX_KV_MOVE_TIMEOUT_S,
                 f"kv_move_timeout_s must be in [0, {MAX_KV_MOVE_TIMEOUT_S:.0f}] (a remove waits twice it, and "
                 f"`pdserve remove` {2 * MAX_KV_MOVE_TIMEOUT_S:.0f} s), got {self.kv_move_timeout_s}")
        _require(self.admin_api_key is None or self.admin_api_key != self.api_key,
                 "admin_api_key must differ from api_key")
        for name in _POSITIVE:
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        _require(self.max_logit_bias >= 0, f"max_logit_bias must be >= 0, got {self.max_logit_bias}")

    def metrics_keys(self) -> tuple[str, ...]:
        """The keys /metrics accepts: the metrics key and the admin key, whichever are set; with
        neither, the API key; with no key at all, none (/metrics is open)."""
        keys = tuple(k for k in (self.metrics_api_key, self.admin_api_key) if k is not None)
        return keys or tuple(k for k in (self.api_key,) if k is not None)


_POSITIVE = ("max_body_bytes", "max_prompt_chars", "max_prompt_token_ids", "max_stop_strings",
             "max_stop_chars", "max_grammar_chars", "max_grammar_depth", "max_n", "max_logprob_cells", "tokenizer_workers", "max_stream_buffer_bytes",
             "stream_stall_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
             "max_connections", "max_refusals", "reserved_fds", "shutdown_grace_s")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_key(name: str, key: str | None) -> None:
    """A key is unset or at least MIN_KEY_CHARS long: a short bearer key can be guessed online."""
    if key is not None and len(key) < MIN_KEY_CHARS:
        raise ValueError(f"the {name.replace('_', ' ')} (--{name.replace('_', '-')} or ${KEY_VARIABLES[name]}) is "
                         f"{len(key)} characters; a key must have at least {MIN_KEY_CHARS} "
                         "(`pdserve secret` prints a fresh 64-character one)")


# Where a router's keys come from when no flag gives them: a flag's value stays in /proc/PID/cmdline,
# which every local user can read (`ps -ef`); a process's environment only its own user and root.
KEY_VARIABLES = {"api_key": "PDSERVE_API_KEY", "admin_api_key": "PDSERVE_ADMIN_KEY",
                 "metrics_api_key": "PDSERVE_METRICS_KEY"}


def keys_from_environment(args: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The parsed flags, with each key no flag gave taken from its variable in KEY_VARIABLES; a
    warning for each key given as a flag."""
    for field in KEY_VARIABLES.keys() & args.keys():
        logging.getLogger(__name__).warning(
            "--%s on the command line is visible to every user of this machine (ps); set $%s instead",
            field.replace("_", "-"), KEY_VARIABLES[field])
    return {**{f: environ[v] for f, v in KEY_VARIABLES.items() if environ.get(v)}, **args}


def without_keys(environ: Mapping[str, str]) -> dict[str, str]:
    """environ less the router's key variables: what a node process (or a Ray runtime the
    router starts) inherits; no node needs the HTTP keys."""
    return {k: v for k, v in environ.items() if k not in KEY_VARIABLES.values()}

