"""The offline API, shaped like vLLM's:

    from engine import LLM, SamplingParams
    outputs = LLM(model=path).generate(["ROMEO:"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
from typing import Any

from tqdm import tqdm

from engine.args import EngineArgs
from engine.heap import freeze_heap, thaw_heap
from engine.llm_engine import LLMEngine
from pdwire.outputs import RequestOutput
from engine.parallel import close_runner
from pdwire.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        """engine_args: any field of engine.args.EngineArgs (dtype, num_blocks, kv_cache_gib,
        max_num_seqs, ...), the same names as every CLI's flags."""
        args = EngineArgs(model=model, **engine_args)
        self.engine = LLMEngine(args.engine_config())
        self._ids = itertools.count()
        self._frozen = args.freeze_gc and freeze_heap("LLM") > 0    # thawed by close()

    def close(self) -> bool:
        """Stop the tensor-parallel worker processes, if any (idempotent); no generate after. The
        heap frozen at start-up is the garbage collector's again (engine/heap.py). The
        queued grammar compiles are cancelled and the running ones killed (their worker processes:
        engine/grammar_workers.py): True once none runs. Without close(), the interpreter's exit
        kills them too, waiting for none."""
        close_runner(self.engine.runner)
        if self._frozen:
            thaw_heap()
            self._frozen = False
        grammars = self.engine.sampler.grammars
        return grammars is None or grammars.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, per_prompt):
            self.engine.add_request(rid, prompt, p)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
