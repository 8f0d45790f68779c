"""The peers' benchmark model: a random-weight Llama (hidden 512, intermediate 1408, 8 layers,
8 heads, vocab 32000; 58.5M parameters), saved once as a local Hugging Face folder."""
from __future__ import annotations

import os

PEER_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)


def make_random_llama(path: str, seed: int = 0, device: str = "cpu", dtype: str = "float32", **overrides) -> str:
    """Create the folder if missing; return its path. Reused across runs (same seed, same weights).
    The weights are made on `device` (a GPU makes a 7B model's in seconds) and saved in `dtype`."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**{**PEER_SHAPE, **overrides}, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path
