"""pdserve's engine: what prefill and decode nodes share (configs, block manager, model,
sampler, scheduler) and the colocated offline API."""
import os

# Idle OpenMP threads sleep instead of spinning. A serving box runs several busy processes
# (router, prefill and decode nodes): spinning threads then fight for the cores, and measured
# here a decode step went from 155 ms to 1,970 ms. Takes effect only if torch is not loaded yet.
# To choose otherwise set OMP_WAIT_POLICY, or GOMP_SPINCOUNT with OMP_WAIT_POLICY=ACTIVE: a
# bounded spin (10000) made a lone process's decode step 33 -> 27 ms here, but 48 -> 89 ms
# when another busy process shared the 2 cores (bench/README.md, "OpenMP waiting").
if "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pdwire.outputs import CompletionOutput, EngineMetrics, RequestOutput  # noqa: E402
from pdwire.sampling_params import SamplingParams  # noqa: E402

# The heavy names (torch, the model) load on first use, so `import engine.x` stays light.
_LAZY = {"LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "EngineConfig": "engine.config",
         "ModelConfig": "engine.config", "CacheConfig": "engine.config", "SchedulerConfig": "engine.config"}

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "RequestOutput", "CompletionOutput", "EngineMetrics"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
