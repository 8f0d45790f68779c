#!/bin/bash
# quiet21 (session 30, the AMD EPYC Zen 4 of quiet19-20; the front end's slopes from trace26 as quiet20's): a tenth
# set, the first measured with a decode node landing its KV blocks with streaming stores (kvtransport/stream_copy.py),
# code 0bc367c, nothing else running; validate_*.txt here are from that code.
bash bench/validation/quiet_set.sh quiet21 '20261205-0[23]*' bench/validation/trace26
