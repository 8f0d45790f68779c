#!/bin/bash
# quiet17 (session 26, the AVX2-only AMD EPYC): a sixth set, as quiet16 (bench/validation/quiet_set.sh), then the
# misses jittered (validate --jitter 10 --node-speed kind: jitter_quiet17.txt)
bash bench/validation/quiet_set.sh quiet17 '20261204-1[56]*' bench/validation/trace26
python -m bench.simulate validate bench/validation/quiet17/simulate_measured_*.json --profile /tmp/q17_cal_kind.json \
    --node-speed kind --jitter 10 > bench/validation/quiet17/jitter_quiet17.txt
