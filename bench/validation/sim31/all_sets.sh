#!/bin/bash
# sim31: the quiet sets (quiet12-14 on the Xeon, quiet15-18 on the AVX2-only EPYC, quiet19-23 on the Zen 4; quiet23, of
# 72 requests a point, added in session 32: bench/validation/sim32), each
# profile's step cost fitted again as pdplan/profile.py fits now, calibrated on its ShareGPT-like file and validated on
# all three, node-priced by kind of step (as bench/validation/quiet_set.sh and sim27/knee.sh do), with the code of the
# working tree. From the repository root:
#   O=bench/validation/sim31/base bash bench/validation/sim31/all_sets.sh
#   python bench/validation/sim24/summary.py bench/validation/sim31/base/validate_*
export PYTHONPATH=.
PY=${PY:-.venv/bin/python}
O=${O:?O: the output folder}
T=/tmp/${O//\//_}
mkdir -p $O
X=bench/validation/quiet8 E=bench/validation/trace26
. bench/validation/run_set.sh
run quiet12 $X & run quiet13 $X & wait
run quiet14 $X & run quiet15 $E & wait
run quiet16 $E & run quiet17 $E & wait
run quiet18 $E & run quiet19 $E & wait
run quiet20 $E & run quiet21 $E & wait
run quiet22 $E & run quiet23 $E & wait
