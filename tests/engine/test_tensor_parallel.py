"""Tensor parallelism (engine.parallel): sliced layers sum to the whole; tp = 2 over gloo decodes
token for token what tp = 1 decodes; workers never outlive their engine."""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import engine.parallel.runner as parallel_runner
from engine import EngineConfig, LLM, ModelConfig, SamplingParams
from engine.forward_batch import ForwardBatch
from engine.parallel import shard_model
from engine.runner_base import RunnerBroken
from engine.weights import load_model
from tests.model_factory import hf_greedy, make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
HANG_S = 300.0      # only bounds a hang: a starved 2-core machine starts and ends processes slowly
# shorter than a block, exactly two blocks, spanning several blocks (block_size 8)
PROMPTS = [[1, 17, 99, 4, 250], list(range(10, 26)), [(i * 37) % 500 + 3 for i in range(53)]]


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def _prefill_batch(num_tokens: int, block_size: int) -> ForwardBatch:
    """One sequence prefilled from position 0 into blocks 0, 1, 2, ..."""
    blocks = -(-num_tokens // block_size)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long), positions=torch.arange(num_tokens),
        slot_mapping=torch.arange(num_tokens), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        logits_indices=torch.tensor([num_tokens - 1]), max_seqlen_q=num_tokens, max_seqlen_k=num_tokens)


def test_shards_sum_to_unsharded_layers(tmp_path):
    """Each rank's sliced attention (Qwen2: q/k/v bias) and MLP give partial outputs that sum to
    the whole layer's, and each rank's KV shard holds exactly its heads of the whole pool."""
    make_model(tmp_path, "qwen2", heads=4, kv_heads=2)
    cfg = ModelConfig.from_pretrained(str(tmp_path), "float32")
    whole = load_model(cfg, torch.device("cpu"))
    tp, bs, t = 2, 8, 11
    batch = _prefill_batch(t, bs)
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pool = torch.zeros(2, 2, bs, cfg.num_kv_heads, cfg.head_dim)        # [blocks, 2, bs, Hkv, D]
    layer = whole.layers[0]
    with torch.inference_mode():
        attn, mlp = layer.self_attn(x, whole.rope, batch, pool), layer.mlp(x)
        attn_sum, mlp_sum = torch.zeros_like(attn), torch.zeros_like(mlp)
        for rank in range(tp):
            shard = shard_model(copy.deepcopy(whole), rank, tp, all_reduce=lambda out: None)
            shard_pool = torch.zeros(2, 2, bs, cfg.num_kv_heads // tp, cfg.head_dim)
            attn_sum += shard.layers[0].self_attn(x, shard.rope, batch, shard_pool)
            mlp_sum += shard.layers[0].mlp(x)
            heads = cfg.num_kv_heads // tp
            torch.testing.assert_close(shard_pool, pool[..., rank * heads:(rank + 1) * heads, :])
    torch.testing.assert_close(attn_sum, attn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp_sum, mlp, rtol=1e-5, atol=1e-5)


def test_heads_not_divisible_by_tp_raise(model_dir):
    """Heads that do not split evenly over tp are refused before any worker starts, with a
    ValueError naming the field; a tp below 1 is refused by EngineConfig."""
    path, _ = model_dir
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by tensor_parallel_size 3"):
        LLM(path, num_blocks=16, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_kv_heads 2 is not divisible by tensor_parallel_size 4"):
        LLM(path, num_blocks=16, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_tp2_chunked_mixed_batch_matches_tp1(model_dir, make_llm, monkeypatch):
    """tp = 2 on gloo, 7-token steps (chunked prefill mixed with decodes), a mixed-length batch
    and an n = 2 request (copy-on-write) decode token for token what tp = 1 and transformers
    decode; close() then stops the worker with exit code 0, and again is a no-op."""
    monkeypatch.setattr(parallel_runner, "SHUTDOWN_TIMEOUT_S", HANG_S)   # a starved worker exits slowly, not killed
    path, hf = model_dir
    kwargs = dict(block_size=8, num_blocks=64, max_num_batched_tokens=7)
    tp1, tp2 = make_llm(path, **kwargs), make_llm(path, tensor_parallel_size=2, **kwargs)
    assert tuple(tp2.engine.runner.kv_cache.shape) == (64, 2, 2, 8, 1, 16)   # 2 kv heads / 2 ranks
    copies = []
    copy_blocks = tp2.engine.runner.copy_blocks
    tp2.engine.runner.copy_blocks = lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    params = [GREEDY, GREEDY, SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)]
    expected = _tokens(tp1.generate(PROMPTS, params))
    assert _tokens(tp2.generate(PROMPTS, params)) == expected
    assert expected[:2] == [hf_greedy(hf, p, 16) for p in PROMPTS[:2]]
    assert copies, "the n = 2 fork should have copied a shared block"
    tp2.close()
    tp2.close()
    assert tp2.engine.runner.worker_exit_codes() == [0]


def test_dead_worker_fails_the_step(model_dir, make_llm):
    """A worker that dies makes the next step raise RuntimeError naming its rank (no hang)."""
    path, _ = model_dir
    llm = make_llm(path, block_size=8, num_blocks=16, tensor_parallel_size=2)
    os.kill(llm.engine.runner.worker_pids()[0], signal.SIGKILL)
    deadline = time.monotonic() + HANG_S
    while llm.engine.runner.worker_exit_codes() == [None]:
        assert time.monotonic() < deadline, "the killed worker did not exit"
        time.sleep(0.01)
    llm.engine.add_request("r", [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="worker rank 1 exited"):
        llm.engine.step()
    llm.engine.abort_request("r")


def test_a_worker_that_stops_answering_breaks_the_engine_within_its_timeout(model_dir, make_llm):
    """A worker that stops answering (SIGSTOP) holds the step only for --tensor-parallel-timeout-s:
    the step raises RunnerBroken naming the flag, which safe_step passes on (the engine is done:
    a node ends and the router moves its requests) instead of failing the requests and stepping
    again; a later step fails at once, and close() kills the worker."""
    path, _ = model_dir
    llm = make_llm(path, block_size=8, num_blocks=16, tensor_parallel_size=2, tensor_parallel_timeout_s=2.0)
    runner = llm.engine.runner
    (pid,) = runner.worker_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        llm.engine.add_request("r", [1, 2, 3], GREEDY)
        with pytest.raises(RunnerBroken, match="tensor-parallel-timeout-s 2"):
            llm.engine.safe_step()
        with pytest.raises(RunnerBroken, match="out of step"):
            llm.engine.safe_step()
        llm.engine.abort_request("r")
        llm.close()
        assert runner.worker_exit_codes() == [-signal.SIGKILL]
    finally:
        if runner.worker_exit_codes() == [None]:
            os.kill(pid, signal.SIGCONT)


def test_tensor_parallel_timeout_must_be_positive():
    """A tensor-parallel timeout of 0 s is refused by EngineConfig."""
    with pytest.raises(ValueError, match="tensor_parallel_timeout_s"):
        EngineConfig(tensor_parallel_timeout_s=0.0)


_ORPHAN = """
import os, signal, sys
from engine import LLM
llm = LLM(sys.argv[1], block_size=8, num_blocks=16, tensor_parallel_size=2)
print(*llm.engine.runner.worker_pids(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_exit_when_rank0_dies(model_dir):
    """If rank 0's process is killed without closing, its workers exit on their own."""
    path, _ = model_dir
    out = subprocess.run([sys.executable, "-c", _ORPHAN, path], capture_output=True, text=True, timeout=HANG_S)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stderr
    deadline = time.monotonic() + HANG_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"    # a zombie has exited
    except FileNotFoundError:
        return False
