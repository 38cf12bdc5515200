"""Invariants of the Reach chart's rendered output, for every values file of
deploy/helm/reach/ci (scripts/test-chart.sh runs them after lint and kubernetes-validate).

The drain times the grace periods are checked against are read from the Rust sources, so
raising one there without the chart following fails here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Iterator

import helm_python as helm
import pytest
import yaml

from chart import CHART, REPO, render, render_text, values_files

GOOD = [f for f in values_files() if f.expect_error is None]
BAD = [f for f in values_files() if f.expect_error is not None]

SERVICES = {
    # component -> the gRPC service its readiness probe must ask for (what the binary
    # registers with tonic-health, reach_rpc::GrpcServer::add_service).
    "registry": "reach.v1.RegistryService",
    "router": "reach.v1.RouterService",
    "orchestrator": "reach.v1.OrchestratorService",
    # The A2A edge (`reach edge`, edge.enabled): A2A over gRPC, SERVING once it runs.
    "edge": "lf.a2a.v1.A2AService",
}


@pytest.fixture(scope="module", params=GOOD, ids=lambda f: f.name)
def case(request) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(values, rendered manifests) of one good values file."""
    values = request.param.values()
    return values, render(values)


# === helpers ===


def of_kind(manifests, kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def named(manifests, kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in of_kind(manifests, kind)}


def component(manifest) -> str:
    return manifest["metadata"]["labels"]["app.kubernetes.io/component"]


def deployment(manifests, name: str) -> dict[str, Any]:
    (found,) = [d for d in of_kind(manifests, "Deployment") if component(d) == name]
    return found


def pod_specs(manifests) -> Iterator[tuple[str, dict[str, Any]]]:
    for workload in of_kind(manifests, "Deployment"):
        yield workload["metadata"]["name"], workload["spec"]["template"]["spec"]


def containers(spec) -> list[dict[str, Any]]:
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def rust_seconds(path: str, pattern: str) -> int:
    """The seconds of the `Duration::from_secs(N)` that `pattern` (a regex with one group
    around N) finds in the Rust source `path`."""
    text = (REPO / path).read_text()
    match = re.search(pattern, text)
    assert match, f"{path}: {pattern!r} not found; the chart's drain budget reads it"
    return int(match.group(1))


def seconds(duration: str) -> float:
    """A humantime duration as reach.toml writes them ("10s", "1500ms", "2m")."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    match = re.fullmatch(r"(\d+)\s*(ms|s|m|h)", duration.strip())
    assert match, f"duration {duration!r}"
    return int(match.group(1)) * units[match.group(2)]


#: How long a service's server lets calls and streams run after shutdown starts, unless
#: [server] shutdown_grace says otherwise.
SHUTDOWN_GRACE = rust_seconds(
    "sdk/rust/reach-rpc/src/limits.rs", r"DEFAULT_GRACE: Duration = Duration::from_secs\((\d+)\)"
)
#: The longest an SDK agent drains by default, and what `reach example-agents` uses.
SDK_MAX_DRAIN = rust_seconds(
    "sdk/rust/reach-sdk/src/config.rs", r"max_drain: Duration::from_secs\((\d+)\)"
)
FLEET_MAX_DRAIN = rust_seconds(
    "services/agents/src/fleet.rs", r"max_drain: Duration::from_secs\((\d+)\)"
)
#: After its drain an agent's server gets this long, and the wait for it two more seconds
#: (reach_sdk::runtime::RunningAgent::drain).
AGENT_CLOSE = (
    rust_seconds(
        "sdk/rust/reach-sdk/src/runtime.rs",
        r"SERVER_GRACE_AFTER_DRAIN: Duration = Duration::from_secs\((\d+)\)",
    )
    + 2
)
#: The most the trace flush adds to an exit, whatever OTEL_EXPORTER_OTLP_TIMEOUT says
#: (docs/observability.md).
FLUSH_BOUND = 5


def tls_on(values) -> bool:
    return bool(values.get("trust", {}).get("tls", {}).get("enabled"))


def scheme(values) -> str:
    return "https" if tls_on(values) else "http"


def trust_external(values, manifests) -> set[tuple[str, str]]:
    """The Secrets and ConfigMaps of the trust values that exist outside the chart: the
    certificate Secrets (named, or written by the chart's cert-manager Certificates), the token
    keys, an existing policy ConfigMap, the registry's etcd client Secret."""
    trust = values.get("trust", {})
    found = {("Secret", trust.get("jwt", {}).get("secretName"))}
    found.add(("ConfigMap", trust.get("policy", {}).get("existingConfigMap")))
    # The registry's client certificate for etcd is the etcd operator's to issue.
    found.add(("Secret", values.get("registry", {}).get("etcd", {}).get("tlsSecret")))
    for workload in of_kind(manifests, "Deployment"):
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if volume["name"] == "tls":
                for name in tls_secrets(volume):
                    found.add(("Secret", name))
    return found


def tls_secrets(volume) -> list[str]:
    """The Secrets a `tls` volume reads: its Secret, or those it projects (a fleet agent's)."""
    if "secret" in volume:
        return [volume["secret"]["secretName"]]
    return [source["secret"]["name"] for source in volume["projected"]["sources"]]


def is_fleet(container) -> bool:
    """Whether an agent container runs `reach example-agents` (several services, each with its
    own certificate)."""
    return container.get("args", [])[:1] == ["example-agents"]


def fleet_services() -> list[str]:
    """The services `reach example-agents` starts, read from the Rust sources: an executor per
    complaint category (services/agents/src/classifier.rs), the coordinator and ingest."""
    text = (REPO / "services/agents/src/classifier.rs").read_text()
    body = text[text.index("pub fn name(self)") :]
    body = body[: body.index("\n    }\n")]
    categories = re.findall(r'Category::\w+ => "(\w+)"', body)
    assert categories, "no category names found in classifier.rs"
    fleet = (REPO / "services/agents/src/fleet.rs").read_text()
    assert 'format!("executor.{}", category.name())' in fleet, "fleet.rs names executors otherwise"
    for service in ("coordinator", "ingest"):
        assert f'config("{service}"' in fleet, f"fleet.rs starts no {service}"
    return [f"executor.{c}" for c in categories] + ["coordinator", "ingest"]


# === tests ===


def test_probe_ports_are_container_ports(case):
    _, manifests = case
    for name, spec in pod_specs(manifests):
        for container in containers(spec):
            ports = {p["containerPort"] for p in container.get("ports", [])}
            names = {p["name"] for p in container.get("ports", [])}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                action = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
                port = action["port"]
                assert port in ports or port in names, (
                    f"{name}/{container['name']}: {kind} probes port {port}, "
                    f"but the container declares {sorted(ports)}"
                )


def test_services_probe_their_own_grpc_health(case):
    values, manifests = case
    if tls_on(values):
        pytest.skip("TLS on: the services are probed over HTTPS (test_tls_*)")
    for comp, service in SERVICES.items():
        if not [d for d in of_kind(manifests, "Deployment") if component(d) == comp]:
            continue
        (container,) = deployment(manifests, comp)["spec"]["template"]["spec"]["containers"]
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert container["readinessProbe"]["grpc"] == {"port": grpc_port, "service": service}
        # Liveness and startup ask for the server as a whole (""), which the binary reports.
        for kind in ("livenessProbe", "startupProbe"):
            assert container[kind]["grpc"] == {"port": grpc_port}, f"{comp}: {kind}"
        args = container["args"]
        assert args[0] == comp
        assert args[args.index("--listen") + 1] == f"0.0.0.0:{grpc_port}"


def test_agents_with_a_port_are_probed_on_it(case):
    values, manifests = case
    for agent in values.get("agents", []):
        spec = deployment(manifests, f"agent-{agent['name']}")["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        if agent.get("port") and tls_on(values):
            for kind in ("readinessProbe", "livenessProbe"):
                assert container[kind]["tcpSocket"] == {"port": agent["port"]}
        elif agent.get("port"):
            assert container["readinessProbe"]["grpc"] == {
                "port": agent["port"],
                "service": "reach.v1.AgentService",
            }
            assert container["ports"][0]["containerPort"] == agent["port"]
        else:
            assert "readinessProbe" not in container and "ports" not in container


def test_everything_mounted_or_referenced_is_rendered(case):
    values, manifests = case
    rendered = {
        "ConfigMap": named(manifests, "ConfigMap"),
        "Secret": named(manifests, "Secret"),
        "PersistentVolumeClaim": named(manifests, "PersistentVolumeClaim"),
    }
    postgres = values.get("orchestrator", {}).get("store", {}).get("postgres", {})
    sqlite = values.get("orchestrator", {}).get("store", {}).get("sqlite", {})
    # What the values name as existing outside the chart.
    external = {
        ("Secret", postgres.get("existingSecret")),
        ("PersistentVolumeClaim", sqlite.get("persistence", {}).get("existingClaim")),
    }
    external |= trust_external(values, manifests)
    for agent in values.get("agents", []):
        for source in agent.get("envFrom", []):
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source:
                    external.add((kind, source[key]["name"]))

    def check(kind: str, name: str, key: str | None, where: str) -> None:
        if (kind, name) in external:
            return
        assert name in rendered[kind], f"{where}: {kind} {name} is not rendered"
        if key is not None:
            data = rendered[kind][name].get("data", {}) | rendered[kind][name].get("stringData", {})
            assert key in data, f"{where}: {kind} {name} has no key {key}"

    for workload, spec in pod_specs(manifests):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounted = set()
        for container in containers(spec):
            where = f"{workload}/{container['name']}"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: mounts an undeclared volume {mount['name']}"
                mounted.add(mount["name"])
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "configMapKeyRef" in source:
                    ref = source["configMapKeyRef"]
                    check("ConfigMap", ref["name"], ref["key"], where)
                if "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    check("Secret", ref["name"], ref["key"], where)
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    check("ConfigMap", source["configMapRef"]["name"], None, where)
                if "secretRef" in source:
                    check("Secret", source["secretRef"]["name"], None, where)
        assert mounted == set(volumes), f"{workload}: volumes never mounted: {set(volumes) - mounted}"
        for name, volume in volumes.items():
            where = f"{workload} volume {name}"
            if "configMap" in volume:
                check("ConfigMap", volume["configMap"]["name"], None, where)
            if "secret" in volume:
                check("Secret", volume["secret"]["secretName"], None, where)
            if "persistentVolumeClaim" in volume:
                check("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], None, where)


def test_services_read_what_is_mounted(case):
    """The paths passed to the services are where the ConfigMaps and volumes are mounted."""
    _, manifests = case
    for workload, spec in pod_specs(manifests):
        for container in spec["containers"]:
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            args = container.get("args", [])
            paths = [args[args.index(flag) + 1] for flag in ("--flows", "--config") if flag in args]
            if "--store" in args:
                paths.append(args[args.index("--store") + 1].removeprefix("sqlite://"))
            paths += [
                e["value"] for e in container.get("env", []) if e["name"].endswith("__PROTOCOL_REGISTRY")
            ]
            for path in paths:
                assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                    f"{workload}: reads {path}, which no volume is mounted at ({mounts})"
                )


def test_configmap_changes_roll_the_pods():
    """Every pod that mounts a ConfigMap carries a checksum of it, which changes with it."""
    base = {"registry": {"config": "[registry]\nstrict = false\n"}}
    changed = {
        "registry": {"config": "[registry]\nstrict = true\n"},
        "flows": {"files": {"x.yaml": "id: x\nversion: 1\ninitial: d\nstates: {d: {type: succeed}}\n"}},
        "protocolRegistry": {"content": "capabilities: {}\n"},
    }

    def annotations(values) -> dict[str, dict[str, str]]:
        return {
            component(d): d["spec"]["template"]["metadata"].get("annotations", {})
            for d in of_kind(render(values), "Deployment")
        }

    before, after = annotations(base), annotations(changed)
    for comp, keys in {
        "registry": ["checksum/config", "checksum/protocol-registry"],
        "router": ["checksum/protocol-registry"],
        "orchestrator": ["checksum/flows"],
    }.items():
        for key in keys:
            assert before[comp][key] != after[comp][key], f"{comp}: {key} did not change"


def test_services_select_their_own_pods(case):
    _, manifests = case
    deployments = of_kind(manifests, "Deployment")
    for service in of_kind(manifests, "Service"):
        selector = service["spec"]["selector"]
        matched = [d for d in deployments if selects(selector, d["spec"]["template"]["metadata"]["labels"])]
        assert len(matched) == 1, f"service {service['metadata']['name']} selects {len(matched)} deployments"
        ports = {p["name"] for p in matched[0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports


def test_deployment_selectors_match_their_pods(case):
    _, manifests = case
    for workload in of_kind(manifests, "Deployment"):
        assert selects(
            workload["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"]
        )


def test_services_find_each_other_by_service_name(case):
    values, manifests = case
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    urls = {}
    for comp in ("registry", "router", "orchestrator"):
        for name, service in services.items():
            if component(service) == comp:
                port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
                urls[comp] = f"{scheme(values)}://{name}:{port}"
    router = deployment(manifests, "router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--registry") + 1] == urls["registry"]
    if "orchestrator" in urls:
        orchestrator = deployment(manifests, "orchestrator")["spec"]["template"]["spec"]["containers"][0]
        assert orchestrator["args"][orchestrator["args"].index("--router") + 1] == urls["router"]
        env = {e["name"]: e.get("value") for e in router["env"]}
        assert env["REACH_ROUTER__LEDGER_ENDPOINT"] == urls["orchestrator"]
    for agent in values.get("agents", []):
        container = deployment(manifests, f"agent-{agent['name']}")["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["REACH_REGISTRY_ENDPOINT"] == urls["registry"]
        assert env["REACH_ROUTER_ENDPOINT"] == urls["router"]


def edge_on(values) -> bool:
    return bool(values.get("edge", {}).get("enabled"))


def test_pdbs_select_their_own_pods_only(case):
    """The routers' PDB (and the edges', when the edge is on) each select one component's pods."""
    values, manifests = case
    pdbs = {component(p): p for p in of_kind(manifests, "PodDisruptionBudget")}
    expected = set()
    if values.get("router", {}).get("pdb", {}).get("enabled", True):
        expected.add("router")
    if edge_on(values) and values["edge"].get("pdb", {}).get("enabled", True):
        expected.add("edge")
    assert set(pdbs) == expected
    for comp, pdb in pdbs.items():
        selector = pdb["spec"]["selector"]["matchLabels"]
        for workload in of_kind(manifests, "Deployment"):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert selects(selector, labels) == (component(workload) == comp), workload["metadata"]["name"]
        assert pdb["spec"]["maxUnavailable"] >= 1


@pytest.mark.parametrize("comp", ["router", "edge"])
def test_hpa_targets_its_deployment(case, comp):
    values, manifests = case
    if comp == "edge" and not edge_on(values):
        return
    hpas = [h for h in of_kind(manifests, "HorizontalPodAutoscaler") if component(h) == comp]
    workload = deployment(manifests, comp)
    # The router's HPA is on by default, the edge's off.
    if not values.get(comp, {}).get("autoscaling", {}).get("enabled", comp == "router"):
        assert not hpas
        assert workload["spec"]["replicas"] == values.get(comp, {}).get("replicas", 2)
        return
    (hpa,) = hpas
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": workload["metadata"]["name"],
    }
    # The HPA owns the replica count, and CPU utilisation is relative to the request.
    assert "replicas" not in workload["spec"]
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"]
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_grace_periods_exceed_the_drain(case):
    values, manifests = case
    for workload in of_kind(manifests, "Deployment"):
        comp = component(workload)
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        if comp in SERVICES:
            config = tomllib.loads(values.get(comp, {}).get("config", ""))
            grace = config.get("server", {}).get("shutdown_grace")
            drain = seconds(grace) if grace else SHUTDOWN_GRACE
        else:
            fleet = container.get("args", [])[:1] == ["example-agents"]
            drain = (FLEET_MAX_DRAIN if fleet else SDK_MAX_DRAIN) + AGENT_CLOSE
        budget = pre_stop + drain + FLUSH_BOUND
        assert spec["terminationGracePeriodSeconds"] > budget, (
            f"{workload['metadata']['name']}: terminationGracePeriodSeconds "
            f"{spec['terminationGracePeriodSeconds']} does not cover preStop {pre_stop}s + drain "
            f"{drain}s + trace flush {FLUSH_BOUND}s"
        )


def test_every_container_is_locked_down(case):
    _, manifests = case
    for workload, spec in pod_specs(manifests):
        pod = spec["securityContext"]
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, workload
        assert spec["automountServiceAccountToken"] is False, workload
        writable = {
            m["mountPath"]
            for c in containers(spec)
            for m in c.get("volumeMounts", [])
            if not m.get("readOnly")
        }
        assert "/tmp" in writable, f"{workload}: no writable /tmp on a read-only root filesystem"
        for container in containers(spec):
            where = f"{workload}/{container['name']}"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert "ALL" in context["capabilities"]["drop"], where
            assert not context["capabilities"].get("add"), where
            assert context.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert context.get("runAsUser", pod.get("runAsUser", 1)) != 0, where
            assert not context.get("privileged"), where


def test_orchestrator_replicas_and_store_agree(case):
    values, manifests = case
    store = values.get("orchestrator", {}).get("store", {}).get("type", "sqlite")
    if not values.get("orchestrator", {}).get("enabled", True):
        assert not [m for m in manifests if component(m) == "orchestrator"]
        return
    orchestrator = deployment(manifests, "orchestrator")
    (container,) = orchestrator["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["REACH_ORCHESTRATOR__NODE_ID"]["value"] == "$(POD_NAME)"
    if store == "sqlite":
        assert orchestrator["spec"]["replicas"] == 1
        assert orchestrator["spec"]["strategy"]["type"] == "Recreate"
        assert container["args"][container["args"].index("--store") + 1].startswith("sqlite:///")
    else:
        assert "--store" not in container["args"]
        assert "secretKeyRef" in env["REACH_ORCHESTRATOR__STORE_URL"]["valueFrom"]


def test_registry_replicas_and_backend_agree(case):
    """Several registry replicas only on etcd, whose endpoints, prefix and TLS files reach the
    registry as its settings; in memory, one replica and no etcd setting."""
    values, manifests = case
    registry = deployment(manifests, "registry")
    spec = registry["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    etcd = values.get("registry", {}).get("etcd", {})
    if not etcd.get("endpoints"):
        assert registry["spec"]["replicas"] == 1
        assert not [name for name in env if name.startswith("REACH_REGISTRY__ETCD")]
        assert "REACH_REGISTRY__BACKEND" not in env
        return
    assert registry["spec"]["replicas"] == values["registry"].get("replicas", 1)
    assert env["REACH_REGISTRY__BACKEND"] == "etcd"
    assert json.loads(env["REACH_REGISTRY__ETCD__ENDPOINTS"]) == etcd["endpoints"]
    assert env["REACH_REGISTRY__ETCD__PREFIX"] == etcd.get("prefix", "/reach/registry/")
    secret = etcd.get("tlsSecret")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    if not secret:
        assert "etcd-tls" not in volumes and "REACH_REGISTRY__ETCD__TLS__CA" not in env
        return
    assert volumes["etcd-tls"]["secret"]["secretName"] == secret
    assert env["REACH_REGISTRY__ETCD__TLS__CA"] == f"{mounts['etcd-tls']}/ca.crt"
    if etcd.get("tlsClientCert", True):
        assert env["REACH_REGISTRY__ETCD__TLS__CERT"] == f"{mounts['etcd-tls']}/tls.crt"
        assert env["REACH_REGISTRY__ETCD__TLS__KEY"] == f"{mounts['etcd-tls']}/tls.key"


@pytest.mark.parametrize("file", BAD, ids=lambda f: f.name)
def test_bad_values_are_refused_with_their_message(file):
    with pytest.raises(helm.HelmError) as error:
        render(file.values())
    assert file.expect_error in str(error.value)


def test_notes_say_how_to_reach_the_mesh():
    notes = render_text({})["reach/templates/NOTES.txt"]
    assert "port-forward svc/ci-reach-registry" in notes
    assert "reach agents --endpoint http://127.0.0.1:7070" in notes


def test_the_chart_ships_the_repository_examples():
    """files/ holds copies of examples/ (a chart cannot read outside itself): keep them equal."""
    pairs = [(CHART / "files" / "protocol-registry.yaml", REPO / "examples" / "protocol-registry.yaml")]
    pairs += [
        (CHART / "files" / "flows" / path.name, path) for path in sorted((REPO / "examples" / "flows").glob("*.yaml"))
    ]
    assert sorted(p.name for p in (CHART / "files" / "flows").iterdir()) == sorted(
        p[1].name for p in pairs[1:]
    )
    for copy, original in pairs:
        assert copy.read_text() == original.read_text(), (
            f"{copy.relative_to(REPO)} differs from {original.relative_to(REPO)}; copy it again"
        )


def test_readiness_service_names_exist_in_the_contracts():
    for name in SERVICES.values():
        package, service = name.rsplit(".", 1)
        protos = "".join(p.read_text() for p in (REPO / "proto" / package.replace(".", "/")).glob("*.proto"))
        assert f"package {package};" in protos and f"service {service} " in protos, name


# === values.yaml ===

#: Blocks handed to Kubernetes as they are (their keys are Kubernetes', documented there).
PASS_THROUGH = {
    "resources", "podSecurityContext", "securityContext", "startup", "liveness", "readiness",
    "behavior", "commonLabels", "annotations", "podAnnotations", "podLabels", "nodeSelector",
    "affinity", "resourceAttributes", "files",
}


def values_keys() -> list[tuple[tuple[str, ...], bool]]:
    """Every key of values.yaml outside the pass-through blocks: (path, documented), where
    documented means a comment on the line itself or right above it."""
    keys, stack, previous = [], [], ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = tuple(k for _, k in stack) + (match.group(2),)
            stack.append((indent, match.group(2)))
            if not PASS_THROUGH & set(path[:-1]):
                documented = "#" in line or previous.strip().startswith("#")
                keys.append((path, documented))
        if line.strip():
            previous = line
    return keys


def test_every_value_is_documented():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    undocumented = []
    for path, documented in values_keys():
        node = values
        for key in path:
            node = node[key]
        is_block = isinstance(node, dict) and node and path[-1] not in PASS_THROUGH
        if not documented and not is_block:
            undocumented.append(".".join(path))
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def test_every_value_is_used():
    templates = "".join(p.read_text() for p in (CHART / "templates").rglob("*") if p.is_file())
    unused = [".".join(path) for path, _ in values_keys() if f".{path[-1]}" not in templates]
    assert not unused, f"values.yaml keys no template reads: {unused}"


# === the rendered settings, read by the binary ===


def reach_binary() -> Path | None:
    """The `reach` binary to check settings with: $REACH_BIN, else a cargo build of this tree."""
    candidates = [os.environ.get("REACH_BIN")] + [
        str(REPO / "target" / profile / "reach") for profile in ("debug", "release")
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def test_the_binary_accepts_every_rendered_setting(case, tmp_path):
    """Each service's rendered args and environment, with its ConfigMaps written where they
    are mounted (under tmp_path), make `reach <service> --dump-config` exit 0: no unknown key,
    bad value or unreadable file (which exit 64). The pod's own fields are stood in for."""
    binary = reach_binary()
    if binary is None:
        pytest.skip("no reach binary: set REACH_BIN or build it (cargo build -p reach)")
    _, manifests = case
    configmaps = named(manifests, "ConfigMap")
    pod = {"POD_NAME": "ci-reach-router-0", "POD_NAMESPACE": "reach", "POD_IP": "10.1.2.3"}
    for deployment_ in of_kind(manifests, "Deployment"):
        if component(deployment_) not in SERVICES:
            continue
        workload = deployment_["metadata"]["name"]
        spec = deployment_["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        root = tmp_path / workload
        volumes = {v["name"]: v for v in spec["volumes"]}
        moved = {}
        for mount in container["volumeMounts"]:
            target = root / mount["mountPath"].lstrip("/")
            target.mkdir(parents=True)
            moved[mount["mountPath"]] = str(target)
            if volumes[mount["name"]].get("secret"):
                pytest.skip("certificates are not made here: TLS settings are checked by test_tls_*")
            source = volumes[mount["name"]].get("configMap")
            if source:
                for name, text in configmaps[source["name"]]["data"].items():
                    (target / name).write_text(text)

        def local(value: str) -> str:
            for path, target in moved.items():
                value = value.replace(path, target)
            return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)

        env = {"PATH": os.environ["PATH"]}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = local(var["value"])
            elif "fieldRef" in var["valueFrom"]:
                env[var["name"]] = pod[var["name"]]
            else:  # the PostgreSQL URL's Secret
                env[var["name"]] = "postgres://reach:secret@127.0.0.1:5432/reach"
        args = [local(arg) for arg in container["args"]] + ["--dump-config"]
        result = subprocess.run([binary, *args], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{workload}: reach {' '.join(args)}: {result.stderr}"
        dumped = tomllib.loads(result.stdout)
        assert dumped["listen"] == args[args.index("--listen") + 1]
        if container["args"][0] == "router":
            assert dumped["router"]["advertise_endpoint"].endswith("://10.1.2.3:7070")
            assert dumped["router"]["registry_endpoint"].endswith("-registry:7070")
        if container["args"][0] == "orchestrator":
            assert dumped["orchestrator"]["node_id"] == pod["POD_NAME"]
        if container["args"][0] == "edge":
            assert dumped["edge_listen"] == args[args.index("--edge-listen") + 1]
            assert dumped["edge"]["registry_endpoint"].endswith("-registry:7070")
            assert dumped["edge"]["router_endpoint"].endswith("-router:7070")
            assert dumped["edge"]["public_url"] == env["REACH_EDGE__PUBLIC_URL"]
            assert dumped["edge"]["public_grpc"] == env["REACH_EDGE__PUBLIC_GRPC"]
            assert dumped["edge"]["allowed_hosts"] == json.loads(env["REACH_EDGE__ALLOWED_HOSTS"])


# === trust (docs/security.md) ===

TLS_DIR = "/etc/reach/tls"


def service_containers(manifests) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for workload in of_kind(manifests, "Deployment"):
        if component(workload) in SERVICES:
            spec = workload["spec"]["template"]["spec"]
            (container,) = spec["containers"]
            yield component(workload), spec, container


def env_of(container) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_tls_off_every_service_is_explicitly_insecure(case):
    values, manifests = case
    if tls_on(values):
        return
    for comp, _, container in service_containers(manifests):
        env = env_of(container)
        assert env.get("REACH_TRUST__INSECURE") == "true", f"{comp}: listens on 0.0.0.0 without TLS"
        assert not any(k.startswith("REACH_TRUST__TLS__") for k in env), comp


def test_tls_off_notes_warn_the_mesh_is_open():
    notes = next(t for p, t in render_text({}).items() if p.endswith("NOTES.txt"))
    assert "THE MESH IS OPEN" in notes and "REACH_TRUST__INSECURE=true" in notes
    on = next(t for p, t in render_text({"trust": {"tls": {"enabled": True}}}).items() if p.endswith("NOTES.txt"))
    assert "THE MESH IS OPEN" not in on and "https://" in on


def test_tls_on_services_serve_and_probe_over_https(case):
    values, manifests = case
    if not tls_on(values):
        return
    admin = values.get("ports", {}).get("admin", 7071)
    for comp, spec, container in service_containers(manifests):
        env = env_of(container)
        assert "REACH_TRUST__INSECURE" not in env, comp
        assert env["REACH_TRUST__TLS__CERT"] == f"{TLS_DIR}/tls.crt"
        assert env["REACH_TRUST__TLS__KEY"] == f"{TLS_DIR}/tls.key"
        assert env["REACH_TRUST__TLS__CA"] == f"{TLS_DIR}/ca.crt"
        assert env["REACH_TRUST__TLS__CLIENT_AUTH"] in ("required", "optional")
        # Readiness follows the service's gRPC health (/ready); the others, the process (/health).
        for kind, path in (("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
            probe = container[kind]
            assert "grpc" not in probe, f"{comp}: {kind} is a gRPC probe, which cannot speak TLS"
            assert probe["httpGet"] == {"path": path, "port": admin, "scheme": "HTTPS"}, (comp, kind)
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert mount["mountPath"] == TLS_DIR and "subPath" not in mount and mount.get("readOnly")
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"]
    for workload in of_kind(manifests, "Deployment"):
        if component(workload).startswith("agent-"):
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            env = env_of(container)
            if is_fleet(container):
                # Checked by test_example_agents_use_the_charts_tls.
                assert env["REACH_TLS_DIR"] == TLS_DIR
            else:
                assert env["REACH_TLS_CA"] == f"{TLS_DIR}/ca.crt" and env["REACH_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
            assert env["REACH_REGISTRY_ENDPOINT"].startswith("https://")
            assert not any("grpc" in container.get(k, {}) for k in ("readinessProbe", "livenessProbe"))


def test_tls_secrets_are_the_named_ones_or_the_certificates(case):
    values, manifests = case
    if not tls_on(values):
        return
    tls = values["trust"]["tls"]
    written = {c["spec"]["secretName"]: c for c in of_kind(manifests, "Certificate")}
    domain = values["trust"].get("trustDomain", "reach.local")
    for workload in of_kind(manifests, "Deployment"):
        comp = component(workload)
        (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
        if "projected" in volume:
            continue  # a fleet agent's: test_example_agents_use_the_charts_tls
        name = volume["secret"]["secretName"]
        if comp.startswith("agent-"):
            named_ = tls.get("secrets", {}).get("agents", {}).get(comp.removeprefix("agent-"))
        else:
            named_ = tls.get("secrets", {}).get(comp)
        assert name == (named_ or f"{workload['metadata']['name']}-tls"), comp
        if tls.get("certManager", {}).get("enabled"):
            certificate = written[name]
            (uri,) = certificate["spec"]["uris"]
            path = comp if comp in SERVICES else "agent/" + comp.removeprefix("agent-")
            assert uri == f"spiffe://{domain}/{path}", comp
            assert certificate["spec"]["issuerRef"]["name"] == tls["certManager"]["issuerRef"]["name"]
        else:
            assert not written


def test_policy_is_mounted_as_a_directory_and_reloaded_in_place(case):
    values, manifests = case
    policy = values.get("trust", {}).get("policy", {})
    for comp, spec, container in service_containers(manifests):
        env = env_of(container)
        if not (policy.get("rules") or policy.get("existingConfigMap")):
            assert "REACH_TRUST__POLICY" not in env
            continue
        path = env["REACH_TRUST__POLICY"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "policy"]
        # subPath mounts never see ConfigMap updates; a directory mount does.
        assert "subPath" not in mount and path == f"{mount['mountPath']}/{policy.get('key', 'policy.yaml')}"
        (volume,) = [v for v in spec["volumes"] if v["name"] == "policy"]
        name = volume["configMap"]["name"]
        if policy.get("rules"):
            (configmap,) = [c for c in of_kind(manifests, "ConfigMap") if c["metadata"]["name"] == name]
            assert yaml.safe_load(configmap["data"][policy.get("key", "policy.yaml")]) == policy["rules"]
        else:
            assert name == policy["existingConfigMap"]
        # Reloaded in place: an edit must not roll the pods.
        annotations = [d for d in of_kind(manifests, "Deployment") if component(d) == comp][0]
        assert not any("policy" in k for k in annotations["spec"]["template"]["metadata"].get("annotations", {}))


def test_jwt_keys_point_at_the_mounted_secret(case):
    values, manifests = case
    jwt = values.get("trust", {}).get("jwt", {})
    for comp, spec, container in service_containers(manifests):
        env = env_of(container)
        if not jwt.get("secretName"):
            assert "REACH_TRUST__JWT__KEYS" not in env
            continue
        import json

        keys = json.loads(env["REACH_TRUST__JWT__KEYS"])
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "jwt-keys"]
        assert keys == [f"{mount['mountPath']}/{k}" for k in jwt.get("keys", ["jwt-public.pem"])]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "jwt-keys"]
        assert volume["secret"]["secretName"] == jwt["secretName"]


# === the A2A edge (edge.enabled, docs/edges.md) ===


def edge_parts(manifests) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The edge's Deployment, its container, and its Service."""
    workload = deployment(manifests, "edge")
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    (service,) = [s for s in of_kind(manifests, "Service") if component(s) == "edge"]
    return workload, container, service


def test_edge_is_off_by_default_and_renders_nothing_then():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["edge"]["enabled"] is False
    for manifests in (render({}), render({"edge": {"enabled": False}})):
        assert not [m for m in manifests if m["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "edge"]
        assert not [m for m in manifests if "-edge" in m["metadata"]["name"]]
        for _, spec in pod_specs(manifests):
            for container in containers(spec):
                assert "a2a" not in {p["name"] for p in container.get("ports", [])}
    notes = render_text({})["reach/templates/NOTES.txt"]
    assert "A2A" not in notes and "-edge" not in notes


def test_edge_renders_only_when_enabled(case):
    values, manifests = case
    edges = [m for m in manifests if m["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "edge"]
    assert bool(edges) == edge_on(values)


def test_edge_calls_the_charts_own_services(case):
    values, manifests = case
    if not edge_on(values):
        return
    _, container, _ = edge_parts(manifests)
    args = container["args"]
    assert args[0] == "edge"
    services = {component(s): s for s in of_kind(manifests, "Service")}

    def url(comp: str) -> str:
        port = next(p["port"] for p in services[comp]["spec"]["ports"] if p["name"] == "grpc")
        return f"{scheme(values)}://{services[comp]['metadata']['name']}:{port}"

    assert args[args.index("--registry") + 1] == url("registry")
    assert args[args.index("--router") + 1] == url("router")
    grpc = values.get("ports", {}).get("grpc", 7070)
    if values.get("orchestrator", {}).get("enabled", True):
        assert args[args.index("--orchestrator") + 1] == url("orchestrator")
    else:
        # No orchestrator Service: the edge's own port answers UNIMPLEMENTED (no flows).
        assert "orchestrator" not in services
        assert args[args.index("--orchestrator") + 1] == f"{scheme(values)}://127.0.0.1:{grpc}"
    a2a = values.get("ports", {}).get("a2a", 7072)
    assert args[args.index("--edge-listen") + 1] == f"0.0.0.0:{a2a}"
    assert args[args.index("--admin-listen") + 1] == f"0.0.0.0:{values.get('ports', {}).get('admin', 7071)}"


def test_edge_cards_advertise_the_service_not_the_pod(case):
    values, manifests = case
    if not edge_on(values):
        return
    _, container, service = edge_parts(manifests)
    env = env_of(container)
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    host = f"{service['metadata']['name']}.{service['metadata'].get('namespace', 'reach')}.svc"
    edge = values["edge"]
    assert env["REACH_EDGE__PUBLIC_URL"] == (edge.get("publicUrl") or f"{scheme(values)}://{host}:{ports['a2a']}")
    assert env["REACH_EDGE__PUBLIC_GRPC"] == (edge.get("publicGrpc") or f"{host}:{ports['grpc']}")
    assert "POD_IP" not in env["REACH_EDGE__PUBLIC_URL"] + env["REACH_EDGE__PUBLIC_GRPC"]


def test_edge_public_urls_default_to_the_service_dns_names():
    for tls, want in ((False, "http"), (True, "https")):
        values = {"edge": {"enabled": True}, "trust": {"tls": {"enabled": tls, "clientAuth": "optional"}}}
        env = env_of(edge_parts(render(values))[1])
        assert env["REACH_EDGE__PUBLIC_URL"] == f"{want}://ci-reach-edge.reach.svc:7072"
        assert env["REACH_EDGE__PUBLIC_GRPC"] == "ci-reach-edge.reach.svc:7070"
    env = env_of(edge_parts(render({"edge": {"enabled": True, "publicUrl": "https://a2a.example.com", "publicGrpc": "a2a.example.com:443"}}))[1])
    assert env["REACH_EDGE__PUBLIC_URL"] == "https://a2a.example.com"
    assert env["REACH_EDGE__PUBLIC_GRPC"] == "a2a.example.com:443"


def test_edge_answers_the_services_names_loopback_and_the_public_host():
    env = env_of(edge_parts(render({"edge": {"enabled": True}}))[1])
    hosts = json.loads(env["REACH_EDGE__ALLOWED_HOSTS"])
    assert hosts == [
        "ci-reach-edge", "ci-reach-edge.reach", "ci-reach-edge.reach.svc", "ci-reach-edge.reach.svc.cluster.local",
        "localhost", "127.0.0.1", "::1",
    ]
    values = {"edge": {"enabled": True, "publicUrl": "https://mesh.example.com:8443", "allowedHosts": ["mcp.example.com"]}}
    hosts = json.loads(env_of(edge_parts(render(values))[1])["REACH_EDGE__ALLOWED_HOSTS"])
    assert hosts[-2:] == ["mesh.example.com", "mcp.example.com"]


def test_edge_a2a_port_is_on_its_service_and_container_only(case):
    values, manifests = case
    if not edge_on(values):
        return
    a2a = values.get("ports", {}).get("a2a", 7072)
    _, container, service = edge_parts(manifests)
    assert {"name": "a2a", "containerPort": a2a, "protocol": "TCP"} in container["ports"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "a2a"]
    assert port["port"] == a2a and port["targetPort"] == "a2a"
    assert port["appProtocol"] == scheme(values)
    for other in of_kind(manifests, "Service"):
        if component(other) != "edge":
            assert "a2a" not in {p["name"] for p in other["spec"]["ports"]}, other["metadata"]["name"]


def test_edge_probes_check_the_a2a_service(case):
    values, manifests = case
    if not edge_on(values):
        return
    _, container, _ = edge_parts(manifests)
    if tls_on(values):
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        return
    grpc = values.get("ports", {}).get("grpc", 7070)
    assert container["readinessProbe"]["grpc"] == {"port": grpc, "service": "lf.a2a.v1.A2AService"}
    assert container["livenessProbe"]["grpc"] == {"port": grpc}


def test_edge_presents_its_own_certificate(case):
    values, manifests = case
    if not (edge_on(values) and tls_on(values)):
        return
    workload, _, _ = edge_parts(manifests)
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    named_ = values["trust"]["tls"].get("secrets", {}).get("edge")
    assert volume["secret"]["secretName"] == (named_ or "ci-reach-edge-tls")
    if values["trust"]["tls"].get("certManager", {}).get("enabled"):
        (certificate,) = [c for c in of_kind(manifests, "Certificate") if component(c) == "edge"]
        domain = values["trust"].get("trustDomain", "reach.local")
        assert certificate["spec"]["uris"] == [f"spiffe://{domain}/edge"]
        assert "ci-reach-edge.reach.svc" in certificate["spec"]["dnsNames"]


def test_notes_say_how_to_reach_the_edge():
    notes = render_text({"edge": {"enabled": True}})["reach/templates/NOTES.txt"]
    assert "http://ci-reach-edge.reach.svc:7072/.well-known/agent-card.json" in notes
    assert "http://ci-reach-edge.reach.svc:7072/mcp" in notes
    assert "port-forward svc/ci-reach-edge 7072:7072" in notes
    assert "curl -s http://127.0.0.1:7072/.well-known/agent-card.json" in notes
    notes = render_text({"edge": {"enabled": True, "publicUrl": "https://a2a.example.com/"}})["reach/templates/NOTES.txt"]
    assert "https://a2a.example.com/.well-known/agent-card.json" in notes


# === the example fleet's TLS (reach example-agents) ===


def test_the_chart_knows_the_fleets_services():
    """The chart's list of fleet services (reach.fleet.services) is what the binary starts."""
    values = {
        "trust": {"tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "ca"}}}},
        "agents": [{"name": "examples", "args": ["example-agents"]}],
    }
    certificates = of_kind(render(values), "Certificate")
    uris = {c["spec"]["uris"][0] for c in certificates if component(c) == "agent-examples"}
    assert uris == {f"spiffe://reach.local/agent/{s}" for s in fleet_services()}


def test_example_agents_use_the_charts_tls(case):
    """`reach example-agents` with TLS on serves and calls with one certificate per fleet
    service, from the directory the chart mounts (REACH_TLS_DIR), in the trust domain the
    chart sets; with cert-manager, each service's Certificate names its own SPIFFE ID and the
    projected volume lays the files out as `reach certs init` does."""
    values, manifests = case
    domain = values.get("trust", {}).get("trustDomain", "reach.local")
    certificates = {c["spec"]["secretName"]: c for c in of_kind(manifests, "Certificate")}
    tls = values.get("trust", {}).get("tls", {})
    for workload in of_kind(manifests, "Deployment"):
        if not component(workload).startswith("agent-"):
            continue
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        if not is_fleet(container):
            continue
        env = env_of(container)
        assert env["REACH_TRUST_DOMAIN"] == domain
        if not tls_on(values):
            assert "REACH_TLS_DIR" not in env and not any(v["name"] == "tls" for v in spec["volumes"])
            continue
        assert env["REACH_TLS_DIR"] == TLS_DIR
        assert env["REACH_REGISTRY_ENDPOINT"].startswith("https://")
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert mount["mountPath"] == TLS_DIR and "subPath" not in mount and mount.get("readOnly")
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        agent = component(workload).removeprefix("agent-")
        if tls.get("certManager", {}).get("enabled"):
            files = {}
            for source in volume["projected"]["sources"]:
                secret = source["secret"]
                certificate = certificates[secret["name"]]
                (uri,) = certificate["spec"]["uris"]
                for item in secret["items"]:
                    files[item["path"]] = (uri, item["key"])
            expected = {}
            for service in fleet_services():
                uri = f"spiffe://{domain}/agent/{service}"
                expected[f"agent-{service}.pem"] = (uri, "tls.crt")
                expected[f"agent-{service}-key.pem"] = (uri, "tls.key")
            assert files.pop("ca.pem")[1] == "ca.crt"
            assert files == expected
        else:
            named_ = tls.get("secrets", {}).get("agents", {}).get(agent)
            assert volume["secret"]["secretName"] == (named_ or f"{workload['metadata']['name']}-tls")


# === the admin ports' hosts ===


def test_admin_ports_answer_their_services_names(case):
    _, manifests = case
    for comp, _, container in service_containers(manifests):
        hosts = json.loads(env_of(container)["REACH_ADMIN__ALLOWED_HOSTS"])
        name = f"ci-reach-{comp}"
        for host in (name, f"{name}.reach", f"{name}.reach.svc", "localhost", "127.0.0.1"):
            assert host in hosts, (comp, host)


# === network policies ===


def policies(manifests) -> dict[str, dict[str, Any]]:
    return {component(p): p for p in of_kind(manifests, "NetworkPolicy")}


def selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions with In) selects `labels`."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def pod_labels(manifests) -> dict[str, dict[str, str]]:
    return {component(d): d["spec"]["template"]["metadata"]["labels"] for d in of_kind(manifests, "Deployment")}


def admits(rule, labels: dict[str, str]) -> bool:
    """Whether an ingress rule lets a pod of this namespace with `labels` in (only podSelector
    peers are judged; a rule without `from` admits everyone)."""
    if "from" not in rule:
        return True
    return any("podSelector" in peer and "namespaceSelector" not in peer and "ipBlock" not in peer
               and selected(peer["podSelector"], labels) for peer in rule["from"])


def rules_for(policy, port: str) -> list[dict[str, Any]]:
    return [r for r in policy["spec"]["ingress"] if port in {p["port"] for p in r.get("ports", [])}]


def test_network_policies_are_on_by_default_and_cover_every_pod(case):
    values, manifests = case
    enabled = values.get("networkPolicy", {}).get("enabled", True)
    found = policies(manifests)
    if not enabled:
        assert not found
        return
    labels = pod_labels(manifests)
    for comp, pod in labels.items():
        covering = [p for p in found.values() if selected(p["spec"]["podSelector"], pod)]
        assert len(covering) == 1, f"{comp} is selected by {len(covering)} NetworkPolicies"
        assert covering[0]["spec"]["policyTypes"] == ["Ingress"]
    for policy in found.values():
        # Named ports must be the selected containers' own.
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                for comp, pod in labels.items():
                    if selected(policy["spec"]["podSelector"], pod):
                        (container,) = deployment(manifests, comp)["spec"]["template"]["spec"]["containers"]
                        assert port["port"] in {p["name"] for p in container.get("ports", [])}, (comp, port)


def test_only_routers_and_the_registry_reach_agents(case):
    values, manifests = case
    if not values.get("agents") or not values.get("networkPolicy", {}).get("enabled", True):
        return
    labels = pod_labels(manifests)
    (rule,) = policies(manifests)["agents"]["spec"]["ingress"]
    for comp, pod in labels.items():
        expected = comp in ("router", "registry")
        assert admits(rule, pod) == expected, f"{comp} {'cannot' if expected else 'can'} reach the agents"
    extra = values.get("networkPolicy", {}).get("agents", {}).get("from", [])
    others = [peer for peer in rule["from"] if not ("podSelector" in peer and len(peer) == 1)]
    assert others == extra


def test_only_the_mesh_reaches_the_control_plane(case):
    values, manifests = case
    np = values.get("networkPolicy", {})
    if not np.get("enabled", True):
        return
    labels = pod_labels(manifests)
    found = policies(manifests)
    mesh_peers = np.get("meshPeers", [])
    admin_from = np.get("admin", {}).get("from", [])
    for comp in ("registry", "router", "orchestrator", "edge"):
        if comp not in found:
            assert comp not in labels, f"{comp} runs without a NetworkPolicy"
            continue
        policy = found[comp]
        (admin,) = rules_for(policy, "admin")
        assert "from" in admin, f"{comp}: the admin port is open to anyone"
        assert admin["from"][1:] == mesh_peers + admin_from, comp
        (grpc,) = rules_for(policy, "grpc")
        if comp == "edge":
            edge_from = np.get("edge", {}).get("from", [])
            assert grpc.get("from", []) == edge_from
            assert {p["port"] for p in grpc["ports"]} == {"grpc", "a2a"}
        else:
            assert "from" in grpc, f"{comp}: the gRPC port is open to anyone"
            assert grpc["from"][1:] == mesh_peers, comp
        # Every pod of the release reaches it (agents register, routers watch, ...); the
        # edge's public ports are for its own callers.
        for other, pod in labels.items():
            assert admits(admin, pod), f"{other} cannot reach {comp}'s admin port"
            if comp != "edge":
                assert admits(grpc, pod), f"{other} cannot reach {comp}"
