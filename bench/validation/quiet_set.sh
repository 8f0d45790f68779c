#!/bin/bash
# A quiet validation set (quiet14, quiet15, ...): the profile and the 18 points, every helper stopped, then
# calibrate and validate (files into bench/validation/SET); from the repository root with the venv active.
#   bash bench/validation/quiet_set.sh SET STAMP TRACES [FRONT]   e.g. quiet16 '20261204-14*' bench/validation/trace26
# STAMP: a glob of this run's bench/results/simulate_measured_* time stamps (the newest match is taken).
# TRACES: a folder of `python -m bench.simulate trace` runs of this machine (trace_sharegpt_*, trace_rag_*:
# bench/validation/trace26/commands.sh; another CPU's misprice the front end, bench/validation/sim26), required;
# FRONT: which of them give the front end's and the admission's cost per
# prompt token (default trace_*, all: the RAG trace's 1.8-3.4k-token prompts with the ShareGPT-like ones' 20-700;
# quiet14 and quiet15 were made with 'trace_sharegpt_*', bench/validation/sim26).
# The calibrated profiles go to /tmp/qNN_cal.json and /tmp/qNN_cal_kind.json (NN: the set's number).
# N / NRAG (environment): requests per point, 24 / 20 unless set (quiet23: 72 / 60); the deadlines grow with them.
# RAG=0 (environment): no RAG points (quiet24, a repeat of quiet23's ShareGPT-like and mixed points).
S=$1 STAMP=$2 TRACES=$3 FRONT=${4:-trace_*}
[ -n "$TRACES" ] && ls -d $TRACES/trace_rag_* > /dev/null || { echo "usage: quiet_set.sh SET STAMP TRACES [FRONT]: TRACES, this machine's trace folder, with a trace_rag_* in it" >&2; exit 2; }
export PYTHONPATH=.
L=bench/results/${S}_plan.log
N=${N:-24} NRAG=${NRAG:-20} RAG=${RAG:-1}
P='--model bench/.cache/serving-llama-58m --dtype float32 --kv-cache-gib 2 --max-num-seqs 64 --max-num-batched-tokens 2048'
PR=bench/profiles/cpu_1core_llama58m_$S.json
echo "=== $(date -u +%T) profile" >> $L
bash -c "OMP_NUM_THREADS=1 exec taskset -c 1 python -m router.launcher profile $P --out $PR" >> $L 2>&1
echo "=== $(date -u +%T) measure sharegpt" >> $L
python -m bench.simulate measure --workload sharegpt --rates 0.5,1 --num-requests $N --output-cap 256 --deadline-s $((200 * N / 24)) >> $L 2>&1
echo "=== $(date -u +%T) measure mixed" >> $L
python -m bench.simulate measure --workload mixed --rates 0.25,0.5 --num-requests $N --output-cap 256 --deadline-s $((240 * N / 24)) >> $L 2>&1
[ "$RAG" = 0 ] || { echo "=== $(date -u +%T) measure rag" >> $L
python -m bench.simulate measure --workload rag --rates 0.15,0.3 --num-requests $NRAG --output-cap 256 --deadline-s $((300 * NRAG / 20)) >> $L 2>&1; }
echo "=== $(date -u +%T) done" >> $L

V=bench/validation/$S
C=/tmp/q${S#quiet}_cal
mkdir -p $V
SH=$(ls -t bench/results/simulate_measured_sharegpt_$STAMP.json | head -1)
MX=$(ls -t bench/results/simulate_measured_mixed_$STAMP.json | head -1)
RG=$([ "$RAG" = 0 ] || ls -t bench/results/simulate_measured_rag_$STAMP.json | head -1)
cp $SH $MX $RG $V/
SH=$V/$(basename $SH); MX=$V/$(basename $MX); RG=${RG:+$V/$(basename $RG)}
T="--front-from $TRACES/$FRONT --beside-from $TRACES/trace_rag_*"
python -m bench.simulate calibrate $SH --profile $PR --out $C.json $T > $V/calibrate_raw.txt 2>&1 &
python -m bench.simulate calibrate $SH --profile $PR --out ${C}_kind.json $T --node-speed kind > $V/calibrate_kind.txt 2>&1 &
wait
python -m bench.simulate validate $SH $MX $RG --profile $C.json > $V/validate_${S}_x.txt 2>&1 &
python -m bench.simulate validate $SH $MX $RG --profile ${C}_kind.json --node-speed kind > $V/validate_${S}_nodespeed_kind_kindcal.txt 2>&1 &
wait
echo done
