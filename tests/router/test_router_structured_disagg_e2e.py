"""Structured output through the disaggregated router and real prefill and decode node processes:
both nodes compile a new grammar (in their compile worker processes) before the decode node
reserves, and every output follows its grammar, the same as the colocated engine's."""
from __future__ import annotations

import asyncio

from pdwire.sampling_params import SamplingParams
from pdwire.structured_output import GrammarKind, StructuredOutput
from router.config import RouterConfig
from router.node_processes import ClusterConfig
from tests.engine.test_structured_output import SCHEMA, _check
from tests.router.test_router_disagg_e2e import _collect, _prefills, _with_cluster
from tests.tiny_chat_model import tiny_chat_model_folder


def test_new_grammars_compile_on_both_nodes_and_outputs_follow_them(tmp_path, make_llm):
    """A JSON schema and a regex new to both nodes, two requests each at once (one compile per
    node and grammar, shared): every output ends by its grammar, validates, and equals the
    colocated engine's greedy output; every prompt went through the prefill node."""
    tiny_chat_model_folder(tmp_path)
    path = str(tmp_path)
    specs = [StructuredOutput.json_schema(SCHEMA), StructuredOutput(GrammarKind.REGEX, "[a-z]{2,6} [0-9]{2}")]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured=s) for s in specs for _ in range(2)]
    llm = make_llm(path, dtype="float32", block_size=16, num_blocks=96)
    prompt = llm.engine.encode("hello world")
    colocated = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params)]

    async def test(backend, nodes):
        outs = await asyncio.gather(*(_collect(backend, f"s{i}", prompt, p) for i, p in enumerate(params)))
        for p, out, expected in zip(params, outs, colocated):
            choice = out.outputs[0]
            assert choice.finish_reason == "stop" and choice.token_ids == expected
            _check(llm.engine.tokenizer.decode(choice.token_ids, skip_special_tokens=True), p.structured)
        assert _prefills(backend) == {"remote": len(params)}
    _with_cluster(path, RouterConfig(local_prefill_tokens=0), ClusterConfig(1, 1), test)
