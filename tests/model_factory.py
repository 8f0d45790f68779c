"""Random-weight Llama-family checkpoints saved as local Hugging Face folders, for tests."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, \
    Qwen2Config, Qwen2ForCausalLM

_ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
          "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def make_model(path, arch: str = "llama", *, heads: int = 4, kv_heads: int = 2, hidden: int = 64,
               layers: int = 2, vocab: int = 512, seed: int = 0, **extra) -> LlamaForCausalLM:
    """Save a random model to `path` (float32 safetensors) and return it in eval mode."""
    config_cls, model_cls = _ARCHS[arch]
    config = config_cls(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():   # larger-than-default weights: confident, well-separated logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`, EOS ignored."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()
