"""The benchmark model folder: the peers' random-weight Llama (bench/random_model.py) plus a
word-level tokenizer over the same 32,000 ids, so that every server takes text prompts and a
prompt of n words is exactly n tokens on all of them.

    <cache>/serving-llama-58m/  config.json  model.safetensors  tokenizer.json  tokenizer_config.json

The words are pronounceable pseudo-words drawn with a fixed seed; ids 0, 1, 2 are <unk>, <s>, </s>
(the model's bos 1 and eos 2). No BOS is added on encode, so prompt lengths are what we send.
"""
from __future__ import annotations

import json
import os
import random

from bench.random_model import PEER_SHAPE, make_random_llama

SPECIALS = ("<unk>", "<s>", "</s>")
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr".split()
_VOWELS = "a e i o u ai ea ou".split()


def pseudo_words(count: int, seed: int = 0) -> list[str]:
    """`count` distinct lowercase pseudo-words, the same list for the same seed."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < count:
        syllables = rng.choice((2, 2, 3, 3, 4))
        words["".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))] = None
    return list(words)


def word_vocab(vocab_size: int = PEER_SHAPE["vocab_size"], seed: int = 0) -> list[str]:
    """Token strings by id: the specials, then pseudo-words."""
    return list(SPECIALS) + pseudo_words(vocab_size - len(SPECIALS), seed)


def write_tokenizer(path: str, vocab: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok.add_special_tokens(list(SPECIALS))
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
              "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False,
              "model_max_length": PEER_SHAPE["max_position_embeddings"], "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def prepare_model(cache_dir: str, seed: int = 0) -> str:
    """The model folder (created once, reused); returns its path."""
    path = os.path.join(cache_dir, "serving-llama-58m")
    make_random_llama(path, seed=seed)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        write_tokenizer(path, word_vocab(seed=seed))
    return path
