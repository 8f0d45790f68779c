"""deploy/grafana/pdserve.json: every query of every panel names a series a live `pdserve up` serves."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.builtin import BUILTIN_MODEL_PATH
from tests.router.test_router_disagg_e2e import _wait_healthy

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
_NAME = re.compile(r"\b(?:pdserve|process)_[a-z0-9_]+\b")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variables."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [v["definition"] for v in dash["templating"]["list"] if "definition" in v]


def served_names(text: str) -> set[str]:
    """The series names /metrics serves, and those of families declared with no sample yet (a
    labelled counter before its first event) under the names their samples will have."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names


def test_every_panel_queries_a_pdserve_series():
    """Each panel has a query, and each query names at least one pdserve_* or process_* series."""
    dash = json.loads(DASHBOARD.read_text())
    assert all(p["targets"] for p in dash["panels"])
    assert all(_NAME.search(e) for e in dashboard_queries())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60).read()


def _missing(base: str, wanted: set[str]) -> set[str]:
    """The wanted names /metrics lacks, polled until none or ~30 s (heartbeats bring node series)."""
    for _ in range(150):
        missing = wanted - served_names(_get(f"{base}/metrics").decode())
        if not missing:
            return missing
        time.sleep(0.2)
    return missing


@pytest.mark.skipif(not os.path.isfile(os.path.join(BUILTIN_MODEL_PATH, "config.json")),
                    reason="the built-in model is not built")
def test_dashboard_series_are_on_a_live_pdserve_up(tmp_path):
    """After one request, /metrics of `pdserve up` serves every series the dashboard queries."""
    wanted = {name for e in dashboard_queries() for name in _NAME.findall(e)}
    port = _free_port()
    with open(tmp_path / "pdserve.log", "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "router.launcher", "up", "--port", str(port),
                                 "--kv-cache-gib", "0.05"], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, proc)
        base = f"http://127.0.0.1:{port}"
        _get(f"{base}/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
        assert _missing(base, wanted) == set()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
