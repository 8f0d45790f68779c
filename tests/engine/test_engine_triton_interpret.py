"""The whole engine on the GPU's code path, without a GPU: every paged-attention, KV-store and
block-copy call of a real model goes to the Triton kernels, which Triton's interpreter runs on
CPU tensors (kernels/dispatch.py), and greedy output still equals transformers token for token.

This catches what the kernel-by-kernel tests cannot: the engine's real batches (mixed prefill,
chunked prefill over cached blocks, decode, copy-on-write) reaching the Triton launchers. The
engine runs in a child process (this file as a script) so that TRITON_INTERPRET is set before
triton is imported and never leaks into other tests. Sizes are tiny: the interpreter is slow.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import SamplingParams
from tests.model_factory import hf_greedy, make_model

# shorter than a block, exactly one, several and a partial one (block size 8); chunked in 16s
PROMPTS = [[1, 17, 99, 4, 250], list(range(10, 18)), [(i * 37) % 500 + 3 for i in range(29)]]
CACHED = PROMPTS[2][:24] + [5, 6, 7]            # its first 3 blocks are cached by then
MAX_TOKENS = 6
SAMPLED = dict(n=2, temperature=1.0, seed=11, max_tokens=3, ignore_eos=True)


def _run_engine(path: str) -> dict:
    """In the child: the engine with its kernels sent to Triton; tokens and kernel call counts."""
    import kernels.triton_block_copy as copy_mod
    import kernels.triton_kv_store as store_mod
    import kernels.triton_paged_attention as attn_mod
    from engine import LLM
    from kernels.dispatch import TRITON_ON_CPU

    calls = {"attention": 0, "store_kv": 0, "copy": 0}

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        setattr(module, name, wrapper)

    counted(attn_mod, "paged_attention_triton", "attention")
    counted(store_mod, "store_kv_triton", "store_kv")
    counted(copy_mod, "copy_rows_triton", "copy")
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=48, max_num_batched_tokens=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(PROMPTS, greedy, use_tqdm=False)
    second = llm.generate([CACHED], greedy, use_tqdm=False)
    sampled = llm.generate([PROMPTS[0]], SamplingParams(**SAMPLED), use_tqdm=False)
    llm.engine.check_integrity()
    return dict(triton_on_cpu=TRITON_ON_CPU, calls=calls,
                greedy=[o.outputs[0].token_ids for o in first + second],
                sampled=[c.token_ids for c in sampled[0].outputs],
                prefix_hit_rate=llm.engine.metrics().prefix_hit_rate)


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    """A random GQA Llama with the built-in model's head size, 32 (4 heads, 2 kv heads)."""
    path = tmp_path_factory.mktemp("llama_d32")
    return str(path), make_model(path, "llama", hidden=128)


@pytest.fixture(scope="module")
def interpreted(model32) -> dict:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PDSERVE_TRITON_ON_CPU="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__, model32[0]], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_on_triton_kernels_decodes_what_transformers_decodes(interpreted, model32):
    """Greedy output over the Triton kernels equals transformers', including a prompt whose first
    blocks come from the prefix cache; every kernel kind ran (copy: the n = 2 request's shared
    partial block, copied on its first write)."""
    _, hf = model32
    assert interpreted["triton_on_cpu"] is True
    assert all(n > 0 for n in interpreted["calls"].values()), interpreted["calls"]
    for prompt, tokens in zip(PROMPTS + [CACHED], interpreted["greedy"]):
        assert tokens == hf_greedy(hf, prompt, MAX_TOKENS)
    assert interpreted["prefix_hit_rate"] > 0


def test_sampling_over_triton_kernels_equals_the_cpu_path(interpreted, model32, make_llm):
    """The n = 2 seeded request samples the same tokens over the Triton kernels as over the CPU
    kernels (the logits agree to rounding; the draws depend only on seed and position)."""
    llm = make_llm(model32[0], dtype="float32", block_size=8, num_blocks=48, max_num_batched_tokens=16)
    cpu = llm.generate([PROMPTS[0]], SamplingParams(**SAMPLED), use_tqdm=False)
    assert interpreted["sampled"] == [c.token_ids for c in cpu[0].outputs]


if __name__ == "__main__":
    print(json.dumps(_run_engine(sys.argv[1])))
