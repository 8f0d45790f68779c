#!/bin/bash
# quiet19 (session 28, an AMD EPYC Zen 4: AVX-512 with AVX512-BF16; the front end's slopes from the AVX2-only EPYC's
# traces, trace26): an eighth set, the first measured with the sequences term's floor
# (pdplan/profile.py knee_seqs; the profile's fit picked knee 6), as quiet17 and quiet18 (bench/validation/quiet_set.sh),
# 19:40-20:14 UTC, nothing else running; validate_*.txt here are from that code (15 of 18). With the unpinned
# processes' CPU per second too (calibrate.py floating_cpu): bench/validation/sim28/validate_quiet19.txt
bash bench/validation/quiet_set.sh quiet19 '20261204-[12]*' bench/validation/trace26
