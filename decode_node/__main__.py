"""python -m decode_node --router tcp://HOST:PORT --node-id decode-0 [--kv-bind tcp://127.0.0.1:0] [engine flags]"""
import logging

from decode_node.service import DecodeService
from engine.node_config import NodeConfig
from engine.node_runtime import run

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    run(DecodeService(NodeConfig.from_argv("python -m decode_node")))
