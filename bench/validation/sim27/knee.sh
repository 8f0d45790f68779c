#!/bin/bash
# sim27: the six quiet sets (quiet12-14 on the Xeon, quiet15-17 on the AVX2-only EPYC) with each profile's step cost
# fitted again with the tokens term's floor (pdplan/profile.py knee_tokens; refit.py), then calibrated and
# validated as bench/validation/quiet_set.sh does (--node-speed kind, the front end from each machine's traces, all
# of them). The landed linear price's results: bench/validation/sim26/validate_quiet1[2-6]_all.txt and
# bench/validation/quiet17/validate_quiet17_nodespeed_kind_kindcal.txt. From the repository root:
#   bash bench/validation/sim27/knee.sh && python bench/validation/sim24/summary.py bench/validation/sim27/validate_*
# Session 28 (the sequences term's floor too, knee_seqs, and the unpinned processes' CPU per second; quiet18 and
# quiet19 added): O=bench/validation/sim28 bash ... (its outputs are there; sim27's files are the tokens' floor
# alone, from the code of session 27; commit 7031689's sim28 files the sequences' floor alone)
export PYTHONPATH=.
PY=${PY:-.venv/bin/python}
O=${O:-bench/validation/sim27}
mkdir -p $O
X=bench/validation/quiet8 E=bench/validation/trace26
T=/tmp/${O##*/}
. bench/validation/run_set.sh
run quiet12 $X & run quiet13 $X & wait
run quiet14 $X & run quiet15 $E & wait
run quiet16 $E & run quiet17 $E & wait
[ $O = bench/validation/sim27 ] || { run quiet18 $E & run quiet19 $E & wait; }
# the misses of quiet17 and quiet12, jittered (validate --jitter: sends up to 0.5 ms late, prices up to 1% off; 'maybe'
# where every node-priced figure's range reaches the 20% band)
for s in quiet17 quiet12; do
  $PY -m bench.simulate validate $(ls bench/validation/$s/simulate_measured_*.json) --profile ${T}_${s}_cal.json \
      --node-speed kind --jitter 10 > $O/jitter_$s.txt 2>&1
done
