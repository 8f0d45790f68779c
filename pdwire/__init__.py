"""pdwire: the wire vocabulary every pdserve process shares, on the ground floor.

It depends on nothing heavier than msgpack and numpy (no torch, no engine, no transport), so the
router, a node and a test can all parse a message without loading a model. `engine` and
`kvtransport` import it; it imports neither.

    schema.py           protocol version, limits, field checks, ProtocolError, XferId / BlockHash
    sampling_params.py  SamplingParams (vLLM names), validated; choice_seed for n > 1
    outputs.py          RequestOutput / CompletionOutput (engine: cumulative; router backends: deltas), EngineMetrics
    block_hash.py       chained blake2b block hashes, the same in every process
    handshake.py        KVLayout, PeerIdentity, model_fingerprint, check_compatible (names the field)
    messages.py         KV-transport messages (Hello ... Reserved, Busy) and the envelope codec
    control.py          router <-> node control messages and their codec

Import from the modules; this file imports nothing.
"""
