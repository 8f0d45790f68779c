#!/usr/bin/env bash
# GPU check for kernels/ (under 8 minutes): the kernel tests on CUDA (Triton vs the
# plain-PyTorch reference) and the engine on CUDA against transformers (tests/gpu/), then
# bench/kernel_bench_gpu.py (JSON in bench/results/).
# Without a usable CUDA device it says so and exits 0.
#
#   bash bench/gpu_check.sh            # PY=/path/to/python to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_DEFAULT_FP_FUSION=1

cuda_ok() { "$1" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
PY_CHOSEN=""
for candidate in ${PY:-} .venv/bin/python python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && cuda_ok "$candidate"; then PY_CHOSEN=$candidate; break; fi
done
if [ -z "$PY_CHOSEN" ]; then
  echo "gpu_check: SKIPPED - no python here has torch + triton with a visible CUDA device."
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  exit 0
fi
echo "gpu_check: using $PY_CHOSEN"
"$PY_CHOSEN" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
mkdir -p bench/results
status=0
start=$SECONDS

if "$PY_CHOSEN" -c "import pytest" 2>/dev/null; then
  echo "== kernel and engine tests on CUDA (CPU kernel cases too) =="
  timeout 300 "$PY_CHOSEN" -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/gpu/ tests/kernels/test_kernels_cpu.py 2>&1 | tee bench/results/gpu_check_tests.log | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: TESTS FAILED (log: bench/results/gpu_check_tests.log)"; status=1; }
else
  echo "gpu_check: pytest is not installed for $PY_CHOSEN; tests skipped"; status=1
fi
echo "== tests took $((SECONDS - start)) s =="

echo "== kernel benchmark =="
left=$((470 - (SECONDS - start)))
quick=""; [ "$left" -lt 200 ] && quick="--quick"
timeout "$((left > 60 ? left : 60))" "$PY_CHOSEN" bench/kernel_bench_gpu.py $quick || { echo "gpu_check: BENCHMARK FAILED or timed out"; status=1; }
echo "gpu_check: done in $((SECONDS - start)) s, status $status"
exit $status
