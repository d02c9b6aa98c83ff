"""deploy/k8s: the manifests parse, and probes, ports, flags and discovery names agree."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from deploy_support import (
    K8S_DIR,
    K8S_SCHEMA_VERSION,
    READY_SERVICE,
    admitted_peers,
    container_ports,
    flag,
    grace_s,
    hardening_gaps_k8s,
    image_model_build,
    load_compose,
    load_k8s,
    main_container,
    parse_epd_args,
    with_defaults,
)

from services.common.ports import DEFAULT_ENCODER_PORT, DEFAULT_PD_PORT, LINUX_EPHEMERAL_PORTS
from services.proxy.app import create_app
from services.proxy.config import ProxyConfig

SERVERS = ("pd", "encoder", "proxy")


@pytest.fixture(scope="module")
def docs() -> dict[tuple[str, str], dict]:
    by_key = {}
    for doc in load_k8s():
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in by_key, f"duplicate {key}"
        by_key[key] = doc
    return by_key


def test_the_expected_objects_and_no_namespace(docs):
    assert set(docs) == {
        ("ConfigMap", "epd-config"),
        ("Deployment", "pd"),
        ("Deployment", "encoder"),
        ("Deployment", "proxy"),
        ("Service", "pd-headless"),
        ("Service", "encoder-headless"),
        ("Service", "proxy"),
        ("NetworkPolicy", "encoder-ingress"),
        ("NetworkPolicy", "pd-ingress"),
    }
    for doc in docs.values():
        assert doc["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1")
        assert "namespace" not in doc["metadata"], "manifests are namespace-free (kubectl apply -n NS)"


def test_containers_run_real_cli_commands(docs):
    for name in SERVERS:
        container = main_container(docs[("Deployment", name)])
        assert "command" not in container  # the image's ENTRYPOINT is `epd`
        args = parse_epd_args(container["args"])
        assert args.command == name and args.host == "0.0.0.0"
        assert container["envFrom"] == [{"configMapRef": {"name": "epd-config"}}]


def test_proxy_metrics_are_scraped_on_its_metrics_port(docs):
    """Security review: Prometheus scrapes the proxy's --metrics-port with the token, not its public port."""
    deployment = docs[("Deployment", "proxy")]
    container = main_container(deployment)
    port = flag(container["args"], "--metrics-port")
    assert port is not None and int(port) != int(flag(container["args"], "--port"))
    assert container_ports(container)["metrics"] == int(port)
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == port


def test_grpc_probes(docs):
    for name in ("pd", "encoder"):
        container = main_container(docs[("Deployment", name)])
        port = int(flag(container["args"], "--port"))
        assert container_ports(container)["grpc"] == port
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": READY_SERVICE[name]}
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": ""}
        # Loading weights happens before the port opens: liveness waits for startup.
        assert container["startupProbe"]["grpc"] == {"port": port, "service": ""}
        assert container_ports(container)["metrics"] == int(flag(container["args"], "--metrics-port"))
        annotations = docs[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == flag(container["args"], "--metrics-port")


def test_proxy_probes(docs):
    container = main_container(docs[("Deployment", "proxy")])
    port = int(flag(container["args"], "--port"))
    assert container_ports(container)["http"] == port
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert container["startupProbe"]["tcpSocket"] == {"port": port}


def test_proxy_liveness_probe_is_http_not_tcp(docs):
    """Security review: a TCP probe passes while the proxy's event loop is wedged.

    Liveness asks the proxy's own liveness endpoint over HTTP (it must not be
    ``/health``, or a PD outage restarts every proxy).
    """
    container = main_container(docs[("Deployment", "proxy")])
    port = int(flag(container["args"], "--port"))
    probe = container["livenessProbe"]
    assert "tcpSocket" not in probe
    assert probe["httpGet"] == {"path": "/health/live", "port": port}
    assert probe["timeoutSeconds"] > 0
    routes = {route.path for route in create_app(ProxyConfig(model="tiny")).routes}
    assert probe["httpGet"]["path"] in routes


def test_resources_and_grace(docs):
    for name in SERVERS:
        deployment = docs[("Deployment", name)]
        spec = deployment["spec"]["template"]["spec"]
        container = main_container(deployment)
        for part in [container, *spec.get("initContainers", [])]:
            assert {"cpu", "memory"} <= set(part["resources"]["requests"]), part["name"]
            assert "memory" in part["resources"]["limits"], part["name"]
        assert spec["terminationGracePeriodSeconds"] > grace_s(container["args"]), name
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_headless_services_route_to_the_right_pods_and_ports(docs):
    proxy_args = main_container(docs[("Deployment", "proxy")])["args"]
    for name in ("pd", "encoder"):
        deployment = docs[("Deployment", name)]
        service = docs[("Service", f"{name}-headless")]["spec"]
        assert service["clusterIP"] == "None"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = container_ports(main_container(deployment))
        for port in service["ports"]:
            assert port["port"] == ports[port["targetPort"]]
        grpc_port = ports["grpc"]
        # The proxy discovers instances by resolving the headless name.
        assert flag(proxy_args, f"--{name}") == f"{name}-headless:{grpc_port}"


def test_proxy_service(docs):
    service = docs[("Service", "proxy")]["spec"]
    deployment = docs[("Deployment", "proxy")]
    assert service.get("type", "ClusterIP") == "ClusterIP"
    assert service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["ports"]
    assert container_ports(main_container(deployment))[port["targetPort"]] == port["port"]


def test_every_pod_serves_the_model_built_into_the_image(docs):
    """The same checkpoint as compose, from the image: no init step, no shared volume."""
    _, image_model_dir = image_model_build()
    assert docs[("ConfigMap", "epd-config")]["data"]["EPD_MODEL"] == image_model_dir
    compose_env = load_compose()["services"]["pd"]["environment"]
    assert with_defaults(compose_env["EPD_MODEL"]) == image_model_dir
    for name in SERVERS:
        spec = docs[("Deployment", name)]["spec"]["template"]["spec"]
        assert "initContainers" not in spec
        assert "models" not in {v["name"] for v in spec["volumes"]}


def test_crashed_containers_restart(docs):
    """A Deployment's pods restart their containers (``Always``), and nothing a restart waits on runs first."""
    for name in SERVERS:
        spec = docs[("Deployment", name)]["spec"]["template"]["spec"]
        assert spec.get("restartPolicy", "Always") == "Always"
        assert "initContainers" not in spec


def test_kustomization_lists_every_manifest_and_the_image(docs):
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    manifests = sorted(p.name for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert kustomization["resources"] == manifests
    (image,) = kustomization["images"]
    used = set()
    for name in SERVERS:
        spec = docs[("Deployment", name)]["spec"]["template"]["spec"]
        used |= {c["image"].split(":")[0] for c in [*spec["containers"], *spec.get("initContainers", [])]}
    assert used == {image["name"]}


def _kustomize() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian: apt-get install kubernetes-client)")
    result = subprocess.run([kubectl, "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_kubectl_kustomize_renders_every_object():
    rendered = _kustomize()
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == {
        (d["kind"], d["metadata"]["name"]) for d in load_k8s()
    }


def _validate(doc: dict) -> None:
    """Strict validation against the Kubernetes OpenAPI schemas shipped by ``kubernetes-validate``."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    doc = {k: v for k, v in doc.items() if k != "__file__"}
    kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)


def test_manifests_validate_against_the_kubernetes_schemas():
    for doc in load_k8s():
        _validate(doc)


def test_rendered_objects_validate_against_the_kubernetes_schemas():
    for doc in _kustomize():
        _validate(doc)


def test_the_schema_check_catches_a_broken_object(docs):
    import copy

    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    broken = copy.deepcopy(docs[("Deployment", "pd")])
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


@pytest.mark.parametrize(("name", "allowed"), [("encoder", {"proxy"}), ("pd", {"proxy", "encoder"})])
def test_network_policies_admit_only_the_expected_peers_to_grpc(docs, name, allowed):
    # gRPC (the push port included: one port per service) from the allowed pods only;
    # metrics from anywhere (Prometheus), where the token guards it.
    assert admitted_peers(docs, name) == {"grpc": allowed, "metrics": {"anyone"}}


def test_every_server_reads_the_internal_token_from_the_secret(docs):
    config = docs[("ConfigMap", "epd-config")]["data"]
    assert config["EPD_METRICS_REQUIRE_TOKEN"] == "1"
    token_dir, token_file = config["EPD_INTERNAL_TOKEN_FILE"].rsplit("/", 1)
    for name in SERVERS:
        spec = docs[("Deployment", name)]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in main_container(docs[("Deployment", name)])["volumeMounts"]}
        secret = volumes["internal-token"]["secret"]
        assert secret["secretName"] == "epd-internal-token"
        assert mounts["internal-token"] == {"name": "internal-token", "mountPath": token_dir, "readOnly": True}
        assert token_file == "token"  # the key `kubectl create secret ... --from-literal=token=...` makes
        # Readable by the group the pod runs with (fsGroup), by nobody else.
        assert secret["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] == 10001


def test_default_grpc_ports_are_outside_the_ephemeral_range(docs):
    """Security review: every port the manifests name lies outside Linux's ephemeral range."""
    named = []
    for name in SERVERS:
        container = main_container(docs[("Deployment", name)])
        named += [int(flag(container["args"], "--port")), *container_ports(container).values()]
        named += [
            int(address.rsplit(":", 1)[1])
            for flag_name in ("--pd", "--encoder")
            if (address := flag(container["args"], flag_name))
        ]
    for kind, name in docs:
        if kind == "Service":
            named += [port["port"] for port in docs[(kind, name)]["spec"]["ports"]]
    assert DEFAULT_ENCODER_PORT in named and DEFAULT_PD_PORT in named
    assert not [port for port in named if port in LINUX_EPHEMERAL_PORTS]


def test_encoders_push_only_to_the_pds_the_proxy_routes_to(docs):
    encoder = main_container(docs[("Deployment", "encoder")])["args"]
    proxy = main_container(docs[("Deployment", "proxy")])["args"]
    allowed = parse_epd_args(encoder).pd_allow.split(",")
    assert allowed == flag(proxy, "--pd").split(",") and "*" not in allowed
    # The name is the PDs' headless Service on their gRPC port: it resolves to the PD pods the proxy sees.
    host, port = allowed[0].split(":")
    service = docs[("Service", host)]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"]["app.kubernetes.io/component"] == "pd"
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]


def test_every_pod_is_hardened(docs):
    """Non-root, RuntimeDefault seccomp, no privilege escalation, every capability dropped, a read-only root
    file system with size-limited emptyDirs where the services write, and a memory limit."""
    deployments = [doc for (kind, _), doc in docs.items() if kind == "Deployment"]
    assert len(deployments) == 3
    assert [gap for deployment in deployments for gap in hardening_gaps_k8s(deployment)] == []


def test_the_hardening_check_catches_a_gap(docs):
    import copy

    weakened = copy.deepcopy(docs[("Deployment", "proxy")])
    main_container(weakened)["securityContext"]["readOnlyRootFilesystem"] = False
    del weakened["spec"]["template"]["spec"]["securityContext"]["seccompProfile"]
    assert hardening_gaps_k8s(weakened) == [
        "proxy: no RuntimeDefault seccomp profile",
        "proxy: writable root file system",
    ]
