"""A CPU engine keeps the memory its steps free mapped for the next step (engine/step_memory.py):
glibc's heap settings, process-wide, set when the engine is built."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import torch

from engine.config import ModelConfig
from engine.step_memory import step_bytes

HANG_S = 300        # bounds a hang only: a starved machine takes long to import torch

# Build an engine whose steps may hold ~200 MB (2**16 tokens of the test model), then malloc, write
# and free 48 frames of 2 MiB (96 MiB: more than the 64 MiB a trim threshold gets without the step's
# size) four times; print each round's minor page faults. glibc's defaults unmap or trim freed
# frames (each faults again: 512 times in 4 KiB pages, at least once in huge pages); kept, the
# rounds after the first fault (almost) nothing.
FRAMES = 48
ROUNDS = textwrap.dedent(f"""
    import ctypes, resource, sys
    from engine import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig
    from engine.step_memory import step_bytes
    engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", cache=CacheConfig(num_blocks=64),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=1 << 16)))
    print(step_bytes(engine.model_config, 1 << 16))
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    for _ in range(4):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        frames = [libc.malloc(2 << 20) for _ in range({FRAMES})]
        for p in frames:
            ctypes.memset(p, 1, 2 << 20)
        for p in frames:
            libc.free(p)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
""")


def _fault_rounds(model: str, retain: str) -> tuple[int, list[int]]:
    """(the engine's step bytes, each round's page faults) in a fresh process."""
    env = dict(os.environ, PDSERVE_RETAIN_HEAP=retain)
    proc = subprocess.run([sys.executable, "-c", ROUNDS, model], env=env, capture_output=True, text=True,
                          timeout=HANG_S, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step, *rounds = (int(line) for line in proc.stdout.split())
    return step, rounds


def test_an_engine_keeps_freed_step_memory_mapped(model_dir):
    """Freed memory up to a step's size stays mapped: later rounds fault (almost) nothing, where
    glibc's own settings fault every frame in again."""
    step, kept = _fault_rounds(model_dir[0], "1")
    assert step > FRAMES * (2 << 20), step          # above the 96 MiB freed: the step size keeps them
    assert max(kept[1:]) < FRAMES, kept
    _, default = _fault_rounds(model_dir[0], "0")
    assert min(default[1:]) >= FRAMES, default


def test_step_bytes_bounds_a_step_of_the_bench_model(model_dir):
    """2,048 tokens of the bench model (hidden 512, MLP 1,408, 8 heads of 64) in float32: at least
    its largest activation (the 23 MB gate_up output); twice the tokens twice the bytes, bf16 half."""
    cfg = dataclasses.replace(ModelConfig.from_pretrained(model_dir[0], "float32"), hidden_size=512,
                              intermediate_size=1408, num_heads=8, num_kv_heads=8, head_dim=64)
    assert step_bytes(cfg, 2048) >= 2048 * 2 * 1408 * 4
    assert step_bytes(cfg, 4096) == 2 * step_bytes(cfg, 2048)
    assert step_bytes(dataclasses.replace(cfg, dtype=torch.bfloat16), 2048) == step_bytes(cfg, 2048) // 2
