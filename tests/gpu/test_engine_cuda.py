"""The engine on CUDA (the Triton kernels inside a real model) against transformers, colocated
and disaggregated. Skipped without a CUDA device; bench/gpu_check.sh runs it when a GPU is lent.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.model_factory import hf_greedy, make_model
from tests.node_harness import NodeHarness

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# shorter than a block, exactly one, several, and long enough for split-K decode (block size 16)
PROMPTS = [[1, 17, 99, 4, 250], list(range(10, 26)), [(i * 37) % 500 + 3 for i in range(70)],
           [(i * 11) % 500 + 3 for i in range(480)]]


@pytest.fixture(scope="module", params=[32, 128], ids=lambda d: f"d{d}")
def cuda_model(request, tmp_path_factory):
    """A random GQA Llama (4 heads, 2 kv heads) of head size 32 (the built-in model's) or 128."""
    path = tmp_path_factory.mktemp(f"llama_d{request.param}")
    return str(path), make_model(path, "llama", hidden=4 * request.param)


def test_engine_on_cuda_decodes_what_transformers_decodes(cuda_model):
    """float32 on CUDA, chunked prefill (32-token steps) and a prefix-cache hit: transformers'
    greedy tokens (on CPU), and every block accounted for."""
    path, hf = cuda_model
    with LLM(path, device="cuda", dtype="float32", num_blocks=256, max_num_batched_tokens=32) as llm:
        assert llm.engine.runner.kv_cache.is_cuda
        outs = llm.generate(PROMPTS, GREEDY)
        again = llm.generate([PROMPTS[2][:48] + [7, 8, 9]], GREEDY)
        for prompt, out in zip(PROMPTS + [PROMPTS[2][:48] + [7, 8, 9]], outs + again):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)
        assert llm.engine.metrics().prefix_hit_rate > 0
        llm.engine.check_integrity()


def test_bfloat16_engine_on_cuda_runs_and_mostly_agrees(cuda_model):
    """bfloat16 on CUDA: every request completes; greedy tokens may drift from float32 by rounding,
    so only the first token of each prompt is compared."""
    path, hf = cuda_model
    with LLM(path, device="cuda", dtype="bfloat16", num_blocks=256) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        firsts = [o.outputs[0].token_ids[0] for o in outs]
        assert sum(f == hf_greedy(hf, p, 1)[0] for f, p in zip(firsts, PROMPTS)) >= len(PROMPTS) - 1
        llm.engine.check_integrity()


def test_disaggregated_nodes_on_cuda_decode_what_transformers_decodes(cuda_model):
    """A prefill and a decode node on the GPU (ZeroMQ: device pools staged through host memory)
    decode transformers' greedy tokens."""
    path, hf = cuda_model
    h = NodeHarness(path, device="cuda", dtype="float32", block_size=16, num_blocks=128)
    try:
        for i, p in enumerate(PROMPTS[:3]):
            h.submit(f"r{i}", p, GREEDY)
        for p, r in zip(PROMPTS[:3], h.wait([f"r{i}" for i in range(3)])):
            assert r.failed is None and [r.tokens[i] for i in sorted(r.tokens)] == hf_greedy(hf, p, 16)
        h.idle()
    finally:
        h.close()
    for service in (h.prefill, h.decode):
        service.engine.check_integrity()


def test_sampling_options_on_cuda_equal_the_cpu_engine(cuda_model):
    """Seeded sampling with top-k / top-p / penalties / logprobs, n = 2, prompt logprobs and beam
    search run on CUDA (every tensor the sampler makes must live on the logits' device) and give
    the CPU engine's tokens: a seeded draw depends on (seed, position) only."""
    path, hf = cuda_model
    prompt = PROMPTS[2]
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True,
                             presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=2),
              SamplingParams(temperature=1.0, min_p=0.05, seed=3, n=2, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(beam_width=3, n=2, max_tokens=6, ignore_eos=True)]
    runs = {}
    for device in ("cuda", "cpu"):
        with LLM(path, device=device, dtype="float32", num_blocks=256) as llm:
            runs[device] = llm.generate([prompt] * len(params), params)
            llm.engine.check_integrity()
    for gpu, cpu in zip(runs["cuda"], runs["cpu"]):
        assert [c.token_ids for c in gpu.outputs] == [c.token_ids for c in cpu.outputs]
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = runs["cuda"][2].prompt_logprobs
    assert got[0] is None
    assert max(abs(got[i][prompt[i]] - expected[i - 1, prompt[i]].item()) for i in range(1, len(prompt))) < 1e-3
