"""A greedy stream's tokens do not depend on the requests it runs beside: prefill rows and decode
rows get the same bits alone and in any batch (kernels/cpu_prefill.py), so a stream moved to
another node, where other prompts were prefilled with it, goes on exactly as it would have
(tests/router/test_router_kv_move_e2e.py asserts that over real nodes)."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.builtin import BUILTIN_MODEL_PATH

# the last prompt ~700 tokens: its decode attention cut into segments and merged
# (kernels/cpu_decode.py), in a batch as alone
TEXTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not",
         "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed",
         "MACBETH:\n" + "Is this a dagger which I see before me, the handle toward my hand? " * 40]
# each token's logprob too: a bit changed anywhere in a step shows there long before a token changes
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_streams_alone_equal_them_in_a_batch(make_llm, dtype):
    """The built-in model, prefix caching off (each run computes its own K/V): 6 prompts of
    different lengths prefilled and decoded together, then each alone, then the last three. In
    bfloat16 a batch-dependent prefill changed the 5th stream's tokens at its 309th."""
    llm = make_llm(BUILTIN_MODEL_PATH, dtype=dtype, enable_prefix_caching=False)

    def streams(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    together = streams(llm.generate(TEXTS, GREEDY))
    alone = [streams(llm.generate([t], GREEDY))[0] for t in TEXTS]
    three = streams(llm.generate(TEXTS[3:], GREEDY))
    assert all(len(ids) == GREEDY.max_tokens for ids, _ in together)
    assert alone == together
    assert three == together[3:]
