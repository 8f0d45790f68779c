"""python -m prefill_node --router tcp://HOST:PORT --node-id prefill-0 [engine flags]"""
from node_shell.runtime import main
from prefill_node.service import PrefillService

if __name__ == "__main__":
    main("prefill", PrefillService)
