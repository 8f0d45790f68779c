"""python -m decode_node --router tcp://HOST:PORT --node-id decode-0 [--kv-bind tcp://127.0.0.1:0] [engine flags]"""
from decode_node.service import DecodeService
from node_shell.runtime import main

if __name__ == "__main__":
    main("decode", DecodeService)
