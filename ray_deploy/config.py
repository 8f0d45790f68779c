"""How `pdserve ray up` uses the Ray cluster; its flags are generated from the fields."""
from __future__ import annotations

import re
from dataclasses import dataclass

GPU_CHOICES = ("auto", "yes", "no")


@dataclass(frozen=True)
class RayConfig:
    address: str = "auto"           # the Ray cluster: auto (the one `ray start` made on this host), HOST:PORT, or local (a Ray just for this run)
    name: str = "pdserve"           # the deployment's name: its node actors are named NAME:NODE_ID in Ray's "pdserve" namespace
    cpus_per_rank: float = 1.0      # Ray CPUs each tensor-parallel rank of a node holds (its threads follow)
    gpus: str = "auto"              # auto: one GPU per rank when the cluster has GPUs; yes; no (CPU nodes)

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address must be auto, local or HOST:PORT")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,32}", self.name):
            raise ValueError(f"name must be 1-32 characters of [A-Za-z0-9._-], got {self.name!r}")
        if self.cpus_per_rank <= 0:
            raise ValueError(f"cpus_per_rank must be > 0, got {self.cpus_per_rank}")
        if self.gpus not in GPU_CHOICES:
            raise ValueError(f"gpus must be one of {GPU_CHOICES}, got {self.gpus!r}")
