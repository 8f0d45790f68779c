"""A tiny chat model folder for router tests over a real engine: a random-weight 2-layer Llama and
a byte-level BPE tokenizer with a chat template, trained on a few lines."""
from __future__ import annotations

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello router",
          "prefill and decode nodes share paged KV blocks", "user: hi\nassistant: hello"] * 20


def byte_level_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS (a character outside it, such as "é", is
    several byte tokens), with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_chat_model_folder(path) -> int:
    """A random-weight 2-layer Llama and a byte-level BPE tokenizer saved to `path`; returns vocab size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(path)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    return len(tokenizer)
