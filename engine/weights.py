"""Load a local Hugging Face safetensors checkpoint (single file or sharded) into `CausalLM`.

Checkpoint names map onto the fused layout:
    model.layers.N.self_attn.{q,k,v}_proj.{weight,bias} -> layers.N.self_attn.qkv_proj (rows q|k|v)
    model.layers.N.mlp.{gate,up}_proj.weight            -> layers.N.mlp.gate_up_proj (rows gate|up)
    model.X                                             -> X;  lm_head.weight -> lm_head.weight
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.model import CausalLM
from engine.rope import RotaryEmbedding

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_model(cfg: ModelConfig, device: torch.device) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in _checkpoint_tensors(cfg.path):
        target, rows = _target(name, cfg)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        dest = params[target].data
        if rows is not None:
            dest = dest[rows[0]:rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(f"{target}:{rows}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight:None")
    _check_complete(model, cfg, loaded)
    model.rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len, cfg.dtype, device)
    return model.eval()


def _checkpoint_tensors(path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    if not files:
        raise ValueError(f"no .safetensors weights in {path!r} (pdserve loads safetensors only)")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _target(name: str, cfg: ModelConfig) -> tuple[str | None, tuple[int, int] | None]:
    """Model parameter name and row range for a checkpoint tensor name (None: skip it)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return None, None
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, part = _FUSED[parts[-2]]
        parts[-2] = fused
        return ".".join(parts), _rows(cfg, fused, part)
    return name, None


def _rows(cfg: ModelConfig, fused: str, part: int) -> tuple[int, int]:
    if fused == "gate_up_proj":
        sizes = [cfg.intermediate_size] * 2
    else:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    start = sum(sizes[:part])
    return start, start + sizes[part]


def _check_complete(model: CausalLM, cfg: ModelConfig, loaded: set[str]) -> None:
    missing = []
    for name, _ in model.named_parameters():
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            expected = [f"{name}:{_rows(cfg, 'qkv_proj', p)}" for p in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            expected = [f"{name}:{_rows(cfg, 'gate_up_proj', p)}" for p in range(2)]
        else:
            expected = [f"{name}:None"]
        missing += [e for e in expected if e not in loaded]
    if missing:
        raise ValueError(f"checkpoint {cfg.path!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
