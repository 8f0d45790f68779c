"""`make run` before serving: offline generation on the built-in model.

    python scripts/demo.py [--model DIR] [--max-tokens N] [PROMPT ...]
"""
from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo,", "First Citizen:\nBefore we proceed any further,"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="*", default=PROMPTS)
    ap.add_argument("--model", default=None, help="local Hugging Face folder (default: the built-in model)")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print("=" * 72)
        print(llm.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True) + out.outputs[0].text)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("=" * 72)
    print(f"{len(outputs)} prompts, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tokens/s), "
          f"model {llm.engine.model_name}, {llm.engine.model_config.dtype}")


if __name__ == "__main__":
    main()
