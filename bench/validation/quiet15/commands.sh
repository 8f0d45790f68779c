#!/bin/bash
# quiet15 (session 25, the AVX2-only AMD EPYC): the profile and the 18 points, every helper stopped, from the repository root with the venv active
export PYTHONPATH=.
L=bench/results/quiet15_plan.log
P='--model bench/.cache/serving-llama-58m --dtype float32 --kv-cache-gib 2 --max-num-seqs 64 --max-num-batched-tokens 2048'
echo "=== $(date -u +%T) profile" >> $L
bash -c "OMP_NUM_THREADS=1 exec taskset -c 1 python -m router.launcher profile $P --out bench/profiles/cpu_1core_llama58m_quiet15.json" >> $L 2>&1
echo "=== $(date -u +%T) measure sharegpt" >> $L
python -m bench.simulate measure --workload sharegpt --rates 0.5,1 --num-requests 24 --output-cap 256 --deadline-s 200 >> $L 2>&1
echo "=== $(date -u +%T) measure mixed" >> $L
python -m bench.simulate measure --workload mixed --rates 0.25,0.5 --num-requests 24 --output-cap 256 --deadline-s 240 >> $L 2>&1
echo "=== $(date -u +%T) measure rag" >> $L
python -m bench.simulate measure --workload rag --rates 0.15,0.3 --num-requests 20 --output-cap 256 --deadline-s 300 >> $L 2>&1
echo "=== $(date -u +%T) done" >> $L

# then calibrate and validate (files beside this one):
V=bench/validation/quiet15
mkdir -p $V
SH=$(ls -t bench/results/simulate_measured_sharegpt_20261204-1*.json | head -1)
MX=$(ls -t bench/results/simulate_measured_mixed_20261204-1*.json | head -1)
RG=$(ls -t bench/results/simulate_measured_rag_20261204-1*.json | head -1)
cp $SH $MX $RG $V/
SH=$V/$(basename $SH); MX=$V/$(basename $MX); RG=$V/$(basename $RG)
PR=bench/profiles/cpu_1core_llama58m_quiet15.json
T="--front-from bench/validation/quiet8/trace_sharegpt_* --beside-from bench/validation/quiet8/trace_rag_*"
python -m bench.simulate calibrate $SH --profile $PR --out /tmp/q15_cal.json $T > $V/calibrate_raw.txt 2>&1 &
python -m bench.simulate calibrate $SH --profile $PR --out /tmp/q15_cal_kind.json $T --node-speed kind > $V/calibrate_kind.txt 2>&1 &
wait
python -m bench.simulate validate $SH $MX $RG --profile /tmp/q15_cal.json > $V/validate_quiet15_x.txt 2>&1 &
python -m bench.simulate validate $SH $MX $RG --profile /tmp/q15_cal_kind.json --node-speed kind > $V/validate_quiet15_nodespeed_kind_kindcal.txt 2>&1 &
wait
echo done
