"""Run inside bench/.vllm-venv by structured_throughput.py: vLLM CPU offline throughput with a
share of the batch held to BENCH_SCHEMA (xgrammar, compact JSON: disable_any_whitespace, as
pdserve lays JSON out). Prints one VLLM_STRUCTURED=<json> line per (repeat, fraction)."""
import json
import sys
import time


def _parses(text):
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    path, dtype, n, input_len, output_len, seed, repeats, fractions, schema = sys.argv[1:10]
    n, input_len, output_len, seed, repeats = int(n), int(input_len), int(output_len), int(seed), int(repeats)
    fractions = [float(f) for f in fractions.split(",")]
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    def workload(s):
        g = torch.Generator().manual_seed(s)
        return [TokensPrompt(prompt_token_ids=torch.randint(10, 30000, (input_len,), generator=g).tolist())
                for _ in range(n)]

    constrained = SamplingParams(temperature=0.0, max_tokens=output_len, structured_outputs=StructuredOutputsParams(
        json=json.loads(schema), disable_any_whitespace=True))
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm = LLM(model=path, dtype=dtype, max_num_seqs=n, max_model_len=2048, seed=seed,
              structured_outputs_config={"backend": "xgrammar"})
    llm.generate(workload(seed - 1)[:2], [constrained, free])                    # warm up, grammar compiled
    for r in range(repeats):
        for fraction in fractions:
            k = round(n * fraction)
            params = [constrained] * k + [free] * (n - k)
            start = time.perf_counter()
            outs = llm.generate(workload(seed + r), params)
            elapsed = time.perf_counter() - start
            tokens = [len(o.outputs[0].token_ids) for o in outs]
            texts = [o.outputs[0].text for o in outs[:k]]
            valid = sum(1 for t in texts if _parses(t))
            stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs[:k])
            print("VLLM_STRUCTURED=" + json.dumps({"fraction": fraction, "tokens_per_s": sum(tokens) / elapsed,
                                                   "constrained_mean_len": sum(tokens[:k]) / max(k, 1),
                                                   "valid": valid, "constrained": k, "stopped": stopped}), flush=True)
