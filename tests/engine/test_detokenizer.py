"""Incremental detokenization across a restart: a request moved to another node (a KV move, or a
re-prefill migration) starts a new Detokenizer on prompt + the tokens already generated. Wherever
the move lands, even inside a multi-byte character, the text emitted before it and after it add
up to the whole text, nothing lost and nothing twice."""
from __future__ import annotations

from engine.detokenizer import Detokenizer
from tests.tiny_chat_model import byte_level_tokenizer

TEXT = "hello wörld, the quick 🦊 jumps — naïve café"


def _emit(detok: Detokenizer, prompt: list[int], ids: list[int]) -> str:
    state = detok.start(prompt)
    return "".join(detok.step(state, t) for t in ids)


def test_text_emitted_before_and_after_a_restart_adds_up_wherever_it_lands():
    tokenizer = byte_level_tokenizer()
    detok = Detokenizer(tokenizer)
    prompt = tokenizer.encode("user: hi\nassistant:", add_special_tokens=False)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    whole = _emit(detok, prompt, ids)
    assert whole == TEXT
    inside = [k for k in range(1, len(ids)) if not tokenizer.decode(ids[:k]) or
              tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert inside, "the text must split some character over tokens for this test to mean anything"
    for k in range(1, len(ids)):
        before = _emit(detok, prompt, ids[:k])
        after = _emit(detok, prompt + ids[:k], ids[k:])
        assert before + after == TEXT, (k, before, after)
