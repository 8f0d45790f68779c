#!/bin/bash
# quiet18 (session 27, the AVX2-only AMD EPYC): a seventh set, the first measured with the step model's floor
# (pdplan/profile.py knee_tokens; the profile's fit picked 4), as quiet17 (bench/validation/quiet_set.sh), 18:04-18:41
# UTC; then the misses jittered, and the same profile fitted without the floor (knee 1), calibrated and validated
# alike (validate_quiet18_linear.txt) for the comparison on a set the floor was not chosen on
bash bench/validation/quiet_set.sh quiet18 '20261204-1[89]*' bench/validation/trace26
python -m bench.simulate validate bench/validation/quiet18/simulate_measured_*.json --profile /tmp/q18_cal_kind.json \
    --node-speed kind --jitter 10 > bench/validation/quiet18/jitter_quiet18.txt
python -c "
from dataclasses import replace
from pdplan.profile import Profile, StepCost
p = Profile.load('bench/profiles/cpu_1core_llama58m_quiet18.json')
replace(p, step=StepCost.fit(p.samples, knees=(1,))).save('/tmp/q18_linear.json')"
T='--front-from bench/validation/trace26/trace_* --beside-from bench/validation/trace26/trace_rag_*'
python -m bench.simulate calibrate bench/validation/quiet18/simulate_measured_sharegpt_*.json --profile /tmp/q18_linear.json \
    --out /tmp/q18_linear_cal.json $T --node-speed kind > bench/validation/quiet18/calibrate_linear.txt 2>&1
python -m bench.simulate validate bench/validation/quiet18/simulate_measured_*.json --profile /tmp/q18_linear_cal.json \
    --node-speed kind > bench/validation/quiet18/validate_quiet18_linear.txt
