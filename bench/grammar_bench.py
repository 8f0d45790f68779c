"""Grammar libraries side by side on the benchmark tokenizer (byte-level BPE, 32,000 ids):
xgrammar and llguidance, the two that vLLM and SGLang use.

For each: the tokenizer set-up, compiling BENCH_SCHEMA (cold, no cache), and one decode step's
constraint work at batch 1 / 8 / 32: fill every row's bitmask, apply it to [B, 32000] float32
logits, accept the sampled token per row. Random logits pick the tokens (argmax under the mask),
so every row walks a valid path through the schema; a row whose grammar ends starts over.
Each batch is timed twice: the rows' masks filled in a Python loop into one bitmask, and by the
library's own thread pool (xgrammar's BatchGrammarMatcher, llguidance's fill_next_token_bitmask_par).
The libraries alternate within one run (the machine is shared): compare ratios, not absolutes.

    python -m bench.grammar_bench [--steps 200] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.structured_model import BENCH_SCHEMA, prepare_structured_model

BENCH = os.path.dirname(os.path.abspath(__file__))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import xgrammar as xgr
        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
        self.setup_s = time.perf_counter() - start
        self.batch = xgr.BatchGrammarMatcher(max_threads=os.cpu_count())

    def compile(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int, vocab: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, vocab)

    def fill(self, matchers, bitmask, threads: bool) -> None:
        if threads:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def apply(self, logits, bitmask) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token: int) -> bool:
        ok = m.accept_token(token)
        if m.is_terminated():
            m.reset()
        return ok


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import llguidance as llg
        import llguidance.hf
        import llguidance.torch
        self.llg, self.lt = llg, llguidance.torch
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - start
        self.executor = llg.LLExecutor()

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)      # llguidance compiles lazily, per matcher
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def bitmask(self, rows: int, vocab: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(rows, vocab)

    def fill(self, matchers, bitmask, threads: bool) -> None:
        if threads:
            self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        else:
            for i, m in enumerate(matchers):
                self.lt.fill_next_token_bitmask(m, bitmask, i)

    def apply(self, logits, bitmask) -> None:
        self.lt.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, m, token: int) -> bool:
        ok = m.consume_token(token)
        if m.is_stopped():
            m.reset()
        return ok


def time_steps(lib, compiled, batch: int, steps: int, vocab: int, seed: int, threads: bool) -> tuple[float, float]:
    """Mean seconds of one step's constraint work (fill + apply + accept) for `batch` rows; the
    rows' masks filled in a loop, or by the library's own thread pool (`threads`). Returns
    (step, fill alone)."""
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    bitmask = lib.bitmask(batch, vocab)
    g = torch.Generator().manual_seed(seed)
    logits_all = [torch.randn(batch, vocab, generator=g) for _ in range(8)]
    total = fill = 0.0
    for step in range(steps):
        logits = logits_all[step % 8].clone()
        start = time.perf_counter()
        lib.fill(matchers, bitmask, threads)
        fill += time.perf_counter() - start
        lib.apply(logits, bitmask)
        tokens = logits.argmax(dim=-1).tolist()
        for m, t in zip(matchers, tokens):
            assert lib.accept(m, t), f"{lib.name} refused its own allowed token {t}"
        total += time.perf_counter() - start
    return total / steps, fill / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    path = prepare_structured_model(os.path.join(BENCH, ".cache"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = 32000
    schema = json.dumps(BENCH_SCHEMA)
    libs = [XGrammar(tokenizer, vocab, tokenizer.eos_token_id), LLGuidance(tokenizer, vocab, tokenizer.eos_token_id)]
    result = {lib.name: {"tokenizer_setup_ms": lib.setup_s * 1e3, "compile_ms": [], "step_ms": {}, "fill_ms": {}} for lib in libs}
    for r in range(args.repeats):
        for lib in libs if r % 2 == 0 else libs[::-1]:      # alternate: the machine is shared
            start = time.perf_counter()
            compiled = lib.compile(schema)
            result[lib.name]["compile_ms"].append((time.perf_counter() - start) * 1e3)
            for b in map(int, args.batches.split(",")):
                for threads in (False, True):
                    step_s, fill_s = time_steps(lib, compiled, b, args.steps, vocab, r, threads)
                    key = f"{b}{' threads' if threads else ''}"
                    result[lib.name]["step_ms"].setdefault(key, []).append(step_s * 1e3)
                    result[lib.name]["fill_ms"].setdefault(key, []).append(fill_s * 1e3)
    for name, res in result.items():
        steps = "  ".join(f"B={b}: {statistics.median(v):.2f} ({statistics.median(res['fill_ms'][b]):.2f})"
                          for b, v in res["step_ms"].items())
        print(f"{name:11s} setup {res['tokenizer_setup_ms']:.0f} ms  compile {statistics.median(res['compile_ms']):.1f} ms"
              f"  step ms, fill+apply+accept (fill alone): {steps}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
