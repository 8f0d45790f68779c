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

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, EngineMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "RequestOutput", "CompletionOutput", "EngineMetrics"]
