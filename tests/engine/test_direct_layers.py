"""engine.direct_layers: the decoder layers called straight into the kernels give the modules' own
bits, step after step (chunked prefills beside decodes, float32 and bfloat16); a hooked layer runs
through its modules; models it cannot take keep the modules."""
import pytest
from torch import nn

from engine import SamplingParams
from engine.direct_layers import SWITCH, DirectLayers

@pytest.fixture(autouse=True)
def _c_prefill(monkeypatch):
    """Each test runs the prompts twice, the second time after their cached prefixes. The C prefill
    kernel gives a row the same bits either way; the SDPA path (every prefill on a CPU without
    AVX-512) splits a chunk after a prefix into two calls merged by log-sum-exp, other bits. The
    test is of the layers, not of that: the kernel on every CPU."""
    monkeypatch.setenv("PDSERVE_PREFILL_SDPA", "0")


# prompts of 5, 40 and 150 tokens with 64-token steps: the long one prefills in chunks, beside the
# others' decode rows, and chunks after its cached prefix
PROMPTS = [[(7 * i + 3) % 500 + 3 for i in range(n)] for n in (5, 40, 150)]


def _run(llm, direct):
    model = llm.engine.runner.model
    model.direct = direct
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_direct_layers_give_the_modules_bits(model_dir, make_llm, dtype):
    llm = make_llm(model_dir[0], dtype=dtype, num_blocks=64, max_num_batched_tokens=64)
    direct = llm.engine.runner.model.direct
    assert isinstance(direct, DirectLayers)         # this machine kind packs every linear
    calls = []
    real = direct.run
    direct.run = lambda *a: calls.append(1) or real(*a)
    through_direct = _run(llm, direct)
    through_modules = _run(llm, None)
    assert calls, "the direct layers never ran"
    assert through_direct == through_modules        # token ids and every logprob, exactly


def test_a_hooked_layer_runs_through_its_modules(model_dir, make_llm):
    llm = make_llm(model_dir[0], num_blocks=64, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    direct = model.direct
    expected = _run(llm, direct)
    seen = {"layer": 0, "inner": 0}
    hooks = [model.layers[0].register_forward_hook(lambda *a: seen.__setitem__("layer", seen["layer"] + 1)),
             model.layers[1].mlp.down_proj.register_forward_pre_hook(
                 lambda *a: seen.__setitem__("inner", seen["inner"] + 1))]
    try:
        assert _run(llm, direct) == expected
    finally:
        for h in hooks:
            h.remove()
    assert seen["layer"] > 0 and seen["layer"] == seen["inner"]     # one call of each per step


def test_models_it_cannot_take_keep_their_modules(model_dir, make_llm, monkeypatch):
    llm = make_llm(model_dir[0], num_blocks=32)
    model = llm.engine.runner.model
    assert DirectLayers.fits(model)
    packed, model.layers[1].mlp.down_proj = model.layers[1].mlp.down_proj, nn.Linear(8, 8)
    try:
        assert not DirectLayers.fits(model) and DirectLayers.build(model) is None   # a linear not packed
    finally:
        model.layers[1].mlp.down_proj = packed
    monkeypatch.setenv(SWITCH, "0")
    assert DirectLayers.build(model) is None
    assert make_llm(model_dir[0], num_blocks=32).engine.runner.model.direct is None
