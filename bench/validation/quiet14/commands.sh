#!/bin/bash
# quiet14 (session 22): the profile and the 18 points, then calibrate and validate (bench/validation/quiet_set.sh)
bash bench/validation/quiet_set.sh quiet14 '20261203-[12]*' bench/validation/quiet8 'trace_sharegpt_*'
