"""The cores of one machine share its last-level cache and its memory bus: a step on one core runs
slower while another core runs a prefill step.

Measured on the validation's machine (2 cores, a 58M float32 model streaming 234 MB of weights a
step): in three traces of RAG 1P+1D (bench/README.md, plan8), a decode step's own thread CPU was
0.97-1.02x its price with the prefill node idle and 1.05-1.15x while the prefill node (the other
core) ran a step; `trace.py beside_prefill` reads the factor from traces, `calibrate
--beside-from` writes it into a profile (Overheads.beside_prefill), and CoreMap ties a pinned
machine's cores with it. The trigger is a prefill step (a prefill node's, or a decode node's
local prefill); whatever runs on the other cores meanwhile pays the factor (sim_core.py slow_to).
Nodes on separate hosts (the planner's default: no machine) share nothing, and nothing changes.
"""
from __future__ import annotations


class SharedBus:
    def __init__(self, cores: list, factor: float):
        """cores: the machine's SimCores (each told of this bus); factor: a step's price
        multiplier on a core while another core of the machine runs a prefill step."""
        if factor < 1.0:
            raise ValueError(f"a neighbour's prefill cannot speed a step up: factor {factor}")
        self.cores, self.factor = cores, factor
        for core in cores:
            core.bus = self

    def changed(self) -> None:
        """A core started or ended a prefill step: every core runs slow while another one prefills."""
        prefilling = [core.prefilling > 0 for core in self.cores]
        total = sum(prefilling)
        for core, own in zip(self.cores, prefilling):
            core.slow_to(self.factor if total - own > 0 else 1.0)
