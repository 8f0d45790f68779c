"""bench/transfer_batch_cost.py: its batches land whole through a real ReceiverCore, as many blocks a
batch as the batch size allows (capped at MAX_BATCH_BLOCKS), every figure a positive time."""
from bench.transfer_batch_cost import batch_cost
from pdwire.messages import MAX_BATCH_BLOCKS


def test_batch_cost_lands_batches_of_the_asked_size():
    small = batch_cost(block_size=16, batch_bytes=2 << 20, rounds=9, num_blocks=64)     # 0.5 MiB blocks: 4 a batch
    capped = batch_cost(block_size=16, batch_bytes=128 << 20, rounds=9, num_blocks=64)
    assert small["block_mib"] == capped["block_mib"] == 0.5
    assert small["blocks_a_batch"] == 4 and capped["blocks_a_batch"] == MAX_BATCH_BLOCKS     # one batch: every block
    for c in (small, capped):
        assert all(c[call + mode] > 0 for call in ("landing", "landed") for mode in ("", "_cold", "_warm"))
