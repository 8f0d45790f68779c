#!/bin/bash
# quiet15 (session 25, the AVX2-only AMD EPYC): the profile and the 18 points, then calibrate and validate
# (bench/validation/quiet_set.sh)
bash bench/validation/quiet_set.sh quiet15 '20261204-1*' bench/validation/quiet8 'trace_sharegpt_*'
