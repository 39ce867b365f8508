"""deploy/ and the Containerfile, checked offline.

Every kustomize overlay renders (`kubectl kustomize`), and every object it
makes validates against Kubernetes' own schemas (kubernetes-validate,
strict); a LeaderWorkerSet's pod templates validate as core PodTemplates and
its own fields against `LWS_SCHEMA` (the CRD itself is not published on any
package registry, so it cannot be fetched here). Then what no schema knows:
every container's args parse with the real `mmsplit` parser into valid
settings; probes name the services the code serves on the ports the args
give; the grace period outlasts the drain; every container requests
resources; Services, PDBs and HPAs point at something that exists. The
Containerfile is linted (hadolint) and every path and command it names
exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mmsplit import __version__
from mmsplit_cli.config import _env_names, settings_from
from mmsplit_cli.launch import SCHEDULER_SERVICE, TOKENIZER_SERVICE
from mmsplit_cli.main import parser
from scheduler_svc.settings import SchedulerSettings, security_problems
from tests.conftest import ROOT
from tokenizer_svc.settings import TokenizerSettings

DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir())
KUBERNETES = "1.33.0"
IMAGE = f"mmsplit:{__version__}"
SETTINGS = {"tokenizer": TokenizerSettings, "scheduler": SchedulerSettings}
READY = {"tokenizer": TOKENIZER_SERVICE, "scheduler": SCHEDULER_SERVICE}
LWS_LABELS = "leaderworkerset.sigs.k8s.io"

# LeaderWorkerSet v1 (leaderworkerset.x-k8s.io): the fields of its spec we
# may use, per the API reference; the pod templates are checked separately.
LWS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"},
                "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "subGroupPolicy": {"type": "object"},
                    },
                },
            },
        },
    },
}


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/ (the Makefile installs it)"
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(role, pod template, the labels its pods carry) of a workload."""
    if obj["kind"] == "Deployment":
        template = obj["spec"]["template"]
        return [("pod", template, template["metadata"]["labels"])]
    if obj["kind"] == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        # The LWS controller labels every pod with its set, its group's
        # index (ours have one group) and its index in the group.
        assert obj["spec"].get("replicas", 1) == 1, "one group: the per-group policies name index 0 only"
        base = {f"{LWS_LABELS}/name": obj["metadata"]["name"], f"{LWS_LABELS}/group-index": "0"}
        out = [("worker", group["workerTemplate"], {**base, **group["workerTemplate"]["metadata"]["labels"]})]
        if "leaderTemplate" in group:
            leader = group["leaderTemplate"]
            out.append(("leader", leader, {**base, f"{LWS_LABELS}/worker-index": "0", **leader["metadata"]["labels"]}))
        return out
    return []


def container_settings(container: dict[str, Any]) -> tuple[str, Any]:
    """The container's command and the settings it would start with (its
    args through the real parser, its env as the environment)."""
    args = parser().parse_args(container["args"])
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    known = {name for f in SETTINGS[args.command].__dataclass_fields__ for name in _env_names(args.command, f)}
    unknown = [name for name in env if name.startswith("MMSPLIT_") and name not in known]
    assert not unknown, f"{container['name']}: no setting reads {unknown}"
    return args.command, settings_from(args, SETTINGS[args.command], args.command, env=env)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_the_overlays_are_the_four_shapes() -> None:
    assert OVERLAYS == ["multi-node-tp", "replicas", "scaled-tokenizer", "single-pod"]


def test_every_object_validates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    assert {"PodDisruptionBudget", "Service"} <= set(kinds), (overlay, kinds)
    for obj in objects:
        if obj["kind"] == "LeaderWorkerSet":
            jsonschema.validate(obj, LWS_SCHEMA)
            for role, template, _ in pod_templates(obj):
                as_core = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role}, "template": template}
                kubernetes_validate.validate(as_core, KUBERNETES, strict=True)
        else:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_a_wrong_object_does_not_validate() -> None:
    """The validators can fail: a misspelled field and a wrong type."""
    deployment = next(o for o in render("single-pod") if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)
    lws = next(o for o in render("multi-node-tp") if o["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lws, LWS_SCHEMA)


def test_containers_start_with_valid_settings_and_are_probed_where_they_serve(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    overlay, objects = rendered
    commands = []
    for obj in objects:
        for role, template, _ in pod_templates(obj):
            spec = template["spec"]
            for container in spec["containers"]:
                where = f"{overlay}/{obj['metadata']['name']}/{role}/{container['name']}"
                command, settings = container_settings(container)
                commands.append(command)
                assert container["image"] == IMAGE, where
                assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
                assert spec["terminationGracePeriodSeconds"] > settings.shutdown_grace_s, where
                if command == "scheduler":
                    assert security_problems(settings) == [], where
                ports = {p["containerPort"] for p in container.get("ports", [])}
                if command == "scheduler" and settings.launch == "env" and role == "worker":
                    # Ranks other than 0 serve nothing to probe.
                    assert not any(k in container for k in ("livenessProbe", "readinessProbe")), where
                    continue
                probe_port = settings.health_port or settings.port
                assert probe_port in ports, where
                for kind, service in (
                    ("startupProbe", ""),
                    ("livenessProbe", ""),
                    ("readinessProbe", READY[command]),
                ):
                    probe = container[kind]["grpc"]
                    assert (probe["port"], probe.get("service", "")) == (probe_port, service), (where, kind)
    assert set(commands) == {"tokenizer", "scheduler"}, overlay


def test_references_point_at_what_exists(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objects = rendered
    pods = [(labels, template) for obj in objects for _, template, labels in pod_templates(obj)]

    def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
        return [t for labels, t in pods if selector.items() <= labels.items()]

    services: dict[str, list[dict[str, Any]]] = {}
    headless = set()
    for obj in objects:
        if obj["kind"] == "Service" and obj["spec"].get("clusterIP") == "None":
            headless.add(obj["metadata"]["name"])
        if obj["kind"] == "Service":
            targets = selected(obj["spec"]["selector"])
            assert targets, (overlay, obj["metadata"]["name"], "selects no pod")
            for port in obj["spec"]["ports"]:
                served = {
                    value
                    for t in targets
                    for c in t["spec"]["containers"]
                    for p in c.get("ports", [])
                    for value in (p["containerPort"], p.get("name"))
                }
                assert port["targetPort"] in served, (overlay, obj["metadata"]["name"], port)
                services[f"{obj['metadata']['name']}:{port['port']}"] = targets
        if obj["kind"] == "PodDisruptionBudget":
            assert selected(obj["spec"]["selector"]["matchLabels"]), (overlay, "PDB selects no pod")
        if obj["kind"] == "HorizontalPodAutoscaler":
            ref = obj["spec"]["scaleTargetRef"]
            assert any(o["kind"] == ref["kind"] and o["metadata"]["name"] == ref["name"] for o in objects), overlay
    # Each tokenizer's scheduler is a Service here, or a scheduler in its own pod.
    for _, template in pods:
        containers = template["spec"]["containers"]
        for container in containers:
            command, settings = container_settings(container)
            if command != "tokenizer":
                continue
            if settings.scheduler.startswith("dns:///"):
                # Several groups: every address of a headless Service.
                target = settings.scheduler.removeprefix("dns:///")
                assert target in services, (overlay, target, sorted(services))
                assert target.split(":")[0] in headless, (overlay, "a dns:/// target needs a headless Service")
            elif settings.scheduler.startswith("127.0.0.1:"):
                port = int(settings.scheduler.rsplit(":", 1)[1])
                neighbours = [container_settings(c)[1] for c in containers if c is not container]
                assert any(getattr(n, "port", None) == port for n in neighbours), overlay
            else:
                assert settings.scheduler in services, (overlay, settings.scheduler, sorted(services))


def test_the_containerfile_lints_and_names_only_what_exists() -> None:
    hadolint = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    lint = subprocess.run([hadolint, str(ROOT / "Containerfile")], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    text = (ROOT / "Containerfile").read_text()
    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    ]
    assert sources, "no COPY found"
    for src in sources:
        if src.rstrip("/") == "wheels":
            # Made by `make wheels` (not committed): the Makefile must make it.
            assert "--dest wheels torch==2.13.0" in (ROOT / "Makefile").read_text()
            continue
        assert (ROOT / src).exists(), src
    # Every package of both distributions goes into the image, and both are installed.
    packages = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()} - {"tests", "bench"}
    assert packages <= {src.rstrip("/") for src in sources}, packages
    assert "client/" in sources
    assert "./client ." in text
    # The entrypoint is the console script the package installs.
    entry = re.search(r'ENTRYPOINT \["(\w+)"\]', text)
    assert entry is not None
    assert f'{entry.group(1)} = "mmsplit_cli.main:main"' in (ROOT / "pyproject.toml").read_text()
    # The user the pods run as is the image's own.
    assert "useradd --uid 10001" in text
    assert "USER 10001:10001" in text
    for overlay in OVERLAYS:
        for obj in render(overlay):
            for _, template, _ in pod_templates(obj):
                assert template["spec"]["securityContext"]["runAsUser"] == 10001
    # The build context leaves out what the image must not carry.
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


MONITORING = {"namespaceSelector": {"matchLabels": {"mmsplit.io/monitoring": "true"}}}


def test_every_pod_is_locked_down(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The tokenizer runs FFmpeg and PIL on untrusted bytes: no API token,
    the runtime's default seccomp profile, a read-only root file system
    (what is written goes to an emptyDir at /tmp), bounded scratch space."""
    overlay, objs = rendered
    pods = [(obj["metadata"]["name"], role, t) for obj in objs for role, t, _ in pod_templates(obj)]
    assert pods, overlay
    for name, role, template in pods:
        where = f"{overlay}/{name}/{role}"
        spec = template["spec"]
        assert spec.get("automountServiceAccountToken") is False, where
        assert spec["securityContext"].get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert spec["securityContext"].get("runAsNonRoot") is True, where
        scratch = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for container in spec["containers"]:
            at = f"{where}/{container['name']}"
            context = container["securityContext"]
            assert context.get("readOnlyRootFilesystem") is True, at
            assert context.get("allowPrivilegeEscalation") is False, at
            assert context.get("capabilities") == {"drop": ["ALL"]}, at
            resources = container["resources"]
            assert "ephemeral-storage" in resources["requests"], at
            assert "ephemeral-storage" in resources["limits"], at
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp, f"{at}: nothing writable at /tmp"
            assert tmp[0]["name"] in scratch, f"{at}: /tmp is not an emptyDir"


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what these policies use
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admitted_from(policies: list[dict[str, Any]], labels: dict[str, str], port: int) -> list[dict[str, Any]] | None:
    """Where traffic to `port` of a pod with `labels` may come from under
    `policies`: None for anywhere, else the peers (empty: nowhere)."""
    peers: list[dict[str, Any]] = []
    for policy in policies:
        spec = policy["spec"]
        if "Ingress" not in spec["policyTypes"] or not _selects(spec["podSelector"], labels):
            continue
        for rule in spec.get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p["port"] == port for p in ports):
                continue
            if "from" not in rule:
                return None
            peers.extend(rule["from"])
    return peers


def test_network_policies_let_in_only_who_needs_each_port(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """Default deny for every pod; clients reach the tokenizer's gRPC and
    HTTP ports; only tokenizers reach a scheduler's gRPC port; only the
    labelled monitoring namespace reaches metrics; only a group's own pods
    reach its rendezvous and collective ports; the health-only ports are
    the kubelet's (nothing on the network)."""
    overlay, objs = rendered
    policies = [obj for obj in objs if obj["kind"] == "NetworkPolicy"]
    tokenizer_pods = {
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "mmsplit", "app.kubernetes.io/component": "tokenizer"}
        }
    }
    checked = set()
    for obj in objs:
        for role, template, labels in pod_templates(obj):
            deny = [p for p in policies if _selects(p["spec"]["podSelector"], labels) and not p["spec"].get("ingress")]
            assert deny, f"{overlay}/{obj['metadata']['name']}/{role}: no default-deny policy selects it"
            for container in template["spec"]["containers"]:
                # A multi-pod group's own pods reach all of each other's
                # ports: gloo and NCCL choose theirs at run time (ranks hold
                # the group's certificate anyway).
                group = {k: v for k, v in labels.items() if k.startswith(LWS_LABELS) and "worker-index" not in k}
                peers = [{"podSelector": {"matchLabels": group}}] if group else []
                for port in container.get("ports", []):
                    where = f"{overlay}/{obj['metadata']['name']}/{role}/{port['name']}"
                    got = _admitted_from(policies, labels, port["containerPort"])
                    if got is not None:
                        assert all(peer in got for peer in peers), where
                        got = [peer for peer in got if peer not in peers]
                    name = port["name"]
                    if name in ("grpc", "http") and labels["app.kubernetes.io/component"] == "tokenizer":
                        assert got is None, where
                    elif name == "grpc":
                        assert got == [tokenizer_pods], where
                    elif name.endswith("metrics"):
                        assert got == [MONITORING], where
                    elif name.endswith("health"):
                        assert got == [], where
                    elif name == "rendezvous":
                        assert peers, where
                        assert got == [], where  # the group's own pods only
                    else:
                        raise AssertionError(f"{where}: a port no test says who may reach")
                    checked.add(name)
    assert {"grpc", "metrics"} <= checked, checked
