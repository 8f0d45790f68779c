"""deploy/k8s is a template (no live cluster here): its manifests parse, reference each other
consistently, and every flag a pod passes to pdserve is one pdserve's own parser accepts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from node_shell.config import NodeConfig  # noqa: E402
from router.launcher import parse_up  # noqa: E402

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# what Kubernetes puts in for the $(VAR) references of a pod's args
POD_VALUES = {"POD_NAME": "pdserve-decode-6f9c7d5b8-x2x7q", "POD_IP": "10.1.2.3"}


def _objects() -> dict[tuple[str, str], dict]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _container(objects: dict, name: str) -> dict:
    (container,) = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return container


def _args(container: dict) -> list[str]:
    """The pod's args with Kubernetes' $(VAR) expansion, from the container's own env."""
    env = {e["name"] for e in container.get("env", [])}
    expanded = []
    for arg in container["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{arg} names {var}, not in the container's env"
            arg = arg.replace(f"$({var})", POD_VALUES[var])
        expanded.append(arg)
    return expanded


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_kustomization_lists_every_manifest():
    """`kubectl apply -k deploy/k8s` applies every file here."""
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def test_router_flags_parse_and_its_ports_are_served_and_scraped():
    """The router's args parse as `pdserve router`; its Service exposes the API and control ports
    they bind, and Prometheus is told to scrape /metrics on the API port."""
    objects = _objects()
    router = _container(objects, "pdserve-router")
    assert router["command"] == ["pdserve", "router"]
    config = parse_up(["up", *_args(router), "--prefill", "0", "--decode", "0"]).router
    control_port = int(config.control_endpoint.rsplit(":", 1)[1])
    assert config.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"http": config.port, "control": control_port}
    services = {p["name"]: p["port"] for name in ("pdserve-router", "pdserve-router-control")
                for p in objects[("Service", name)]["spec"]["ports"]}
    assert services == ports
    annotations = objects[("Deployment", "pdserve-router")]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(config.port),
                           "prometheus.io/path": "/metrics"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_node_flags_parse_and_reach_the_router_service(role):
    """Each pool is its own Deployment; its args build a valid NodeConfig whose router endpoint is
    the control Service's port, which routes to the router pod, and a decode pod advertises its pod
IP on its KV port."""
    objects = _objects()
    container = _container(objects, f"pdserve-{role}")
    assert container["command"] == ["pdserve", role]
    config = NodeConfig.from_argv(f"pdserve {role}", _args(container))
    service = objects[("Service", "pdserve-router-control")]
    control = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "control")
    assert config.router == f"tcp://{service['metadata']['name']}:{control}"
    assert _routes_to(objects, service, "pdserve-router")
    assert config.node_id == POD_VALUES["POD_NAME"] and config.p2p_host == POD_VALUES["POD_IP"]
    if role == "decode":
        kv_port = int(config.kv_bind.rsplit(":", 1)[1])
        assert [p["containerPort"] for p in container["ports"]] == [kv_port]
        assert config.kv_advertised(config.kv_bind) == f"tcp://{POD_VALUES['POD_IP']}:{kv_port}"


def test_every_pod_takes_the_cluster_secret_from_the_secret_in_its_environment():
    """Router and nodes read $PDSERVE_CLUSTER_SECRET from the one Secret, a key it holds; no
    pod passes a secret on its command line."""
    objects = _objects()
    secret = objects[("Secret", "pdserve-cluster")]
    for name in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        container = _container(objects, name)
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in container["env"]}
        ref = env["PDSERVE_CLUSTER_SECRET"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        assert not any("secret" in arg for arg in container["args"])
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert _flag(container["args"], "--model").startswith(tuple(mounts))


def test_the_router_is_ready_when_it_can_serve_and_the_nodes_reach_it_before():
    """The router's readiness probe is /health on the API port (200 once both pools have a live
    node: tests/router/test_router_control_plane.py); the client Service routes only to a ready
    router, the control Service to one not ready yet too: the nodes must reach it to make it
    ready (they reached it through the client Service, which no router would ever enter)."""
    objects = _objects()
    probe = _container(objects, "pdserve-router")["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/health", "http")
    clients, control = objects[("Service", "pdserve-router")], objects[("Service", "pdserve-router-control")]
    assert [p["name"] for p in clients["spec"]["ports"]] == ["http"]
    assert not clients["spec"].get("publishNotReadyAddresses", False)
    assert [p["name"] for p in control["spec"]["ports"]] == ["control"]
    assert control["spec"]["publishNotReadyAddresses"] is True
    assert _routes_to(objects, clients, "pdserve-router") and _routes_to(objects, control, "pdserve-router")


def _routes_to(objects: dict, service: dict, deployment: str) -> bool:
    """Whether the Service's selector picks the Deployment's pods."""
    labels = objects[("Deployment", deployment)]["spec"]["template"]["metadata"]["labels"]
    return service["spec"]["selector"].items() <= labels.items()
