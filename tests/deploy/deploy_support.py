"""Helpers for the deploy tests: reading deploy/ files and their service commands."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
GPU_COMPOSE_FILE = DEPLOY / "docker-compose.gpu.yml"
EPD_COMPOSE_FILE = DEPLOY / "docker-compose.epd.yml"
K8S_DIR = DEPLOY / "k8s"
K8S_EPD_DIR = DEPLOY / "k8s-epd"
"""The E+P+D overlay; beside the base, not in it (kustomize refuses a base that contains its overlay)."""
DOCKERFILE = DEPLOY / "Dockerfile"

READY_SERVICE = {"pd": "epd.v1.PrefillDecode", "encoder": "epd.v1.Encoder"}
"""gRPC health service name that means "ready", per EPD command."""

GRACE_FLAG = {"pd": "--grace", "encoder": "--grace", "proxy": "--grace"}
"""The flag that sets how long each server drains on SIGTERM."""

DEFAULT_GRACE_S = {"pd": 30.0, "encoder": 10.0, "proxy": 30.0}
"""Each server's drain time when its grace flag is not given (their --help defaults)."""

RESTARTS_AFTER_A_CRASH = ("always", "unless-stopped")
"""Compose restart policies that bring a killed container back (``on-failure`` does not in every engine)."""

_DEFAULT_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def load_compose(*overrides: Path) -> dict:
    """docker-compose.yml, with each override file merged in as ``docker compose -f ... -f ...`` merges it."""
    merged = yaml.safe_load(COMPOSE_FILE.read_text())
    for path in overrides:
        merged = _merge_compose(merged, yaml.safe_load(path.read_text()))
    return merged


_MERGED_BY_TARGET = ("volumes",)
"""Lists compose merges entry by entry, keyed by the mount's container path; every other list is replaced."""


def _merge_compose(base, override, key: str = ""):
    """Compose's merge for what the deploy files use: mappings key by key (``depends_on``,
    ``environment`` add to the base), ``volumes`` by container path, other values replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = _merge_compose(base[k], v, k) if k in base else v
        return out
    if key in _MERGED_BY_TARGET and isinstance(base, list) and isinstance(override, list):
        by_target = {entry.split(":")[1]: entry for entry in base}
        by_target.update({entry.split(":")[1]: entry for entry in override})
        return list(by_target.values())
    return override


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` for each instruction of deploy/Dockerfile, continuation lines joined."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    return instructions


def image_model_step() -> str:
    """The Dockerfile's RUN that builds the demo model (a shell command)."""
    (step,) = [rest for kind, rest in dockerfile_instructions() if kind == "RUN" and "make-model" in rest]
    return step


def image_model_build() -> tuple[list[str], str]:
    """The ``epd make-model`` command of that step (argv after ``epd``) and the directory it writes."""
    argv = image_model_step().split("&&")[0].split()[1:]
    out = flag(argv, "--out")
    assert argv[0] == "make-model" and out, argv
    return argv, out


def load_k8s() -> list[dict]:
    """Every document of every manifest in deploy/k8s (not the kustomization), each tagged with its file name."""
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["__file__"] = path.name
                docs.append(doc)
    return docs


def restart_blockers(services: dict) -> list[str]:
    """Why some service of a compose file would stay down after a crash (``[]``: none would).

    Every service here is long-running, so each needs a restart policy that
    brings a killed container back. A dependency is a blocker when it does
    not restart itself (Podman, and Docker with ``on-failure`` in some
    versions, will not restart a container while a dependency is stopped) or
    when the condition is that it completed: a one-shot step, always stopped.
    """
    restarting = {name for name, service in services.items() if service.get("restart") in RESTARTS_AFTER_A_CRASH}
    problems = [f"{name} does not restart after a crash" for name in services if name not in restarting]
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        if isinstance(depends_on, list):  # the short syntax: service_started
            depends_on = dict.fromkeys(depends_on, {"condition": "service_started"})
        for dependency, spec in depends_on.items():
            if dependency not in restarting:
                problems.append(f"{name} depends on {dependency}, which does not restart")
            if (spec or {}).get("condition") == "service_completed_successfully":
                problems.append(f"{name} waits for {dependency} to complete")
    return problems


def with_defaults(text: str) -> str:
    """Compose interpolation as it happens with none of the variables set: ``${X:-d}`` -> ``d``."""
    return _DEFAULT_VAR.sub(lambda m: m.group(2) or "", text)


def duration_s(text: str | int | float) -> float:
    """A compose duration (``1m30s``, ``300s``, ``500ms``) in seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = _DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    """The value of ``name`` in ``argv`` (``--flag value`` or ``--flag=value``)."""
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(name + "="):
            return token.split("=", 1)[1]
    return default


def grace_s(argv: list[str]) -> float:
    """How long the server that ``argv`` starts drains on SIGTERM."""
    command = argv[0]
    return float(flag(argv, GRACE_FLAG[command], str(DEFAULT_GRACE_S[command])))


def parse_epd_args(argv: list[str]):
    """Parses ``epd <argv>`` with the real CLI parser: unknown flags fail here."""
    from services.cli import build_parser

    return build_parser(argv).parse_args(argv)


# ------------------------------------------------------------------ Kubernetes objects
K8S_SCHEMA_VERSION = "1.30.0"
"""The oldest Kubernetes whose schemas the manifests are checked against (native gRPC probes are GA since 1.27)."""


def main_container(deployment: dict) -> dict:
    """The one container of a Deployment's pods."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def container_ports(container: dict) -> dict[str, int]:
    """A container's ports by name."""
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def component(selector: dict) -> str:
    """The ``app.kubernetes.io/component`` an epd pod selector names."""
    labels = selector["podSelector"]["matchLabels"]
    assert labels["app.kubernetes.io/name"] == "epd"
    return labels["app.kubernetes.io/component"]


def admitted_peers(docs: dict[tuple[str, str], dict], name: str) -> dict[str, set[str]]:
    """Which components the ``{name}-ingress`` NetworkPolicy admits, by named port of ``name``'s pods
    (``anyone`` for a rule without ``from``); every rule's port must be one the pods expose."""
    policy = docs[("NetworkPolicy", f"{name}-ingress")]["spec"]
    assert component(policy) == name and policy["policyTypes"] == ["Ingress"]
    ports = container_ports(main_container(docs[("Deployment", name)]))
    admitted: dict[str, set[str]] = {}
    for rule in policy["ingress"]:
        sources = {component(peer) for peer in rule["from"]} if "from" in rule else {"anyone"}
        for port in rule["ports"]:
            assert port["protocol"] == "TCP" and port["port"] in ports
            admitted.setdefault(port["port"], set()).update(sources)
    return admitted


# ------------------------------------------------------------------ hardening
WRITABLE_PATHS = ("/tmp", "/var/cache/epd", "/home/epd")
"""Where the services write (temp files, $EPD_CACHE_DIR, $HOME): tmpfs or emptyDir under a read-only root."""

EPD_SERVICES = ("pd", "encoder", "proxy", "decode")
"""The compose services that run the EPD image (``decode``: the E+P+D override's)."""


def hardening_gaps_k8s(deployment: dict) -> list[str]:
    """What a Deployment's pods lack of the hardening every EPD pod has (``[]``: nothing)."""
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    container = main_container(deployment)
    context = container.get("securityContext", {})
    pod_context = pod.get("securityContext", {})
    gaps = []
    if pod_context.get("runAsNonRoot") is not True or pod_context.get("runAsUser", 0) == 0:
        gaps.append(f"{name}: pods may run as root")
    if pod_context.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        gaps.append(f"{name}: no RuntimeDefault seccomp profile")
    if context.get("allowPrivilegeEscalation") is not False:
        gaps.append(f"{name}: privilege escalation allowed")
    if context.get("readOnlyRootFilesystem") is not True:
        gaps.append(f"{name}: writable root file system")
    if context.get("capabilities", {}).get("drop") != ["ALL"]:
        gaps.append(f"{name}: capabilities not all dropped")
    if "memory" not in container.get("resources", {}).get("limits", {}):
        gaps.append(f"{name}: no memory limit")
    empty_dirs = {v["name"]: v["emptyDir"] for v in pod.get("volumes", []) if "emptyDir" in v}
    mounted = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    for path in WRITABLE_PATHS:
        volume = mounted.get(path)
        if volume not in empty_dirs or not (empty_dirs[volume] or {}).get("sizeLimit"):
            gaps.append(f"{name}: {path} is not a size-limited emptyDir")
    return gaps


def hardening_gaps_compose(name: str, service: dict) -> list[str]:
    """What a compose service running the EPD image lacks of the hardening (``[]``: nothing)."""
    gaps = []
    if service.get("cap_drop") != ["ALL"]:
        gaps.append(f"{name}: capabilities not all dropped")
    if "no-new-privileges:true" not in service.get("security_opt", []):
        gaps.append(f"{name}: no no-new-privileges")
    if service.get("read_only") is not True:
        gaps.append(f"{name}: writable root file system")
    if not service.get("mem_limit"):
        gaps.append(f"{name}: no memory limit")
    tmpfs = {entry.split(":")[0]: entry for entry in service.get("tmpfs", [])}
    for path in WRITABLE_PATHS:
        if "size=" not in tmpfs.get(path, ""):
            gaps.append(f"{name}: {path} is not a size-limited tmpfs")
    return gaps
