#!/bin/bash
# quiet20 (session 29, the AMD EPYC Zen 4 of quiet19; the front end's slopes from the AVX2-only EPYC's traces,
# trace26): a ninth set, the first measured with a CPU engine keeping its steps' memory (engine/step_memory.py:
# float32 prefill steps ~20% faster) and the bf16 attention's look-ahead (bf16 only: these runs are float32),
# code 4dc7638, nothing else running; validate_*.txt here are from that code.
bash bench/validation/quiet_set.sh quiet20 '20261204-23*' bench/validation/trace26
