#!/bin/bash
# quiet24 (session 32, the Zen 4, the serving code of quiet21-23): quiet23's ShareGPT-like and mixed points again, 72
# requests a point (the same requests and arrival times), no RAG (time); a repeat of quiet23 (bench/README.md, sim32).
N=72 RAG=0 bash bench/validation/quiet_set.sh quiet24 '20261205-0[7-8]*' bench/validation/trace26
