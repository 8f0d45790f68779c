#!/bin/bash
# --long-prefill-token-threshold 256 on the mixed workload (session 25, the AVX2-only EPYC), from the repository root
# 1. two cores, unpinned, against the same server without the cap, alternating (compare_ab.sh's loop):
#    python -m bench.serving compare --workload mixed --rates 0.25,0.5 --systems pdserve-colocated --num-requests 24 \
#        --output-cap 256 --deadline-s 240 --no-publish --pdserve-flags "--long-prefill-token-threshold $cap"   # cap 0, 256, 0, 256
# 2. one pinned core, as quiet15's colocated points (bench/validation/quiet15), with the cap:
python -m bench.simulate measure --workload mixed --systems colocated --rates 0.25,0.5 --num-requests 24 --output-cap 256 \
    --deadline-s 240 --pdserve-flags "--long-prefill-token-threshold 256"
# 3. the simulator: predicted from quiet15's uncapped run, then validated on the capped one (quiet15's calibration, /tmp/q15_cal_kind.json)
PYTHONPATH=. python bench/validation/cap256/whatif.py /tmp/q15_cal_kind.json
python -m bench.simulate validate bench/validation/cap256/simulate_measured_mixed_20261204-123720.json --profile /tmp/q15_cal_kind.json --node-speed kind
