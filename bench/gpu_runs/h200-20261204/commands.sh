#!/bin/bash
# pdserve's first runs on a GPU (2026-12-04, session 27): one NVIDIA H200 lent by the device tool, its
# image's python3 (torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0) with pyzmq 27.3.0 added from
# a wheel (the image has none); the host: 16 cores of an Intel Xeon. Run from the repo's root there.

# 16:32 UTC: the CUDA tests (tests/gpu/, tests/kernels/test_kernels_cpu.py) and the kernel benchmark
# -> gpu_check.out, gpu_check_tests.log, kernel_bench_gpu.json (8 test workers: the image has xdist)
PYTEST_ADDOPTS="-n 8" PY=python3 bash bench/gpu_check.sh

# 17:00: the planner's profile of that node as pdserve runs it (100 GiB KV pool, 256 sequences)
# -> bench/profiles/gpu_h200_llama2_7b_measured.json, gpu_profile.log
python3 bench/gpu_profile.py --kv-cache-gib 100 --max-num-seqs 256 --out bench/profiles/gpu_h200_llama2_7b_measured.json
# then, here (session 27, 17:16): its step fitted again from its samples with the tokens term's floor, as
# `pdserve profile` fits since (knee 512; the run had written the linear fit, gpu_profile.log's last line)
python bench/validation/sim27/refit.py bench/profiles/gpu_h200_llama2_7b_measured.json bench/profiles/gpu_h200_llama2_7b_measured.json

# 17:15: where a decode step's time goes, a random Llama-2-7B-shaped model in bfloat16
# -> gpu_step_profile_b{1,4,64}.{json,log} (two earlier runs, 16:47 and 16:57, summed the operators' GPU
# time with their kernels', counting it twice: not kept)
for b in 1 4 64; do c=512; [ $b = 1 ] && c=64
  python3 bench/gpu_step_profile.py --batch $b --context $c --out gpu_step_profile_b$b.json > gpu_step_profile_b$b.log 2>&1
done
