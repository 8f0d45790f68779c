"""The structured-output benchmark model folder: the peers' random-weight Llama (vocab 32,000;
bench/random_model.py) with a byte-level BPE tokenizer over the same 32,000 ids, trained with
`tokenizers` on pseudo-words and JSON documents. Grammars need a tokenizer that can spell any
text (JSON punctuation, digits, quotes): the word-level tokenizer of bench/serving/model.py
cannot, so this folder has its own.

    <cache>/structured-llama-58m/  config.json  model.safetensors  tokenizer.json  tokenizer_config.json
"""
from __future__ import annotations

import json
import os
import random

from bench.random_model import PEER_SHAPE, make_random_llama
from bench.serving.model import SPECIALS, pseudo_words

# the schema every structured benchmark constrains to: bounded, so a random model ends it
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}


# a schema no output completes within the benchmark's max_tokens: every row runs the whole
# length, constrained or not, so the batch stays full and a gap is the grammar's own cost
LONG_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 4096}


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = pseudo_words(40000, seed)
    lines = [" ".join(rng.sample(words, 12)) for _ in range(6000)]
    docs = [json.dumps({rng.choice(words): rng.choice([rng.randint(-999, 99999), rng.choice(words), True, None])
                        for _ in range(3)}) for _ in range(3000)]
    return lines + docs


def write_bpe_tokenizer(path: str, vocab_size: int = PEER_SHAPE["vocab_size"], seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_corpus(seed), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(path)


def prepare_structured_model(cache_dir: str, seed: int = 0) -> str:
    """The model folder (created once, reused); returns its path."""
    path = os.path.join(cache_dir, "structured-llama-58m")
    make_random_llama(path, seed=seed)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        write_bpe_tokenizer(path, seed=seed)
    return path
