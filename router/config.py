"""Router configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"                 # loopback unless an address is given
    port: int = 8000
    api_key: str | None = None              # when set, /v1/* needs `Authorization: Bearer <api_key>`
    served_model_name: str | None = None    # name clients use; None: the backend's model name
    default_max_tokens: int = 16            # /v1/completions default (OpenAI's); chat defaults to the context
    heartbeat_timeout_s: float = 10.0       # a node silent this long is taken out (> the longest engine step: a 2048-token CPU prefill chunk takes seconds)
    affinity_blocks_per_node: int = 8192    # LRU capacity of block hashes remembered per prefill node
    prefill_load_weight: float = 1.0        # queued blocks vs. prefix-cache hits in the prefill choice
    policy_seed: int = 0                    # seeds the decode node's power-of-two choice
    control_endpoint: str = "tcp://127.0.0.1:0"  # disaggregated: where nodes connect; port 0 = any free
    admission_timeout_s: float = 30.0       # disaggregated: longest wait for a decode reservation
    max_retries: int = 3                    # disaggregated: new attempts of a request after failures
    cluster_secret_file: str | None = None  # disaggregated: the node network's secret (mode 0600); else $PDSERVE_CLUSTER_SECRET, else `pdserve up` makes one

    def __post_init__(self) -> None:
        _require(bool(self.host), "host must be a non-empty string")
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _require(self.api_key is None or bool(self.api_key), "api_key must be None or non-empty")
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
        _require(self.control_endpoint.startswith(("tcp://", "ipc://")),
                 f"control_endpoint must be a tcp:// or ipc:// address, got {self.control_endpoint!r}")
        _require(self.admission_timeout_s > 0,
                 f"admission_timeout_s must be > 0, got {self.admission_timeout_s}")
        _require(self.max_retries >= 0, f"max_retries must be >= 0, got {self.max_retries}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
