"""Tensor parallelism (Megatron style) for the engine, applied from outside the model.

    sharding.py      shard_model: slice a loaded CausalLM to one rank's heads and MLP columns;
                     RowParallelLinear (all-reduce); check_shardable (ValueError naming the field)
    group.py         TPGroup: TCPStore on loopback, gloo control group, gloo/NCCL compute group
    step_message.py  a step (ForwardBatch + block ops) or a block gather as two int64 broadcasts,
                     then the scatter / gather of block heads they announce
    block_log.py     BlockLog: rank 0's block ops (and written blocks) the workers have yet to replay
    worker.py        ranks 1..tp-1: a subprocess each, running rank 0's messages on its shard
    runner.py        TPModelRunner (rank 0, ModelRunner's interface, plus gather_blocks /
                     write_blocks for blocks that travel between nodes with every kv head),
                     make_runner, close_runner
"""
from engine.parallel.runner import TPModelRunner, close_runner, make_runner
from engine.parallel.sharding import RowParallelLinear, check_shardable, shard_model

__all__ = ["TPModelRunner", "close_runner", "make_runner", "RowParallelLinear", "check_shardable",
           "shard_model"]
