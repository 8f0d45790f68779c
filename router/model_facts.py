"""What the router of a disaggregated deployment needs from the model folder the nodes serve:
its name, context length, vocabulary size and tokenizer, read without torch.

transformers 5 imports torch with any config or Auto* class (configuration_utils imports
modeling_rope_utils), about 2 s and 200 MB the router does not need: config.json is read as plain
JSON (context by the engine's own rule, engine/context.py) and a tokenizer saved as the generic
fast class (tokenizer_config.json's tokenizer_class) is loaded through that class alone. A
tokenizer of a model-specific class (LlamaTokenizerFast, ...) may add behaviour of its own, so it
still goes through AutoTokenizer, torch and all.
"""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from engine.context import context_length

GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


class ModelFacts(NamedTuple):
    name: str               # the folder's name: the served model name unless told otherwise
    max_model_len: int
    vocab_size: int


def read_model_facts(path: str) -> ModelFacts:
    config = _json(os.path.join(path, "config.json"))
    if config is None:
        raise ValueError(f"no config.json in {path!r}: pdserve loads models from a local folder")
    return ModelFacts(path.rstrip("/").split("/")[-1], context_length(config.get), int(config["vocab_size"]))


def load_tokenizer(path: str) -> Any:
    """The folder's tokenizer, or None if it has none (token-id prompts only)."""
    tokenizer_config = _json(os.path.join(path, "tokenizer_config.json")) or {}
    generic = tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
    try:
        if generic and os.path.isfile(os.path.join(path, "tokenizer.json")):
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def _json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
