"""Greedy output equals Hugging Face transformers token for token (float32, CPU)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.model_factory import hf_greedy, make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# shorter than a block, exactly one block, spanning several blocks
PROMPTS = [[1, 17, 99, 4, 250], list(range(10, 26)), [(i * 37) % 500 + 3 for i in range(53)]]

ARCHS = {
    "llama-mha": dict(arch="llama", heads=4, kv_heads=4),
    "llama-gqa": dict(arch="llama", heads=4, kv_heads=2),
    "llama3-rope": dict(arch="llama", heads=4, kv_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen2-bias": dict(arch="qwen2", heads=4, kv_heads=2),
    "mistral": dict(arch="mistral", heads=4, kv_heads=2, sliding_window=512),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), make_model(path, **ARCHS[request.param])


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_architecture_matches_transformers_batched(arch_model, make_llm):
    """Llama MHA/GQA, Llama-3 RoPE, Qwen2 with q/k/v bias and Mistral: a mixed-length batch
    decodes exactly what transformers decodes one prompt at a time."""
    path, hf = arch_model
    llm = make_llm(path, block_size=16, num_blocks=64)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize("chunked,budget", [(False, 2048), (True, 7)])
def test_chunked_prefill_matches(model_dir, make_llm, chunked, budget):
    """Chunked prefill under a 7-token step budget gives the same tokens as whole prefill."""
    path, hf = model_dir
    llm = make_llm(path, block_size=8, num_blocks=64, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=budget if chunked else 2048)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_batch_of_one_matches(model_dir, make_llm):
    """A lone request decodes exactly what transformers decodes."""
    path, hf = model_dir
    llm = make_llm(path, block_size=8, num_blocks=32)
    assert _tokens(llm.generate([PROMPTS[2]], GREEDY)) == [hf_greedy(hf, PROMPTS[2], 24)]


def test_preemption_keeps_output_identical(model_dir, make_llm):
    """A pool too small for the batch forces preemption by recomputation; the tokens still
    equal transformers'."""
    path, hf = model_dir
    prompts = [[(i * 7 + j) % 400 + 5 for j in range(20)] for i in range(6)]
    llm = make_llm(path, block_size=8, num_blocks=14, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == [hf_greedy(hf, p, 30) for p in prompts]


def test_prefix_cache_hit_gives_same_tokens(model_dir, make_llm):
    """A second prompt sharing a cached 32-token prefix reuses it and decodes the same as
    transformers."""
    path, hf = model_dir
    shared = [(i * 11) % 450 + 3 for i in range(32)]
    a, b = shared + [7, 8, 9], shared + [40, 41]
    llm = make_llm(path, block_size=8, num_blocks=64)
    first = llm.generate([a], GREEDY)
    second = llm.generate([b], GREEDY)
    assert llm.engine.block_manager.stats.hit_tokens == 32
    m = llm.engine.metrics()    # the counters /metrics rates: every prompt token queried, 32 hit
    assert (m.prefix_queried_tokens, m.prefix_hit_tokens, m.block_size) == (len(a) + len(b), 32, 8)
    assert first[0].queue_time is not None and first[0].queue_time >= 0.0
    assert _tokens(first + second) == [hf_greedy(hf, a, 24), hf_greedy(hf, b, 24)]


def test_builtin_model_matches_transformers(make_llm):
    """The shipped Shakespeare model (run in float32) decodes "ROMEO:" as transformers does."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.builtin import BUILTIN_MODEL_PATH
    hf = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL_PATH, dtype=torch.float32).eval()
    llm = make_llm(BUILTIN_MODEL_PATH, dtype="float32", num_blocks=64)
    prompts = [llm.engine.tokenizer.encode(t) for t in ("ROMEO:\n", "JULIET:\nO Romeo, Romeo,")]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert _tokens(outs) == [hf_greedy(hf, p, 40) for p in prompts]
    assert "\n" in outs[0].outputs[0].text


def test_without_the_c_kernels_output_is_the_same(model_dir, make_llm, monkeypatch):
    """PDSERVE_CPU_KERNELS=0 (as on a host without a C compiler): every op takes its PyTorch
    path (attention, KV store, RMSNorm, RoPE, SiLU; the linears on oneDNN), with chunked prefill
    and decode mixed in one step; the tokens still equal transformers'."""
    from engine.packed_linear import PackedLinear
    from kernels import gemm_avx2, gemm_f32
    from kernels.cpu_kernels import gemm_avx2_lib, gemm_f32_lib, layer_ops_lib, paged_decode_lib, paged_prefill_lib
    libs = (layer_ops_lib, paged_decode_lib, paged_prefill_lib, gemm_f32_lib, gemm_avx2_lib, gemm_f32.supported,
            gemm_avx2.F32.supported)
    path, hf = model_dir
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    for lib in libs:
        lib.cache_clear()
    try:
        assert all(lib() is None for lib in libs[:5])
        llm = make_llm(path, block_size=8, num_blocks=64, enable_chunked_prefill=True, max_num_batched_tokens=20)
        assert type(llm.engine.runner.model.lm_head) is PackedLinear
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == [hf_greedy(hf, p, 24) for p in PROMPTS]
    finally:
        monkeypatch.undo()
        for lib in libs:
            lib.cache_clear()
