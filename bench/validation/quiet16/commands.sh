#!/bin/bash
# quiet16 (session 26, the AVX2-only AMD EPYC): the profile and the 18 points, then calibrate and validate with this
# CPU's own front-end traces, all of them (bench/validation/trace26; bench/validation/quiet_set.sh)
bash bench/validation/quiet_set.sh quiet16 '20261204-1[45]*' bench/validation/trace26
