"""Frozen, validated configs: the model (read from a Hugging Face config.json), the KV cache, the
scheduler, and the engine that bundles them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.args import TP_TIMEOUT_S
from engine.context import context_length
from engine.grammar_limits import GrammarLimits

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Model facts from a local Hugging Face folder. Build it with `ModelConfig.from_pretrained`."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int
    attention_bias: bool            # q/k/v bias: Qwen2 has it
    tie_word_embeddings: bool
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hf_config: object = field(repr=False, compare=False)   # transformers PretrainedConfig, for RoPE

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"pdserve runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto", max_model_len: int | None = None,
                        device_type: str = "cpu") -> "ModelConfig":
        """Model facts from the folder's config.json; dtype "auto" is the saved dtype, except that
        float16 checkpoints run in bfloat16 on CPU (`device_type`)."""
        from transformers import AutoConfig, GenerationConfig

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"no config.json in {path!r}: pdserve loads models from a local folder")
        hf = AutoConfig.from_pretrained(path)
        arch = (getattr(hf, "architectures", None) or ["?"])[0]
        heads = hf.num_attention_heads
        context = _context_length(hf)
        if max_model_len is not None:
            if max_model_len > context:
                raise ValueError(f"max_model_len {max_model_len} exceeds the model's context {context}")
            context = max_model_len
        return cls(
            path=path, architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps, max_model_len=context,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            dtype=_resolve_dtype(dtype, hf, device_type), bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_eos_ids(path, hf, GenerationConfig), hf_config=hf,
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16                 # tokens per KV block
    num_blocks: int | None = None        # fixed pool size; None: size from kv_cache_gib
    kv_cache_gib: float = 1.0            # KV pool memory when num_blocks is None
    enable_prefix_caching: bool = True
    swap_space_gib: float = 0.0          # host swap pool for swap preemption; 0: recompute only

    def __post_init__(self) -> None:
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64               # running sequences per step
    max_num_batched_tokens: int = 2048   # token budget per step (prefill chunks + decode tokens)
    enable_chunked_prefill: bool = True  # off: a prompt is prefilled in one step or waits, so
                                         # the context is at most max_num_batched_tokens
    preemption_mode: str = "auto"        # recompute | swap | auto (engine/swap.py; swap needs swap space)
    swap_min_blocks: int = 32            # auto: a single sequence this long is swapped, not recomputed
    long_prefill_token_threshold: int = 0  # chunked prefill: a prompt's tokens per step at most (0: the budget's)

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold caps a prompt's chunks: it needs chunked prefill")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None             # local HF folder; None: the built-in model
    dtype: str = "auto"                  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    device: str = "auto"                 # auto | cpu | cuda
    seed: int = 0                        # for requests without their own seed
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tensor_parallel_size: int = 1        # ranks the heads and MLP are split over (engine.parallel)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)   # structured outputs' compiles
    tensor_parallel_timeout_s: float = TP_TIMEOUT_S  # tp > 1: one collective of a step waits this long, then breaks the engine

    def __post_init__(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if not 0 < self.tensor_parallel_timeout_s < float("inf"):
            raise ValueError(f"tensor_parallel_timeout_s must be > 0 and finite, got {self.tensor_parallel_timeout_s!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def model_path(self) -> str:
        if self.model is not None:
            return self.model
        from engine.builtin import BUILTIN_MODEL_PATH
        return BUILTIN_MODEL_PATH

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _resolve_dtype(name: str, hf, device_type: str) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {name!r}")
        return _DTYPES[name]
    saved = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    saved = str(saved).replace("torch.", "") if saved is not None else "float32"
    if saved == "float16" and device_type == "cpu":
        return torch.bfloat16     # as vLLM's CPU backend does: CPU float16 matmuls are slow (no native FMA)
    return _DTYPES.get(saved, torch.float32)


def _context_length(hf) -> int:
    return context_length(lambda name, default: getattr(hf, name, default))


def _eos_ids(path: str, hf, generation_config_cls) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        ids.append(generation_config_cls.from_pretrained(path).eos_token_id)
    except OSError:
        pass
    ids.append(getattr(hf, "eos_token_id", None))
    flat: list[int] = []
    for item in ids:
        for token in (item if isinstance(item, (list, tuple)) else [item]):
            if token is not None and token not in flat:
                flat.append(int(token))
    return tuple(flat)
