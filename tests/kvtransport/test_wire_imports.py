"""The wire vocabulary and the router's disaggregated path import without torch (a fresh process)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports_torch(modules: str) -> bool:
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_pdwire_imports_no_torch():
    """Every pdwire module parses messages without loading torch."""
    assert not _imports_torch("pdwire.schema, pdwire.sampling_params, pdwire.outputs, pdwire.block_hash, "
                              "pdwire.handshake, pdwire.messages, pdwire.control")


def test_router_disaggregated_imports_no_torch():
    """The router's disaggregated backend, control server and the node-network session are torch-free."""
    assert not _imports_torch("pdwire, router.cluster.disaggregated, kvtransport.framing, kvtransport.session")


def test_package_faces_are_light():
    """`import engine` and `import kvtransport` load no torch; their heavy names load on first use."""
    assert not _imports_torch("engine, kvtransport")


def test_top_level_names_are_ours():
    """Each top-level package resolves to this checkout and no other installed distribution claims it."""
    import importlib
    import importlib.metadata
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    claims = importlib.metadata.packages_distributions()
    for name in names:
        assert set(claims.get(name, [])) <= {"pdserve"}, (name, claims[name])
        assert Path(importlib.import_module(name).__file__).resolve().is_relative_to(ROOT), name


def test_a_nodes_config_takes_the_transports_defaults_without_torch():
    """node_shell.config (every node's CLI) loads no torch, and its --kv-payload-wait-s default is
    the one constant torch_dist waits by (pdwire.messages.PAYLOAD_WAIT_S), not a copy of it."""
    assert not _imports_torch("node_shell.config")
    code = ("import dataclasses, inspect; from node_shell.config import NodeConfig; "
            "from kvtransport.torch_dist import DistReceiver; from pdwire.messages import PAYLOAD_WAIT_S; "
            "d = {f.name: f.default for f in dataclasses.fields(NodeConfig)}['kv_payload_wait_s']; "
            "print(d is PAYLOAD_WAIT_S is inspect.signature(DistReceiver).parameters['payload_wait_s'].default)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
