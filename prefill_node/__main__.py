"""python -m prefill_node --router tcp://HOST:PORT --node-id prefill-0 [engine flags]"""
from engine.node_runtime import main
from prefill_node.service import PrefillService

if __name__ == "__main__":
    main("prefill", PrefillService)
