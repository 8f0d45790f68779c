"""python -m prefill_node --router tcp://HOST:PORT --node-id prefill-0 [engine flags]"""
import logging

from engine.node_config import NodeConfig
from engine.node_runtime import run
from prefill_node.service import PrefillService

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    run(PrefillService(NodeConfig.from_argv("python -m prefill_node")))
