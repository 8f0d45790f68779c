"""pdserve's engine: what prefill and decode nodes share (configs, block manager, model,
sampler, scheduler) and the colocated offline API."""
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, EngineMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "RequestOutput", "CompletionOutput", "EngineMetrics"]
