"""Random-weight Llama-family checkpoints saved as local Hugging Face folders, for tests."""
from __future__ import annotations

import weakref

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


# model -> prompt -> the longest greedy continuation computed so far (the session's models are
# shared by many tests, which ask for the same prompts again: 400 tokens take ~1 s each time)
_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`, EOS ignored. Computed once per model and
    prompt: a shorter continuation is the first tokens of a longer one (step i sees only the prompt
    and tokens 0..i-1, and no step may end the output)."""
    known = _GREEDY.setdefault(model, {})
    tokens = known.get(tuple(prompt), [])
    if len(tokens) < max_new_tokens:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        tokens = known[tuple(prompt)] = out[0, len(prompt):].tolist()
    return tokens[:max_new_tokens]
