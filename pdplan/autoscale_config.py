"""The autoscaler's flags (`pdserve up --autoscale ...`): one frozen dataclass, validated; the CLI is
generated from it (engine/flags.py), so every field is a flag with its comment as help."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscaleConfig:
    autoscale: bool = False                 # scale each pool from the router's own windowed figures (pdplan/autoscaler.py)
    autoscale_min_prefill: int = 1          # autoscale: fewest prefill nodes
    autoscale_max_prefill: int = 2          # autoscale: most prefill nodes
    autoscale_min_decode: int = 1           # autoscale: fewest decode nodes
    autoscale_max_decode: int = 2           # autoscale: most decode nodes
    autoscale_slo_ttft_ms: float = 1000.0   # autoscale: the TTFT target (p90 over the window)
    autoscale_slo_itl_ms: float = 100.0     # autoscale: the inter-token latency target (p90 over the window)
    autoscale_interval_s: float = 2.0       # autoscale: time between two decisions
    autoscale_window_s: float = 10.0        # autoscale: the figures cover this much of the recent past
    autoscale_min_samples: int = 8          # autoscale: a TTFT or ITL p90 over fewer requests or tokens in the window is not acted on
    autoscale_up_at: float = 0.8            # autoscale: a pool grows when its latency passes this share of its SLO
    autoscale_down_at: float = 0.3          # autoscale: ... and may shrink below this share (hysteresis)
    autoscale_queued_tokens_up: int = 4096  # autoscale: prefill grows when a node has more prompt tokens booked
    autoscale_kv_up: float = 0.85           # autoscale: decode grows when its mean KV usage passes this
    autoscale_kv_down: float = 0.4          # autoscale: ... and may shrink below this
    autoscale_down_after_s: float = 10.0    # autoscale: a pool shrinks only after this long with every figure low
    autoscale_cooldown_s: float = 5.0       # autoscale: least time between two changes of one pool
    autoscale_drain_deadline_s: float = 30.0  # autoscale: a drained node's requests move after this

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"autoscale_min_{role}"), getattr(self, f"autoscale_max_{role}")
            if not 1 <= lo <= hi:
                raise ValueError(f"autoscale: need 1 <= min <= max {role} nodes, got {lo} and {hi}")
        if self.autoscale_min_samples < 1:
            raise ValueError(f"autoscale: min_samples must be >= 1, got {self.autoscale_min_samples}")
        if not 0 <= self.autoscale_down_at < self.autoscale_up_at:
            raise ValueError("autoscale: need 0 <= down_at < up_at")
        if not 0 <= self.autoscale_kv_down < self.autoscale_kv_up <= 1:
            raise ValueError("autoscale: need 0 <= kv_down < kv_up <= 1")
        if min(self.autoscale_interval_s, self.autoscale_window_s, self.autoscale_slo_ttft_ms,
               self.autoscale_slo_itl_ms) <= 0:
            raise ValueError("autoscale: interval, window and SLOs must be > 0")

    def bounds(self, role: str) -> tuple[int, int]:
        return getattr(self, f"autoscale_min_{role}"), getattr(self, f"autoscale_max_{role}")
