"""deploy/k8s-epd: the E+P+D overlay renders, validates, and wires proxy, encoders, prefill and decode pods.

The overlay exists only as what kustomize makes of it, so most checks read
``kubectl kustomize deploy/k8s-epd`` (skipped without kubectl, as in
test_k8s.py); the overlay's own files are checked without it.
"""

from __future__ import annotations

import copy
import shutil
import subprocess

import pytest
import yaml
from deploy_support import (
    K8S_EPD_DIR,
    K8S_SCHEMA_VERSION,
    READY_SERVICE,
    admitted_peers,
    component,
    container_ports,
    flag,
    grace_s,
    hardening_gaps_k8s,
    load_k8s,
    main_container,
    parse_epd_args,
)

from services.common.ports import LINUX_EPHEMERAL_PORTS

PD_ROLES = ("prefill", "decode")
SERVERS = ("encoder", *PD_ROLES, "proxy")


def _render() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian: apt-get install kubernetes-client)")
    result = subprocess.run([kubectl, "kustomize", str(K8S_EPD_DIR)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    by_key = {}
    for doc in _render():
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in by_key, f"duplicate {key}"
        by_key[key] = doc
    return by_key


def _args(docs: dict, name: str) -> list[str]:
    return [str(token) for token in main_container(docs[("Deployment", name)])["args"]]


def _schema_validate(doc: dict) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)


def test_the_base_pd_is_replaced_by_prefill_and_decode(rendered):
    assert set(rendered) == {
        ("ConfigMap", "epd-config"),
        ("Deployment", "encoder"),
        ("Deployment", "prefill"),
        ("Deployment", "decode"),
        ("Deployment", "proxy"),
        ("Service", "encoder-headless"),
        ("Service", "prefill-headless"),
        ("Service", "decode-headless"),
        ("Service", "proxy"),
        ("NetworkPolicy", "encoder-ingress"),
        ("NetworkPolicy", "prefill-ingress"),
        ("NetworkPolicy", "decode-ingress"),
    }
    for doc in rendered.values():
        assert "namespace" not in doc["metadata"], "namespace-free, as the base"


def test_rendered_objects_validate_against_the_kubernetes_schemas(rendered):
    for doc in rendered.values():
        _schema_validate(doc)


def test_overlay_files_validate_and_are_all_used():
    kustomization = yaml.safe_load((K8S_EPD_DIR / "kustomization.yaml").read_text())
    listed = {*kustomization["resources"], *(p["path"] for p in kustomization["patches"] if "path" in p)}
    files = {p.name for p in K8S_EPD_DIR.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed - {"../k8s/"} == files and "../k8s/" in listed
    for name in kustomization["resources"]:
        if name.endswith(".yaml"):  # whole objects; the patch file holds fragments
            for doc in yaml.safe_load_all((K8S_EPD_DIR / name).read_text()):
                _schema_validate(doc)
    assert (
        kustomization["images"]
        == yaml.safe_load((K8S_EPD_DIR.parent / "k8s" / "kustomization.yaml").read_text())["images"]
    )


def test_commands_and_routing(rendered):
    args = {name: parse_epd_args(_args(rendered, name)) for name in SERVERS}
    assert {name: a.command for name, a in args.items()} == {
        "encoder": "encoder",
        "prefill": "pd",
        "decode": "pd",
        "proxy": "proxy",
    }
    assert (args["prefill"].role, args["decode"].role) == PD_ROLES
    assert all(a.host == "0.0.0.0" for a in args.values())
    proxy = _args(rendered, "proxy")
    for role, proxy_flag in (("prefill", "--pd"), ("decode", "--decode")):
        # The proxy discovers each role's ready pods through its headless Service, on their gRPC port.
        port = container_ports(main_container(rendered[("Deployment", role)]))["grpc"]
        assert flag(proxy, proxy_flag) == f"{role}-headless:{port}"
    # Encoders push only to the prefill pods, prefill pods push KV only to the decode pods.
    assert args["encoder"].pd_allow.split(",") == flag(proxy, "--pd").split(",")
    assert args["prefill"].decode_allow.split(",") == flag(proxy, "--decode").split(",")
    assert "*" not in args["encoder"].pd_allow and "*" not in args["prefill"].decode_allow


def test_headless_services_select_each_roles_pods(rendered):
    for role in PD_ROLES:
        deployment = rendered[("Deployment", role)]
        service = rendered[("Service", f"{role}-headless")]["spec"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["clusterIP"] == "None"
        assert labels["app.kubernetes.io/component"] == role
        assert service["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = container_ports(main_container(deployment))
        assert {p["targetPort"]: p["port"] for p in service["ports"]} == ports
        assert not [port for port in ports.values() if port in LINUX_EPHEMERAL_PORTS]


def test_probes_and_metricscontainer_ports(rendered):
    for role in PD_ROLES:
        deployment = rendered[("Deployment", role)]
        container = main_container(deployment)
        args = container["args"]
        port = int(flag(args, "--port"))
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": READY_SERVICE["pd"]}
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": ""}
        assert container["startupProbe"]["grpc"] == {"port": port, "service": ""}
        assert container_ports(container) == {"grpc": port, "metrics": int(flag(args, "--metrics-port"))}
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == flag(args, "--metrics-port")
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace_s(args)


def test_prefill_and_decode_pods_are_the_base_pd_but_for_role_andcontainer_ports(rendered):
    """Security context, token mount, resources, probes' timing, image: as the base PD's, so the two
    roles cannot drift from it."""
    (base,) = [d for d in load_k8s() if d["kind"] == "Deployment" and d["metadata"]["name"] == "pd"]

    def normalized(deployment: dict) -> dict:
        doc = copy.deepcopy({k: v for k, v in deployment.items() if k != "__file__"})
        doc["metadata"]["name"] = "X"
        for labels in (
            doc["metadata"]["labels"],
            doc["spec"]["selector"]["matchLabels"],
            doc["spec"]["template"]["metadata"]["labels"],
        ):
            labels["app.kubernetes.io/component"] = "X"
        doc["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] = "X"
        container = main_container(doc)
        container["name"] = container["args"] = "X"
        container["ports"] = [{**p, "containerPort": "X"} for p in container["ports"]]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            container[probe]["grpc"]["port"] = "X"
        return doc

    for role in PD_ROLES:
        assert normalized(rendered[("Deployment", role)]) == normalized(base), role


@pytest.mark.parametrize(
    ("name", "allowed"), [("encoder", {"proxy"}), ("prefill", {"proxy", "encoder"}), ("decode", {"proxy", "prefill"})]
)
def test_network_policies_admit_only_the_expected_peers_to_grpc(rendered, name, allowed):
    assert admitted_peers(rendered, name) == {"grpc": allowed, "metrics": {"anyone"}}


def test_every_policy_names_pods_that_exist(rendered):
    """A policy still naming the base's `pd` pods would admit nobody (and the decode pods' pushes would fail)."""
    components = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for (kind, _), d in rendered.items()
        if kind == "Deployment"
    }
    for (kind, name), doc in rendered.items():
        if kind == "NetworkPolicy":
            peers = [peer for rule in doc["spec"]["ingress"] for peer in rule.get("from", [])]
            assert {component(doc["spec"]), *map(component, peers)} <= components, name


def test_every_rendered_pod_is_hardened(rendered):
    deployments = [doc for (kind, _), doc in rendered.items() if kind == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == set(SERVERS)
    assert [gap for deployment in deployments for gap in hardening_gaps_k8s(deployment)] == []
