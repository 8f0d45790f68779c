#!/bin/bash
# quiet22 (session 31, the AMD EPYC Zen 4 of quiet19-21; the front end's slopes from trace26 as quiet20-21's): an
# eleventh set, the serving code of quiet21 (9736707: only the landing copy's C refactored since, the same speed), so
# also a repeat of quiet21 (bench/validation/sim31/repeatability.py); nothing else running; validate_*.txt here are
# from the simulator with the colocated front end's CPU on its engine's core (pdplan/colocated.py, session 31).
bash bench/validation/quiet_set.sh quiet22 '20261205-0[456]*' bench/validation/trace26
