#!/bin/bash
# quiet23 (session 32, the AMD EPYC Zen 4 of quiet19-22; the front end's slopes from trace26 as quiet20-22's): a twelfth
# set, the serving code of quiet21 and quiet22, with three times the requests a point (72; RAG 60) so that a point's
# TTFT p90 is not set by its two or three slowest requests (bench/README.md, sim32); nothing else running.
N=72 NRAG=60 bash bench/validation/quiet_set.sh quiet23 '20261205-0[5-8]*' bench/validation/trace26
