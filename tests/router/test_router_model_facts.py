"""The disaggregated router reads its model folder without torch (router/model_facts.py) and
sees what the engine sees: the same context length, vocabulary and tokenization."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.builtin import BUILTIN_MODEL_PATH
from engine.config import ModelConfig
from router.model_facts import load_tokenizer, read_model_facts
from tests.tiny_chat_model import tiny_chat_model_folder

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["ROMEO: hi", "the quick brown fox\n\n  jumps", "<s>user: hello</s>", "", "日本語 ok"]
CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]


def test_the_router_of_pdserve_up_starts_without_torch():
    """Flags, the model folder's facts and tokenizer, the backend and the app: no torch loaded."""
    code = ("import sys; from router.launcher import parse_up; from router.http.app import create_app; "
            "from router.cluster.disaggregated import DisaggregatedBackend; "
            f"b = DisaggregatedBackend.from_model({BUILTIN_MODEL_PATH!r}, b'x' * 32); "
            "create_app(b, parse_up(['up']).router); assert b.tokenizer is not None; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_chat")
    tiny_chat_model_folder(path)
    return str(path)


@pytest.mark.parametrize("which", ["builtin", "chat", "llama"])
def test_facts_and_tokenizer_match_the_engine_and_autotokenizer(which, chat_model, model_dir):
    from transformers import AutoTokenizer

    path = {"builtin": BUILTIN_MODEL_PATH, "chat": chat_model, "llama": model_dir[0]}[which]
    engine = ModelConfig.from_pretrained(path)
    facts = read_model_facts(path)
    assert (facts.max_model_len, facts.vocab_size) == (engine.max_model_len, engine.vocab_size)
    light, auto = load_tokenizer(path), _auto(AutoTokenizer, path)
    assert (light is None) == (auto is None)
    if light is None:
        return
    for text in TEXTS:
        assert light(text).input_ids == auto(text).input_ids
        assert light.decode(auto(text).input_ids, skip_special_tokens=True) == \
            auto.decode(auto(text).input_ids, skip_special_tokens=True)
    assert (light.bos_token_id, light.eos_token_id, len(light)) == (auto.bos_token_id, auto.eos_token_id, len(auto))
    if auto.chat_template:
        assert light.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_sliding_window_bounds_the_context_as_in_the_engine(tmp_path):
    """Mistral-style (a window, no switch) is bounded; Qwen2-style with use_sliding_window false is not."""
    for extra, expected in [({"sliding_window": 64}, 64), ({"sliding_window": 64, "use_sliding_window": False}, 256),
                            ({"sliding_window": None}, 256)]:
        (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "max_position_embeddings": 256, **extra}))
        assert read_model_facts(str(tmp_path)).max_model_len == expected


def _auto(cls, path: str):
    try:
        return cls.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None
