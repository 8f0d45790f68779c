"""The shipped built-in model (engine/builtin/shakespeare-6m) loads and behaves in plain transformers."""

import json
import os
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.builtin import BUILTIN_MODEL_PATH  # noqa: E402

LOG_PATH = os.path.join(BUILTIN_MODEL_PATH, "training_log.json")

# The most frequent words of Early Modern English drama. Real text (Shakespeare or
# modern prose) draws well over a third of its words from this list; a model
# babbling random tokens draws almost none.
COMMON_WORDS = set(
    """
    a about after again against all am an and any are art as at ay be been before
    being but by can come did do does doth dost done down e'en ere even for from
    give go good had hast hath have he hear her here him his how i if in is it
    know let like lord love made make man may me more most much must my nay
    ne'er no nor not now o of on one or our out own say see shall she sir so
    some speak such sweet take tell than that the thee their them then there
    these they thine this those thou though thus thy till to too upon us very
    was we well were what when where which while who whom why will with would
    ye yet you your 'tis i'll come good king lady father death life heart
    """.split()
)


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(BUILTIN_MODEL_PATH)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_PATH)
    return m.eval()


@pytest.fixture(scope="module")
def log():
    with open(LOG_PATH) as f:
        return json.load(f)


def test_builtin_path_is_absolute_folder_with_standard_files():
    """BUILTIN_MODEL_PATH is an absolute folder holding the standard HF files, under 20 MB."""
    assert os.path.isabs(BUILTIN_MODEL_PATH)
    names = set(os.listdir(BUILTIN_MODEL_PATH))
    need = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "training_log.json"}
    assert need <= names, need - names
    size = sum(os.path.getsize(os.path.join(BUILTIN_MODEL_PATH, n)) for n in names)
    assert size < 20e6, size


def test_config_is_small_gqa_llama():
    """config.json describes a Llama with grouped-query attention, rope 1e4, >=1024 positions."""
    cfg = transformers.AutoConfig.from_pretrained(BUILTIN_MODEL_PATH)
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size
    assert cfg.max_position_embeddings >= 1024
    rope = getattr(cfg, "rope_parameters", None) or {}
    assert rope.get("rope_theta", getattr(cfg, "rope_theta", None)) == 10000.0
    with open(os.path.join(BUILTIN_MODEL_PATH, "config.json")) as f:
        assert json.load(f)["rope_theta"] == 10000.0  # plain-JSON readers see it too


def test_weights_are_bf16_and_match_logged_parameter_count(model, log):
    """model.safetensors holds bf16 tensors and loads into exactly the logged parameter count."""
    from safetensors import safe_open

    with safe_open(os.path.join(BUILTIN_MODEL_PATH, "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}, dtypes
    assert sum(p.numel() for p in model.parameters()) == log["parameters"]
    assert 1e6 < log["parameters"] < 10e6


def test_tokenizer_round_trips_text_and_has_special_tokens(tok, model):
    """Tokenizer decodes its own encoding back to the exact text and prepends <s>; ids match the config."""
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?\n  Café — 'tis 1597.\n\n"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode()) / 2  # BPE actually merges
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len(set([tok.bos_token_id, tok.eos_token_id, tok.pad_token_id])) == 3
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert len(tok) == model.config.vocab_size


def test_chat_template_renders_turns_and_generation_prompt(tok):
    """The chat template renders user/assistant turns and appends the assistant header on request."""
    msgs = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A friend."},
            {"role": "user", "content": "Speak."}]
    s = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert s == "<s><|user|>\nWho art thou?\n<|assistant|>\nA friend.</s>\n<|user|>\nSpeak.\n<|assistant|>\n"
    s2 = tok.apply_chat_template(msgs[:1], add_generation_prompt=False, tokenize=False)
    assert not s2.endswith("<|assistant|>\n")
    ids = tok(s, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|assistant|>")) == 2  # role markers are single tokens
    assert ids[0] == tok.bos_token_id


def test_training_log_val_loss_far_below_untrained(log):
    """The logged held-out loss of the shipped bf16 weights is far below the untrained model's."""
    assert log["val_loss_untrained"] > 8.0  # ~ln(4096): chance level
    assert log["val_loss_shipped_bf16"] < log["val_loss_untrained"] - 3.0
    assert abs(log["val_loss_shipped_bf16"] - log["val_loss_final"]) < 0.05
    vals = [h["val_loss"] for h in log["history"]]
    assert vals[-1] == min(vals[1:]) or vals[-1] < vals[1]
    assert log["command"].startswith("python -m scripts.builtin_model.train")


def test_greedy_generation_from_romeo_reads_like_text(tok, model):
    """Greedy 40 tokens from "ROMEO:" give lines of mostly common English words."""
    inputs = tok("ROMEO:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0][inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert text.count("\n") >= 2, text
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 15, text
    common = sum(w.lower() in COMMON_WORDS for w in words) / len(words)
    assert common >= 0.3, (common, text)
    vocab = tok.get_vocab()
    whole = sum(("Ġ" + w) in vocab or ("Ġ" + w.lower()) in vocab or w in vocab for w in words) / len(words)
    assert whole >= 0.7, (whole, text)
