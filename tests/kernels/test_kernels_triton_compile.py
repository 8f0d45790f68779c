"""Every Triton kernel variant the launchers can pick compiles to a cubin for sm_90 and sm_80."""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from kernels.triton_aot import SHARED_LIMIT, compile_nth, variants

TARGETS = (90, 80)  # H100/H200, A100
VARIANTS = [v.name for v in variants()]


@pytest.fixture(scope="module")
def compiled():
    """All (variant, target) compiles in worker processes (spawned: no forked OpenMP state)."""
    jobs = [(i, cc) for cc in TARGETS for i in range(len(VARIANTS))]
    workers = max(2, min(8, os.cpu_count() or 2))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {job: pool.submit(compile_nth, *job) for job in jobs}
        return {job: _outcome(f) for job, f in futures.items()}


def _outcome(future):
    try:
        return future.result()
    except RuntimeError as e:
        return str(e)


def test_every_launcher_config_is_listed():
    """The variant list covers every kernel: attention, merge, store_kv and row copy."""
    kinds = {name.split("-")[0] for name in VARIANTS}
    assert kinds == {"attention", "reduce", "store_kv", "copy_rows"}
    assert len(VARIANTS) == len(set(VARIANTS))


@pytest.mark.parametrize("cc", TARGETS)
@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=VARIANTS)
def test_variant_compiles_for_target(compiled, index, cc):
    """The variant compiles to a cubin and fits the target's shared memory per block."""
    result = compiled[(index, cc)]
    assert not isinstance(result, str), f"{VARIANTS[index]} failed for sm_{cc}: {result}"
    assert result.has_cubin
    assert result.shared <= SHARED_LIMIT[cc], f"{result.shared} bytes of shared memory > sm_{cc} limit"
