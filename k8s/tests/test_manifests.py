"""Validation of colibri's Kubernetes deployment: the Helm chart (helm/colibri), the kustomize
manifests (k8s/base, k8s/overlays), the Grafana dashboard and the alert rules (k8s/monitoring).

- yamllint over every YAML file under helm/ and k8s/ (k8s/tests/yamllint.yaml), and over the
  chart as rendered for each values file;
- the chart rendered by Helm's own engine (helm-python-sdk binds Helm v4's Go SDK; no
  cluster) for the default values and every helm/colibri/ci/*-values.yaml, linted with
  `helm lint --strict`, and a set of values the chart must refuse;
- every rendered and plain manifest validated against the Kubernetes OpenAPI schemas
  (kubernetes-validate, strict: unknown fields are errors) for the oldest and newest
  Kubernetes versions in K8S_VERSIONS; the Prometheus Operator's CRD kinds (ServiceMonitor,
  PrometheusRule), which have no schema there, are checked for their basic shape instead;
- the overlays built with kustomize (the `kustomize` binary, or `kubectl kustomize` when it
  embeds kustomize v4+; without either, k8s/tests/kustomize_lite.py, which the real tool's
  output is compared with whenever both are present);
- what a schema cannot see: selectors that select the pods, probes on /ready and /health with a
  startup budget of minutes, a grace period longer than the drain, the security context,
  every mount backed by a volume, colibri.toml and the COLI_* variables naming only keys of
  server/src/config.rs, mirrors mounted where the profile says, the RAM budget derived from
  the memory limit;
- every PromQL expression of the dashboard and the alerts parsed (promql-parser) and naming
  only metrics of docs/api.md's metrics table (which is checked against the server's own
  metric definitions).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import helm_python
import kubernetes_validate
import promql_parser
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter as yamllint_linter

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "colibri"
K8S = ROOT / "k8s"
MONITORING = K8S / "monitoring"
YAMLLINT_CONFIG = K8S / "tests" / "yamllint.yaml"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kustomize_lite  # noqa: E402

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; the preStop sleep action)
# and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]

# Kinds defined by CRDs, absent from Kubernetes' schemas: shape-checked instead.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}

RELEASE = "llm"
NAMESPACE = "llm"
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


# --------------------------------------------------------------------------------------------
# What the server defines: configuration keys, environment variables, metrics.


def _config_rs() -> str:
    return (ROOT / "server" / "src" / "config.rs").read_text(encoding="utf-8")


def config_keys() -> list[str]:
    """The keys of `coli serve`'s configuration: server/src/config.rs's KEYS table, then the
    engine options of server/src/engine_options.rs's ENGINE_KEYS (the order of `--show`)."""
    keys = []
    for path, table in (("config.rs", "KEYS"), ("engine_options.rs", "ENGINE_KEYS")):
        text = (ROOT / "server" / "src" / path).read_text(encoding="utf-8")
        block = re.search(rf"const {table}: &\[\(&str, Shape\)\] = &\[(.*?)\];", text, re.S)
        assert block, f"{table} table not found in server/src/{path}"
        keys += re.findall(r'\("([a-z_]+)", Shape::', block.group(1))
    assert len(keys) > 30
    return keys


def engine_keys() -> list[str]:
    """The engine options (server/src/engine_options.rs's ENGINE_KEYS)."""
    text = (ROOT / "server" / "src" / "engine_options.rs").read_text(encoding="utf-8")
    block = re.search(r"const ENGINE_KEYS: &\[\(&str, Shape\)\] = &\[(.*?)\];", text, re.S)
    return re.findall(r'\("([a-z_]+)", Shape::', block.group(1))


def ignored_env() -> tuple[set[str], list[str]]:
    """COLI_* variables that are not configuration, and the prefixes of such variables."""
    text = _config_rs()
    names = re.search(r"const IGNORED_ENV: &\[&str\] = &\[(.*?)\];", text, re.S)
    prefixes = re.search(r"const IGNORED_ENV_PREFIXES: &\[&str\] = &\[(.*?)\];", text, re.S)
    assert names and prefixes
    return set(re.findall(r'"([A-Z_]+)"', names.group(1))), re.findall(r'"([A-Z_]+)"', prefixes.group(1))


def documented_metrics() -> dict[str, str]:
    """Metric name → type, from the metrics table of docs/api.md."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    metrics = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`coli_"):
            continue
        for name in re.findall(r"`(coli_[a-z_]+)(?:\{[^}]*\})?`", cells[0]):
            metrics[name] = cells[1]
    assert len(metrics) >= 15, metrics
    return metrics


def is_size(s: str) -> bool:
    """server/src/engine_options.rs's is_size: digits[.digits] then K|M|G|T with optional B/iB, or B."""
    return re.fullmatch(r"[0-9]+(\.[0-9]+)?([KMGT](B|IB)?|B)?", s.strip().upper()) is not None


# --------------------------------------------------------------------------------------------
# Rendering, building, validating.


def values_files() -> dict[str, Path | None]:
    files: dict[str, Path | None] = {"default": None}
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        files[path.name[: -len("-values.yaml")]] = path
    return files


VALUES = values_files()


def load_values(name: str) -> dict | None:
    path = VALUES[name]
    return yaml.safe_load(path.read_text(encoding="utf-8")) if path else None


def chart_values(overrides: dict | None) -> dict:
    """The chart's values.yaml with `overrides` merged in, as Helm coalesces them."""

    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            out = dict(base)
            for k, v in over.items():
                out[k] = merge(base.get(k), v) if k in base else v
            return out
        return over

    base = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    return merge(base, overrides or {})


def render(values: dict | None) -> dict[str, str]:
    chart = helm_python.Chart.load(str(CHART))
    return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def template_stream(rendered: dict[str, str]) -> str:
    """The rendered templates as `helm template` prints them: one `---` document per manifest,
    headed by `# Source:`, NOTES.txt left out."""
    out = []
    for path in sorted(rendered):
        if path.endswith("NOTES.txt"):
            continue
        for doc in re.split(r"(?m)^---[ \t]*$", rendered[path]):
            if any(line.strip() and not line.lstrip().startswith("#") for line in doc.splitlines()):
                out.append(f"---\n# Source: {path}\n{doc.strip()}\n")
    return "".join(out)


def manifests(stream: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(stream) if d]


_RENDER_CACHE: dict[str, tuple[dict[str, str], list[dict]]] = {}


def rendered_set(name: str) -> tuple[dict[str, str], list[dict]]:
    if name not in _RENDER_CACHE:
        rendered = render(load_values(name))
        _RENDER_CACHE[name] = (rendered, manifests(template_stream(rendered)))
    return _RENDER_CACHE[name]


def kustomize_command() -> list[str] | None:
    """The real kustomize: a `kustomize` binary, or `kubectl kustomize` when it embeds v4+.
    COLI_TEST_KUSTOMIZE=lite forces kustomize_lite (to test the fallback itself)."""
    if os.environ.get("COLI_TEST_KUSTOMIZE") == "lite":
        return None
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        try:
            out = subprocess.run(
                ["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
            )
            version = json.loads(out.stdout).get("kustomizeVersion", "")
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        major = re.match(r"v?(\d+)\.", version)
        if major and int(major.group(1)) >= 4:
            return ["kubectl", "kustomize"]
    return None


KUSTOMIZE = kustomize_command()
OVERLAYS = ["base", "overlays/cpu", "overlays/gpu"]


def kustomize_build(overlay: str) -> list[dict]:
    directory = K8S / overlay
    if KUSTOMIZE:
        out = subprocess.run(
            KUSTOMIZE + [str(directory)], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return manifests(out)
    return kustomize_lite.build(str(directory))


def validate_schema(doc: dict, version: str) -> None:
    """Kubernetes schema validation (strict), or the basic shape for a CRD kind."""
    kind = (doc.get("apiVersion"), doc.get("kind"))
    if kind in CRD_KINDS:
        check_crd_shape(doc)
        return
    problem = None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        problem = f"{doc['kind']}/{doc['metadata']['name']} against {version}: {'.'.join(map(str, e.path))}: {e.message}"
    if problem:
        pytest.fail(problem)


def check_crd_shape(doc: dict) -> None:
    name = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
    assert isinstance(doc.get("metadata", {}).get("name"), str), name
    spec = doc.get("spec")
    assert isinstance(spec, dict), f"{name}: spec"
    if doc["kind"] == "ServiceMonitor":
        assert isinstance(spec.get("selector", {}).get("matchLabels"), dict), f"{name}: spec.selector.matchLabels"
        assert spec.get("endpoints"), f"{name}: spec.endpoints"
        for ep in spec["endpoints"]:
            assert isinstance(ep.get("port"), str), f"{name}: endpoint port (a Service port name)"
            assert ep.get("path", "/metrics").startswith("/")
            for key in ("interval", "scrapeTimeout"):
                if key in ep:
                    assert DURATION.match(ep[key]), f"{name}: {key} {ep[key]}"
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}, f"{name}: {sorted(spec)}"
    elif doc["kind"] == "PrometheusRule":
        assert set(spec) == {"groups"}, f"{name}: {sorted(spec)}"
        check_rule_groups(spec["groups"])


def check_rule_groups(groups: list) -> None:
    assert isinstance(groups, list) and groups
    for group in groups:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}
        assert isinstance(group["name"], str) and group["rules"]
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert isinstance(rule["expr"], str)
            if "for" in rule:
                assert DURATION.match(rule["for"]), rule["for"]


def yamllint_problems(text: str, conf: yamllint_config.YamlLintConfig, name: str) -> list[str]:
    return [f"{name}:{p.line}:{p.column}: [{p.level}] {p.desc} ({p.rule})" for p in yamllint_linter.run(text, conf)]


# --------------------------------------------------------------------------------------------
# What a schema cannot check: the pod's wiring.


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def is_router(doc: dict) -> bool:
    """A manifest of the chart's optional router (values `router`; checked by check_router)."""
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"


def check_workload(docs: list[dict], *, existing: set[str] = frozenset()) -> dict:
    """Checks every manifest of one deployment of colibri; returns facts for further checks.
    `existing` names Secrets and claims that exist outside these manifests. The router's
    manifests, when there are any, are left to check_router."""
    docs = [d for d in docs if not is_router(d)]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
    assert len(workloads) == 1, [w["kind"] for w in workloads]
    work = workloads[0]
    spec = work["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items(), "the selector does not select the pod template"
    pod = spec["template"]["spec"]
    assert len(pod["containers"]) == 1
    c = pod["containers"][0]
    env = {e["name"]: e for e in c.get("env", [])}

    # Command line and configuration file.
    args = c["args"]
    assert args[0] == "serve"
    assert args[args.index("--config") + 1] == "/etc/colibri/colibri.toml"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes or m["name"] in templates, f"mount {m['mountPath']}: no volume {m['name']}"
    assert len(mounts) == len(c["volumeMounts"]), "two mounts at one path"
    config_volume = volumes[mounts["/etc/colibri"]["name"]]
    assert mounts["/etc/colibri"].get("readOnly")
    cm = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == config_volume["configMap"]["name"]]
    assert len(cm) == 1, "the ConfigMap the pod mounts is not among the manifests"
    toml_text = cm[0]["data"]["colibri.toml"]
    profile = tomllib.loads(toml_text)

    keys = set(config_keys())
    tables = {"": {k: v for k, v in profile.items() if k != "profiles"}}
    for pname, table in profile.get("profiles", {}).items():
        tables[f"profiles.{pname}"] = table
    for where, table in tables.items():
        unknown = set(table) - keys
        assert not unknown, f"colibri.toml {where or 'top level'}: keys the server refuses: {unknown}"
        assert "api_keys" not in table, "API keys belong in the Secret, not the ConfigMap"
    if "--profile" in args:
        assert args[args.index("--profile") + 1] in profile.get("profiles", {}), "--profile names no table"

    ignored, prefixes = ignored_env()
    for name in env:
        if name.startswith("COLI_") and name not in ignored and not any(name.startswith(p) for p in prefixes):
            assert name[5:].lower() in keys, f"{name} is no configuration key: the server would refuse to start"

    def effective(key, default=None):
        """The value after the layers the manifests set: the file, then COLI_<KEY>."""
        var = env.get(f"COLI_{key.upper()}")
        if var is not None and "value" in var:
            return var["value"]
        return profile.get(key, default)

    # Listening where the Service and the probes reach it.
    port = [p for p in c["ports"] if p["name"] == "http"]
    assert len(port) == 1
    assert int(effective("port", 8080)) == port[0]["containerPort"]
    assert effective("host") in ("0.0.0.0", "::"), "the server would listen on loopback only"

    # State, cache, scratch.
    assert env["COLI_STATE_DIR"]["value"] == "/var/lib/colibri"
    assert "/var/lib/colibri" in mounts and not mounts["/var/lib/colibri"].get("readOnly")
    assert env["COLI_CACHE_DIR"]["value"] in mounts
    assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]["name"]]

    # Model and mirrors, read-only.
    model = effective("model")
    init_containers = pod.get("initContainers", [])
    pullers = [i for i in init_containers if i.get("args", [])[:1] == ["pull"]]
    if "/models" in mounts:
        assert mounts["/models"].get("readOnly"), "/models must be read-only"
        model_volume = volumes[mounts["/models"]["name"]]
        if "persistentVolumeClaim" in model_volume and not pullers:
            assert model_volume["persistentVolumeClaim"].get("readOnly")
        assert model and model.startswith("/models/"), f"model {model!r} is not on the model volume"

    # Init containers: as locked down as the server; only `coli pull` writes the model volume,
    # into the directory the server reads.
    for init in init_containers:
        isc = init.get("securityContext", {})
        assert isc.get("runAsNonRoot") or psc_of(pod).get("runAsNonRoot"), init["name"]
        assert isc.get("runAsUser", psc_of(pod).get("runAsUser")) == 10001, init["name"]
        assert isc["readOnlyRootFilesystem"] is True and isc["allowPrivilegeEscalation"] is False
        assert isc["capabilities"]["drop"] == ["ALL"]
        for m in init.get("volumeMounts", []):
            assert m["name"] in volumes, f"init container {init['name']}: no volume {m['name']}"
            if m["mountPath"] == "/models" and init not in pullers:
                assert m.get("readOnly"), f"init container {init['name']} writes the model volume"
    for init in pullers:
        assert init["command"] == ["coli"], "the pull bypasses the images' serve wrapper"
        args = init["args"]
        target = args[args.index("--to") + 1]
        assert target == model, f"the pull fills {target}, the server reads {model}"
        init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
        assert init_mounts["/models"]["name"] == mounts["/models"]["name"]
        assert not init_mounts["/models"].get("readOnly")
    mirrors = effective("mirrors", [])
    if isinstance(mirrors, str):
        mirrors = [m for m in mirrors.split(",") if m]
    mirror_mounts = {p: m for p, m in mounts.items() if p.startswith("/mirrors/")}
    for path, m in mirror_mounts.items():
        assert m.get("readOnly"), f"{path} must be read-only"
        assert re.fullmatch(r"/mirrors/[a-z0-9-]+", path)
    for mirror in mirrors:
        assert any(mirror == p or mirror.startswith(p + "/") for p in mirror_mounts), f"mirror {mirror} is not mounted"
    assert len(mirrors) == len(mirror_mounts), "a mirror drive is mounted but not passed to the server"

    # RAM and VRAM budgets, when set, parse; the device is one coli knows.
    ram = effective("ram")
    if ram is not None:
        assert is_size(str(ram)), f"ram {ram!r}"
    vram = effective("vram")
    if vram is not None:
        assert is_size(str(vram)), f"vram {vram!r}"
    assert effective("device", "auto") in ("auto", "cpu", "cuda", "vulkan"), effective("device")

    # API keys from a Secret.
    if "COLI_API_KEYS" in env:
        ref = env["COLI_API_KEYS"]["valueFrom"]["secretKeyRef"]
        secret_name = ref["name"]
        if secret_name not in existing:
            secrets = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == secret_name]
            assert len(secrets) == 1, f"Secret {secret_name} missing"
            data = secrets[0].get("data", {}) | secrets[0].get("stringData", {})
            assert ref["key"] in data

    # Claims exist.
    for v in pod["volumes"]:
        claim = v.get("persistentVolumeClaim", {}).get("claimName")
        if claim and claim not in existing:
            assert ("PersistentVolumeClaim", claim) in names, f"claim {claim} is neither rendered nor declared existing"

    # Probes.
    startup, ready, live = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
    assert startup["httpGet"]["path"] == "/ready" and ready["httpGet"]["path"] == "/ready"
    assert live["httpGet"]["path"] == "/health"
    for probe in (startup, ready, live):
        assert probe["httpGet"]["port"] in ("http", port[0]["containerPort"])
    budget = startup["failureThreshold"] * startup["periodSeconds"]
    assert budget >= 20 * 60, f"the startup probe allows {budget} s for a model load"

    # Shutdown: the endpoint leaves before SIGTERM; the drain ends before SIGKILL.
    pre_stop = c["lifecycle"]["preStop"]
    sleep = pre_stop["sleep"]["seconds"] if "sleep" in pre_stop else int(pre_stop["exec"]["command"][-1])
    assert 1 <= sleep <= 30
    drain = int(effective("drain_secs", 30))
    assert pod["terminationGracePeriodSeconds"] > sleep + drain, "SIGKILL would cut the drain short"

    # Security.
    psc, sc = pod.get("securityContext", {}), c["securityContext"]
    assert psc.get("runAsNonRoot") or sc.get("runAsNonRoot")
    assert sc.get("runAsUser", psc.get("runAsUser")) == 10001
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod.get("automountServiceAccountToken") is False

    # Resources.
    assert c["resources"]["limits"]["memory"]

    # Services select the pods and target the http port.
    services = by_kind(docs, "Service")
    assert services
    for svc in services:
        assert svc["spec"]["selector"].items() <= pod_labels.items(), f"Service {svc['metadata']['name']}"
        assert any(p["name"] == "http" and p["targetPort"] in ("http", 8080) for p in svc["spec"]["ports"])
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    return {
        "workload": work,
        "pod": pod,
        "container": c,
        "env": env,
        "profile": profile,
        "mounts": mounts,
        "volumes": volumes,
        "effective": effective,
    }


def psc_of(pod: dict) -> dict:
    return pod.get("securityContext", {})


def memory_mib(quantity: str) -> float:
    factors = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(quantity))
    return float(m.group(1)) * factors[m.group(2)] / 2**20


# --------------------------------------------------------------------------------------------
# The server's definitions the deployment relies on.


def test_docs_metrics_are_the_servers():
    """docs/api.md's metrics table, which the dashboard and alerts are checked against, lists
    exactly the metrics the server registers (server/src/serve/metrics.rs)."""
    source = (ROOT / "server" / "src" / "serve" / "metrics.rs").read_text(encoding="utf-8")
    source = source.split("#[cfg(test)]", 1)[0]
    defined = set(re.findall(r'"(coli_[a-z_]+)"', source))
    documented = documented_metrics()
    assert set(documented) == defined
    # Prometheus reserves `_total` for counters: every counter is named so, and nothing else.
    for name, kind in documented.items():
        assert name.endswith("_total") == (kind == "counter"), f"{name} is documented as a {kind}"


def test_chart_config_keys_are_the_servers():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text(encoding="utf-8")
    block = re.search(r'define "colibri.configKeys" -}}\n(.*?)\n', helpers)
    assert block.group(1).split() == config_keys()
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert set(values["config"]) <= set(config_keys())
    assert not {"api_keys", "mirrors", "port"} & set(values["config"]), "keys the chart manages"


def test_values_documented():
    """Every top-level key of values.yaml has a comment above it, and every other key has one
    above it or above its parent."""
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)(- )?([A-Za-z_][\w./-]*):", line)
        if not m or m.group(2):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        commented = j >= 0 and lines[j].lstrip().startswith("#")
        sibling = j >= 0 and re.match(r"^\s*", lines[j]).end() == indent and not commented
        documented = commented or (indent > 0 and (any(d for _, d in stack) or sibling))
        if indent == 0 and not commented:
            undocumented.append(f"values.yaml:{i + 1}: {m.group(3)}")
        elif not documented:
            undocumented.append(f"values.yaml:{i + 1}: {m.group(3)}")
        stack.append((indent, documented))
    assert not undocumented


# --------------------------------------------------------------------------------------------
# yamllint.


def test_yamllint_files():
    conf = yamllint_config.YamlLintConfig(file=str(YAMLLINT_CONFIG))
    files = sorted(
        p
        for base in (ROOT / "helm", K8S)
        for p in base.rglob("*")
        if p.suffix in (".yaml", ".yml") and "templates" not in p.relative_to(ROOT).parts
    )
    assert len(files) >= 12
    problems = []
    for path in files:
        problems += yamllint_problems(path.read_text(encoding="utf-8"), conf, str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("values", sorted(VALUES))
def test_yamllint_rendered(values):
    conf = yamllint_config.YamlLintConfig(
        content=(
            f"extends: {YAMLLINT_CONFIG}\n"
            "rules:\n"
            "  document-start: {present: true}\n"
            "  indentation: {spaces: 2, indent-sequences: whatever}\n"
        )
    )
    rendered, _ = rendered_set(values)
    problems = yamllint_problems(template_stream(rendered), conf, f"rendered[{values}]")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------
# The chart.


@pytest.mark.parametrize("values", sorted(VALUES))
def test_helm_lint(values):
    report = helm_python.lint(str(CHART), load_values(values), strict=True, kube_version="v" + K8S_VERSIONS[0])
    bad = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
    assert not bad, bad


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", sorted(VALUES))
def test_chart_schema(values, version):
    _, docs = rendered_set(values)
    assert docs
    for doc in docs:
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']} without the release namespace"
        validate_schema(doc, version)


@pytest.mark.parametrize("values", sorted(VALUES))
def test_chart_wiring(values):
    rendered, docs = rendered_set(values)
    vals = chart_values(load_values(values))
    existing = {vals["apiKeys"]["existingSecret"]} - {""}
    if vals["modelVolume"]["enabled"] and vals["modelVolume"]["type"] == "pvc":
        existing.add(vals["modelVolume"]["pvc"]["claimName"])
    existing |= {m["claimName"] for m in vals["mirrors"] if m.get("claimName")}
    facts = check_workload(docs, existing=existing)
    work, pod, c = facts["workload"], facts["pod"], facts["container"]
    effective = facts["effective"]

    assert work["kind"] == vals["kind"]
    image = f"{vals['image']['repository']}:{vals['image']['tag']}"
    assert c["image"] == image and c["imagePullPolicy"] == "IfNotPresent"

    # RAM budget = memory limit × fraction.
    limit = vals["resources"]["limits"]["memory"]
    if vals["config"].get("ram"):
        assert effective("ram") == vals["config"]["ram"]
    elif vals["ramFromMemoryLimit"]["enabled"]:
        expected = math.floor(math.floor(memory_mib(limit)) * vals["ramFromMemoryLimit"]["fraction"])
        assert effective("ram") == f"{expected}M"

    # Mirrors: mounted at /mirrors/NAME and passed as /mirrors/NAME/DIR.
    expected_mirrors = [f"/mirrors/{m['name']}/{m.get('dir', '')}".rstrip("/") for m in vals["mirrors"]]
    assert facts["profile"].get("mirrors", []) == expected_mirrors

    # GPU: the resource, and the device and VRAM budget in colibri.toml.
    gpu = c["resources"]["limits"].get("nvidia.com/gpu")
    if vals["gpu"]["enabled"]:
        assert gpu == vals["gpu"]["count"] >= 1
        assert pod.get("nodeSelector") and pod.get("tolerations")
        assert facts["profile"].get("device") == (vals["config"].get("device") or vals["gpu"]["device"] or None)
        assert facts["profile"].get("vram") == (vals["config"].get("vram") or vals["gpu"]["vram"])
    else:
        assert gpu is None
        assert facts["profile"].get("device") == vals["config"].get("device")
        assert facts["profile"].get("vram") == vals["config"].get("vram")

    # Grace period: preStop + drain + 10 unless set.
    if vals["terminationGracePeriodSeconds"] is None:
        drain = vals["config"]["drain_secs"]
        assert pod["terminationGracePeriodSeconds"] == vals["lifecycle"]["preStopSleepSeconds"] + drain + 10
    if values == "default":
        assert pod["terminationGracePeriodSeconds"] == 45
        assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 1800

    # State: per replica in a StatefulSet.
    state_mount = facts["mounts"]["/var/lib/colibri"]["name"]
    if work["kind"] == "StatefulSet":
        assert [t["metadata"]["name"] for t in work["spec"]["volumeClaimTemplates"]] == [state_mount]
        headless = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == work["spec"]["serviceName"]]
        assert headless and headless[0]["spec"]["clusterIP"] == "None"
    else:
        assert "emptyDir" in facts["volumes"][state_mount] or "persistentVolumeClaim" in facts["volumes"][state_mount]

    # Autoscaling on the server's own metrics.
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert bool(hpas) == vals["autoscaling"]["enabled"]
    metrics = documented_metrics()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == (work["kind"], work["metadata"]["name"])
        assert "replicas" not in work["spec"], "the HPA owns the replica count"
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "Pods" and m["pods"]["metric"]["name"] in metrics
            assert metrics[m["pods"]["metric"]["name"]] == "gauge"

    # ServiceMonitor: the main Service's http port, once.
    for sm in by_kind(docs, "ServiceMonitor"):
        selected = [
            s for s in by_kind(docs, "Service") if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, "the ServiceMonitor would scrape each pod more than once"
        assert any(p["name"] == sm["spec"]["endpoints"][0]["port"] for p in selected[0]["spec"]["ports"])
        assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert bool(by_kind(docs, "ServiceMonitor")) == vals["serviceMonitor"]["enabled"]

    # NOTES.txt says how to reach it.
    notes = next(v for k, v in rendered.items() if k.endswith("NOTES.txt"))
    for needle in ("port-forward", "curl", "OpenAI(base_url="):
        assert needle in notes


def test_gpu_values():
    _, docs = rendered_set("gpu")
    facts = check_workload(docs, existing={"colibri-api-keys"})
    c, pod = facts["container"], facts["pod"]
    assert c["image"] == "colibri:cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert facts["profile"]["device"] == "cuda" and facts["profile"]["vram"] == "72G"
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "hostPath" in facts["volumes"][facts["mounts"]["/models"]["name"]]
    assert len([p for p in facts["mounts"] if p.startswith("/mirrors/")]) == 2


def test_statefulset_values():
    _, docs = rendered_set("statefulset")
    assert one(docs, "StatefulSet")["spec"]["podManagementPolicy"] == "Parallel"
    secret = one(docs, "Secret")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "sk-colibri-one,sk-colibri-two"
    cm = tomllib.loads(one(docs, "ConfigMap")["data"]["colibri.toml"])
    assert cm["profiles"]["lowmem"]["slots"] == 2


def test_docs_examples():
    """docs/deploy.md's Helm values example renders into a valid deployment, and its model
    loading Job is a valid manifest."""
    docs_path = ROOT / "docs" / "deploy.md"
    text = docs_path.read_text(encoding="utf-8") if docs_path.exists() else ""
    if "## Helm on GPU nodes" not in text:
        pytest.skip("docs/deploy.md has no Helm section")
    section = text.split("## Helm on GPU nodes", 1)[1]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    values = [b for b in blocks if isinstance(b, dict) and "gpu" in b and "config" in b]
    assert values, "no values example in the Helm section"
    docs = manifests(template_stream(render(values[0])))
    check_workload(docs, existing={values[0].get("apiKeys", {}).get("existingSecret", "")})
    for doc in docs:
        validate_schema(doc, K8S_VERSIONS[0])
    jobs = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Job"]
    for job in jobs:
        for version in K8S_VERSIONS:
            validate_schema(job, version)


@pytest.mark.parametrize(
    "values,device,vram",
    [
        ({}, None, None),
        ({"gpu": {"enabled": True}}, "cuda", None),
        ({"gpu": {"enabled": True, "vram": "20G"}}, "cuda", "20G"),
        ({"gpu": {"enabled": True, "device": ""}}, None, None),
        ({"gpu": {"enabled": True, "device": "vulkan", "resourceName": "amd.com/gpu"}}, "vulkan", None),
        ({"gpu": {"enabled": True, "vram": "20G"}, "config": {"device": "auto", "vram": "10G"}}, "auto", "10G"),
        ({"gpu": {"enabled": True}, "config": {"device": None}}, "cuda", None),
        ({"config": {"device": "vulkan", "vram": "4G"}}, "vulkan", "4G"),
    ],
)
def test_chart_device(values, device, vram):
    """`gpu.enabled` writes `gpu.device` and `gpu.vram` into colibri.toml where `config.device`
    and `config.vram` leave them null; without a GPU only `config` sets them."""
    docs = manifests(template_stream(render(values)))
    profile = tomllib.loads(one(docs, "ConfigMap")["data"]["colibri.toml"])
    assert (profile.get("device"), profile.get("vram")) == (device, vram)


BAD_VALUES = {
    "unknown config key": ({"config": {"slot": 4}}, "unknown configuration key"),
    "unknown key in a profile": ({"profiles": {"x": {"colour": "red"}}}, "unknown configuration key"),
    "managed key": ({"config": {"port": 9000}}, "is set by the chart"),
    "api keys in the config": ({"config": {"api_keys": ["k"]}}, "is set by the chart"),
    "bad kind": ({"kind": "DaemonSet"}, "kind must be Deployment or StatefulSet"),
    "shared state claim": ({"state": {"type": "pvc"}, "replicaCount": 2}, "replicas must not share"),
    "claim template in a Deployment": ({"state": {"type": "volumeClaimTemplate"}}, "needs kind: StatefulSet"),
    "mirror without a drive": ({"mirrors": [{"name": "nvme1", "dir": "m"}]}, "exactly one of hostPath or claimName"),
    "mirror name": ({"mirrors": [{"name": "NVMe_1", "hostPath": "/mnt"}]}, "must be a DNS label"),
    "memory quantity": ({"resources": {"limits": {"memory": "lots"}}}, "cannot read the memory quantity"),
    "tiny RAM budget": ({"resources": {"limits": {"memory": "256Mi"}}}, "raise resources.limits.memory"),
    "key with a comma": ({"apiKeys": {"keys": ["a,b"]}}, "must not contain a comma"),
    "model claim without a name": ({"modelVolume": {"enabled": True, "type": "pvc"}}, "needs modelVolume.pvc.claimName"),
    "pull without a model volume": ({"modelPull": {"enabled": True, "repo": "a/b"}}, "modelPull needs modelVolume.enabled"),
    "pull of no repository": (
        {"modelVolume": {"enabled": True}, "modelPull": {"enabled": True, "repo": "just-a-name"}},
        "modelPull.repo must be ORG/NAME",
    ),
    "pull outside /models": (
        {"modelVolume": {"enabled": True}, "modelPull": {"enabled": True, "repo": "a/b", "dir": "../etc"}},
        "modelPull.dir must be one directory name",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_chart_refuses(case):
    values, message = BAD_VALUES[case]
    with pytest.raises(helm_python.HelmError) as e:
        render(values)
    assert message in str(e.value)


def pull_values(**pull) -> dict:
    return {
        "modelVolume": {"enabled": True, "type": "pvc", "pvc": {"claimName": "models"}},
        "modelPull": {"enabled": True, "repo": "Qwen/Qwen3-30B-A3B"} | pull,
    }


def test_model_pull_init_container():
    """`modelPull` adds an init container that runs `coli pull` as the non-root user into the
    model volume (writable for it alone), with the token from the Secret; the server reads the
    directory it fills, read-only; without `modelPull` there is no init container and the
    claim is read-only."""
    values = pull_values(revision="v1.0", include=["*.json", "model-*.safetensors"], tokenSecret={"name": "hf-token", "key": "tok"}, endpoint="https://hf-mirror.example")
    docs = manifests(template_stream(render(values)))
    facts = check_workload(docs, existing={"models"})
    pod, c = facts["pod"], facts["container"]
    [init] = pod["initContainers"]
    assert init["name"] == "model-pull" and init["image"] == c["image"]
    assert init["command"] == ["coli"]
    assert init["args"] == [
        "pull", "Qwen/Qwen3-30B-A3B@v1.0", "--to", "/models/Qwen3-30B-A3B", "--jobs", "4",
        "--include", "*.json", "--include", "model-*.safetensors",
    ]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "tok"}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example"
    assert env["HF_HOME"]["value"].startswith("/tmp/")
    assert init["securityContext"] == c["securityContext"]
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert set(mounts) == {"/models", "/tmp"} and not mounts["/models"].get("readOnly")
    assert facts["mounts"]["/models"]["readOnly"] is True
    assert facts["volumes"]["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
    assert facts["profile"]["model"] == "/models/Qwen3-30B-A3B"
    for version in K8S_VERSIONS:
        for doc in docs:
            validate_schema(doc, version)

    # Defaults: main, the default selection, no token; `dir` and `config.model` chosen.
    docs = manifests(template_stream(render(pull_values(dir="qwen3") | {"config": {"model": "/models/qwen3"}})))
    facts = check_workload(docs, existing={"models"})
    [init] = facts["pod"]["initContainers"]
    assert init["args"] == ["pull", "Qwen/Qwen3-30B-A3B@main", "--to", "/models/qwen3", "--jobs", "4"]
    assert "HF_TOKEN" not in {e["name"] for e in init["env"]}
    # hostPath volumes too.
    hostpath = pull_values() | {"modelVolume": {"enabled": True, "type": "hostPath"}}
    facts = check_workload(manifests(template_stream(render(hostpath))))
    assert "hostPath" in facts["volumes"]["models"]
    # Off: no init container, the claim read-only.
    docs = manifests(template_stream(render({"modelVolume": pull_values()["modelVolume"], "config": {"model": "/models/m"}})))
    facts = check_workload(docs, existing={"models"})
    assert "initContainers" not in facts["pod"]
    assert facts["volumes"]["models"]["persistentVolumeClaim"]["readOnly"] is True


def test_model_pull_arguments_parse(tmp_path):
    """The init container's command line is one the `coli` binary accepts: run against a port
    nothing listens on, it fails to connect (exit 1), not on its arguments (clap's exit 2)."""
    binary = coli_binary()
    if binary is None:
        pytest.skip("no coli binary built (cargo build -p colibri-server)")
    values = pull_values(include=["*.json"], tokenSecret={"name": "hf-token"})
    [init] = one(manifests(template_stream(render(values))), "Deployment")["spec"]["template"]["spec"]["initContainers"]
    args = [a.replace("/models/", f"{tmp_path}/") for a in init["args"]]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    run = subprocess.run([str(binary), *args], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "Qwen/Qwen3-30B-A3B@main" in run.stderr and f"127.0.0.1:{port}" in run.stderr, run.stderr


@pytest.mark.parametrize(
    "limit,fraction,ram",
    [("32Gi", 0.75, "24576M"), ("96Gi", 0.8, "78643M"), ("1.5Gi", 0.5, "768M"), ("64G", 0.75, "45776M"), (34359738368, 0.5, "16384M")],
)
def test_ram_from_memory_limit(limit, fraction, ram):
    docs = manifests(
        template_stream(render({"resources": {"limits": {"memory": limit}}, "ramFromMemoryLimit": {"fraction": fraction}}))
    )
    assert tomllib.loads(one(docs, "ConfigMap")["data"]["colibri.toml"])["ram"] == ram
    explicit = manifests(template_stream(render({"config": {"ram": "10G"}})))
    assert tomllib.loads(one(explicit, "ConfigMap")["data"]["colibri.toml"])["ram"] == "10G"


# --------------------------------------------------------------------------------------------
# The kustomize manifests.


_BUILD_CACHE: dict[str, list[dict]] = {}


# --------------------------------------------------------------------------------------------
# The optional router (values `router`): nginx hashing on the conversation key over the
# StatefulSet's pods. Its nginx snippets are files/router/*.conf, which docker/replicas.sh
# mounts into the nginx it measures (docs/reliability.md "Replicas").

ROUTER_FILES = CHART / "files" / "router"


def check_router(docs: list[dict], vals: dict) -> dict:
    """Checks the router's manifests against the server's; returns its ConfigMap's data."""
    router = [d for d in docs if is_router(d)]
    server = [d for d in docs if not is_router(d)]
    assert sorted(d["kind"] for d in router) == ["ConfigMap", "Deployment", "Service"]
    cm, dep, svc = (one(router, k) for k in ("ConfigMap", "Deployment", "Service"))
    sts = one(server, "StatefulSet")
    headless = [s for s in by_kind(server, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    assert headless[0]["spec"].get("publishNotReadyAddresses") is False, "unready pods would get requests"

    # Selectors: the router's Service selects the router's pods only; nothing of the server's
    # (Services, PodDisruptionBudget, StatefulSet) selects them.
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert not svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    selectors = [s["spec"]["selector"] for s in by_kind(server, "Service")]
    selectors += [p["spec"]["selector"]["matchLabels"] for p in by_kind(server, "PodDisruptionBudget")]
    selectors.append(sts["spec"]["selector"]["matchLabels"])
    for sel in selectors:
        assert not sel.items() <= labels.items(), f"{sel} selects the router's pods"

    # The container: nginx with the ConfigMap's nginx.conf; every include is in the ConfigMap.
    assert len(pod["spec"]["containers"]) == 1
    c = pod["spec"]["containers"][0]
    data = cm["data"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    conf_dir = "/etc/nginx/colibri"
    assert volumes[mounts[conf_dir]["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert mounts[conf_dir]["readOnly"] is True
    assert c["command"][0] == "nginx" and c["command"][c["command"].index("-c") + 1] == f"{conf_dir}/nginx.conf"
    conf = data["nginx.conf"]
    for inc in re.findall(r"^\s*include\s+(\S+);", conf, re.M):
        assert inc.startswith(conf_dir + "/") and inc[len(conf_dir) + 1 :] in data, f"include {inc}"
    # One source: the snippets are the chart's files, byte for byte (bar the final newline).
    for name in ("conversation-key.conf", "proxy.conf"):
        assert data[name].rstrip("\n") == (ROUTER_FILES / name).read_text(encoding="utf-8").rstrip("\n"), name

    # nginx writes only /tmp, as a non-root user.
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    for path in ("pid", "client_body_temp_path", "proxy_temp_path"):
        assert re.search(rf"^\s*{path}\s+/tmp/", conf, re.M), path
    psc, sc = pod["spec"].get("securityContext", {}), c["securityContext"]
    assert psc.get("runAsNonRoot") and psc.get("runAsUser", 0) != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["spec"]["automountServiceAccountToken"] is False

    # Listening where the Service and the probes look; liveness on nginx itself.
    port = c["ports"][0]
    assert re.search(rf"^\s*listen\s+{port['containerPort']};", conf, re.M)
    assert svc["spec"]["ports"][0]["targetPort"] in ("http", port["containerPort"]) and port["name"] == "http"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert re.search(rf"location = {c['livenessProbe']['httpGet']['path']} {{", conf)

    # The upstream: each StatefulSet pod by its DNS name under the headless Service, re-resolved,
    # on the server's port; maxReplicas names with autoscaling.
    servers = re.findall(r"^\s*server\s+(\S+)\s+resolve\s+max_fails=(\d+)\s+fail_timeout=(\S+);", conf, re.M)
    count = vals["autoscaling"]["maxReplicas"] if vals["autoscaling"]["enabled"] else vals["replicaCount"]
    name, ns = sts["metadata"]["name"], sts["metadata"]["namespace"]
    domain = vals["router"]["clusterDomain"]
    server_port = one(server, "ConfigMap")["data"]["colibri.toml"]
    server_port = int(re.search(r"^port = (\d+)$", server_port, re.M).group(1))
    assert [s[0] for s in servers] == [
        f"{name}-{i}.{headless[0]['metadata']['name']}.{ns}.svc.{domain}:{server_port}" for i in range(count)
    ]
    assert all(s[1:] == (str(vals["router"]["maxFails"]), vals["router"]["failTimeout"]) for s in servers)
    assert re.search(r"^\s*zone\s+\S+\s+\S+;", conf, re.M), "`resolve` needs a shared memory zone"
    assert re.search(rf"^\s*resolver\s+{re.escape(vals['router']['resolver'])}\b", conf, re.M)
    balance = "hash $colibri_conversation_key consistent;" if vals["router"]["balance"] == "hash" else "least_conn;"
    assert re.search(rf"^\s*{re.escape(balance)}$", conf, re.M), balance
    fallback = "$remote_addr" if vals["router"]["fallbackKey"] == "clientAddress" else "$request_id"
    assert re.search(rf"map \S+ \$colibri_key_fallback {{\s*default {re.escape(fallback)};\s*}}", conf)

    # The router's stop outlasts the server's drain.
    assert pod["spec"]["terminationGracePeriodSeconds"] >= int(vals["config"]["drain_secs"]), "nginx is stopped before the drain ends"
    return data


def test_router_values():
    _, docs = rendered_set("router")
    vals = chart_values(load_values("router"))
    check_workload(docs)
    check_router(docs, vals)
    assert one([d for d in docs if is_router(d)], "Deployment")["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    "router",
    [
        {},
        {"balance": "leastConn", "fallbackKey": "clientAddress"},
        {"clusterDomain": "k8s.example", "resolver": "10.96.0.10", "maxFails": 0, "failTimeout": "10s"},
    ],
)
@pytest.mark.parametrize("autoscaling", [False, True])
def test_router_renders(router, autoscaling):
    values = {
        "kind": "StatefulSet",
        "replicaCount": 2,
        "router": {"enabled": True} | router,
        "autoscaling": {"enabled": autoscaling, "maxReplicas": 5},
    }
    docs = manifests(template_stream(render(values)))
    check_workload(docs)
    check_router(docs, chart_values(values))
    for doc in docs:
        validate_schema(doc, K8S_VERSIONS[-1])


def test_router_off_by_default():
    _, docs = rendered_set("default")
    assert not [d for d in docs if is_router(d)]
    assert not [d for d in rendered_set("statefulset")[1] if is_router(d)]


ROUTER_BAD = {
    "router on a Deployment": ({"router": {"enabled": True}}, "router.enabled needs kind: StatefulSet"),
    "router and TLS": (
        {"kind": "StatefulSet", "router": {"enabled": True}, "config": {"tls_cert": "/c.pem", "tls_key": "/k.pem"}},
        "plain-HTTP replicas",
    ),
    "router balance": ({"kind": "StatefulSet", "router": {"enabled": True, "balance": "random"}}, "router.balance must be"),
    "router fallback": ({"kind": "StatefulSet", "router": {"enabled": True, "fallbackKey": "cookie"}}, "router.fallbackKey must be"),
    "router resolver": ({"kind": "StatefulSet", "router": {"enabled": True, "resolver": ""}}, "router.resolver must name"),
}


@pytest.mark.parametrize("case", sorted(ROUTER_BAD))
def test_router_refuses(case):
    values, message = ROUTER_BAD[case]
    with pytest.raises(helm_python.HelmError) as e:
        render(values)
    assert message in str(e.value)


def conversation_key_regex() -> re.Pattern:
    """The map of files/router/conversation-key.conf that reads `user` from the body, as a
    Python regex (nginx's PCRE syntax for it is the same but for `(?<name>` / `(?P<name>`)."""
    text = (ROUTER_FILES / "conversation-key.conf").read_text(encoding="utf-8")
    block = re.search(r"map \$request_body \$colibri_body_user \{\s*'~([^']*)' \$colibri_user;", text)
    assert block, "the map of $request_body is not in conversation-key.conf"
    return re.compile(block.group(1).replace("(?<", "(?P<"))


@pytest.mark.parametrize(
    "body,key",
    [
        ({"model": "m", "user": "alice", "messages": [{"role": "user", "content": "hi"}]}, "alice"),
        ({"messages": [{"role": "user", "content": "hi"}], "user": "u-42"}, "u-42"),
        ({"messages": [{"role": "user", "content": "hi"}]}, None),
        ({"messages": [{"role": "user", "content": 'say "user": "mallory"'}]}, None),
        ({"messages": [{"role": "user", "content": "hi"}], "user": ""}, None),
        ({"messages": [{"role": "user", "name": "user", "content": "hi"}]}, None),
    ],
)
def test_router_conversation_key_from_body(body, key):
    """The body's OpenAI `user` field is the key; the word "user" elsewhere (a role, a name, a
    quoted `"user": "..."` inside a message) is not; no `user` falls back."""
    for text in (json.dumps(body), json.dumps(body, separators=(",", ":"))):
        m = conversation_key_regex().search(text)
        assert (m.group("colibri_user") if m else None) == key, text


def test_router_snippets_parse(tmp_path):
    """The shared snippets in a minimal configuration pass `nginx -t` (when nginx is installed;
    docker/replicas.sh runs them for real)."""
    nginx = shutil.which("nginx")
    if not nginx:
        pytest.skip("no nginx binary")
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"""pid {tmp_path}/nginx.pid;
error_log stderr;
events {{}}
http {{
    access_log off;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fastcgi;
    uwsgi_temp_path {tmp_path}/uwsgi;
    scgi_temp_path {tmp_path}/scgi;
    include {ROUTER_FILES}/conversation-key.conf;
    map $remote_addr $colibri_key_fallback {{ default $remote_addr; }}
    upstream colibri {{
        hash $colibri_conversation_key consistent;
        server 127.0.0.1:9 max_fails=1 fail_timeout=5s;
        server 127.0.0.2:9 max_fails=1 fail_timeout=5s;
    }}
    server {{
        listen unix:{tmp_path}/nginx.sock;
        location / {{ include {ROUTER_FILES}/proxy.conf; }}
    }}
}}
""",
        encoding="utf-8",
    )
    result = subprocess.run([nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def built(overlay: str) -> list[dict]:
    if overlay not in _BUILD_CACHE:
        _BUILD_CACHE[overlay] = kustomize_build(overlay)
    return _BUILD_CACHE[overlay]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_schema(overlay, version):
    docs = built(overlay)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"}
    for doc in docs:
        validate_schema(doc, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_secret_example_schema(version):
    for doc in manifests((K8S / "base" / "secret.example.yaml").read_text(encoding="utf-8")):
        validate_schema(doc, version)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_wiring(overlay):
    facts = check_workload(built(overlay), existing={"colibri-api-keys"})
    c, pod = facts["container"], facts["pod"]
    limit = memory_mib(c["resources"]["limits"]["memory"])
    ram = facts["effective"]("ram")
    ram_mib = float(ram[:-1]) * {"M": 1, "G": 1024}[ram[-1]]
    assert 0.5 * limit <= ram_mib <= 0.85 * limit, f"ram {ram} against a {c['resources']['limits']['memory']} limit"
    secret = manifests((K8S / "base" / "secret.example.yaml").read_text(encoding="utf-8"))[0]
    assert facts["env"]["COLI_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    if overlay.endswith("gpu"):
        assert c["image"] == "colibri:cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        assert {"name": "COLI_DEVICE", "value": "cuda"} in c["env"]
        assert facts["effective"]("mirrors")
    else:
        assert c["image"] == "colibri:cpu"
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_lite_matches_kustomize(overlay):
    """The fallback builder gives what the real kustomize gives (when it is installed)."""
    if not KUSTOMIZE:
        pytest.skip("no kustomize v4+ binary and no kubectl embedding one: only kustomize_lite builds")
    key = lambda d: (d["apiVersion"], d["kind"], d["metadata"]["name"])  # noqa: E731
    real = {key(d): d for d in built(overlay)}
    mine = {key(d): d for d in kustomize_lite.build(str(K8S / overlay))}
    assert mine == real


def test_kustomize_lite_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(kustomize_lite.KustomizeError):
        kustomize_lite.build(str(tmp_path))


def test_kustomize_lite_merges_like_kustomize():
    original = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"}]}]}}
    merged = kustomize_lite.merge_patch(original, patch)
    assert merged["spec"]["containers"][0]["env"] == [
        {"name": "Y", "value": "3"},
        {"name": "Z", "value": "4"},
        {"name": "X", "value": "1"},
    ]
    assert kustomize_lite.merge_patch({"tolerations": [1, 2]}, {"tolerations": [3]}) == {"tolerations": [3]}
    assert kustomize_lite.merge_patch({"a": 1, "b": 2}, {"a": None}) == {"b": 2}


# --------------------------------------------------------------------------------------------
# Dashboard and alerts: PromQL over the documented metrics.

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROMETHEUS_METRICS = {"up"}
# Functions that need a counter-like series (monotonic but for restarts).
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by values PromQL accepts."""
    expr = re.sub(r"\$__(rate_)?interval|\$__range", "5m", expr)
    return re.sub(r"\$\{?[A-Za-z_]+\}?", "x", expr)


def promql_metrics(expr: str) -> list[tuple[str, str | None]]:
    """(metric, enclosing function) for every selector of a PromQL expression."""
    tree = promql_parser.parse(expr)
    found: list[tuple[str, str | None]] = []
    calls: list[str] = []

    def pre(node):
        if isinstance(node, promql_parser.Call):
            calls.append(node.func.name)
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            found.append((node.name, calls[-1] if calls else None))

    def post(node):
        if isinstance(node, promql_parser.Call):
            calls.pop()

    promql_parser.walk(tree, pre, post)
    assert found, f"no metric in {expr}"
    return found


def check_promql(expr: str) -> set[str]:
    documented = documented_metrics()
    used = set()
    for name, func in promql_metrics(expr):
        base = name
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in documented:
                base = name[: -len(suffix)]
                assert documented[base] == "histogram", f"{name}: {base} is no histogram"
        assert base in documented or name in PROMETHEUS_METRICS, f"{name} is not in docs/api.md's metrics table"
        if func in COUNTER_FUNCTIONS:
            assert name.endswith("_total") or name.endswith(HISTOGRAM_SUFFIXES), f"{func}({name}) needs a running total"
            assert documented.get(base) in ("counter", "histogram"), f"{func}({name}): {base} is a {documented.get(base)}, not a counter"
        if func == "histogram_quantile":
            pytest.fail(f"histogram_quantile over a raw selector in {expr}")
        used.add(name)
    if "histogram_quantile" in expr:
        assert re.search(r"_bucket\{", expr) and "by (le)" in expr.replace("by(le)", "by (le)"), expr
    return used


def dashboard_panels(dash: dict) -> list[dict]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def test_grafana_dashboard():
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text(encoding="utf-8"))
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${DS_PROMETHEUS}"
            check_promql(re.sub(r"label_values\((.*), *\w+\)$", r"\1", v["query"]["query"]).replace("$namespace", "x"))
    panels = dashboard_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    used: set[str] = set()
    exprs: list[str] = []
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']} overlaps another"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            expr = grafana_to_promql(t["expr"])
            used |= check_promql(expr)
            exprs.append(t["expr"])
    # The panels asked for.
    for metric in (
        "coli_generated_tokens_total",
        "coli_prompt_tokens_total",
        "coli_time_to_first_token_seconds_bucket",
        "coli_inter_token_latency_seconds_bucket",
        "coli_requests_total",
        "coli_queue_depth",
        "coli_active_slots",
        "coli_slots",
        "coli_expert_cache_hit_rate",
        "coli_bytes_read_total",
        "coli_memory_bytes",
    ):
        assert metric in used, f"no panel shows {metric}"
    for hist in ("coli_time_to_first_token_seconds", "coli_inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert any(f"histogram_quantile({q}, " in e and f"{hist}_bucket" in e for e in exprs), (hist, q)
    assert any("rate(coli_generated_tokens_total" in e for e in exprs)
    assert any("by (tier, kind)" in e and "coli_memory_bytes" in e for e in exprs)
    assert any("drive" in e and "rate(coli_bytes_read_total" in e for e in exprs)
    assert any("by (endpoint, status)" in e or "by (status)" in e for e in exprs)


def alert_groups() -> tuple[list, list]:
    rule = yaml.safe_load((MONITORING / "alerts.yaml").read_text(encoding="utf-8"))
    plain = yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text(encoding="utf-8"))
    return rule, plain


def test_alert_rules():
    rule, plain = alert_groups()
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    check_crd_shape(rule)
    check_rule_groups(plain["groups"])
    assert rule["spec"]["groups"] == plain["groups"], "alerts.yaml and prometheus-rules.yaml differ"
    alerts = {r["alert"]: r for g in plain["groups"] for r in g["rules"]}
    for name in ("ColibriNotReady", "ColibriTargetDown", "ColibriQueueSaturated", "ColibriHighErrorRate", "ColibriExpertHitRateCollapse"):
        assert name in alerts
    for name, r in alerts.items():
        used = check_promql(r["expr"])
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert used
    assert "coli_ready" in alerts["ColibriNotReady"]["expr"] and alerts["ColibriNotReady"]["for"] == "10m"
    assert "up" in alerts["ColibriTargetDown"]["expr"]
    assert "coli_queue_depth" in alerts["ColibriQueueSaturated"]["expr"] and alerts["ColibriQueueSaturated"]["for"] == "5m"
    err = alerts["ColibriHighErrorRate"]
    assert 'status=~"5.."' in err["expr"] and "0.05" in err["expr"] and err["for"] == "5m"
    hit = alerts["ColibriExpertHitRateCollapse"]
    assert "0.5" in hit["expr"] and hit["for"] == "15m" and "coli_generated_tokens_total" in hit["expr"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_rules():
    r = subprocess.run(
        ["promtool", "check", "rules", str(MONITORING / "prometheus-rules.yaml")],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------------------------
# The real server with the rendered configuration (when a built `coli` is at hand: CI runs this
# suite after `cargo test`, which builds target/debug/coli).


def coli_binary() -> Path | None:
    found = [p for p in (ROOT / "target" / "release" / "coli", ROOT / "target" / "debug" / "coli") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


COLI = coli_binary()
needs_coli = pytest.mark.skipif(COLI is None, reason="no built coli (target/release/coli or target/debug/coli)")


def pod_environment(container: dict, **overrides: str) -> dict[str, str]:
    """The container's environment as the kubelet sets it (secrets replaced by a dummy key),
    without this process's COLI_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else "sk-test-dummy"
    env.update(overrides)
    return env


def server_command(container: dict, config_path: Path, subcommand: str) -> list[str]:
    args = [a.replace("/etc/colibri/colibri.toml", str(config_path)) for a in container["args"][1:]]
    return [str(COLI), subcommand, *(["--show"] if subcommand == "config" else []), *args]


def write_config(docs: list[dict], directory: Path) -> Path:
    """The ConfigMap's colibri.toml, written into `directory`; its path."""
    config = directory / "colibri.toml"
    config.write_text(one(docs, "ConfigMap")["data"]["colibri.toml"], encoding="utf-8")
    return config


def config_show(container: dict, config_path: Path, cwd: Path, *extra: str) -> str:
    """What `coli config --show` prints with the container's arguments (and `extra`), the
    configuration file `config_path` and the pod's environment, run in `cwd`; it must succeed."""
    result = subprocess.run(
        server_command(container, config_path, "config") + list(extra),
        env=pod_environment(container),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def deployment_sets() -> list[str]:
    return [f"chart:{v}" for v in sorted(VALUES)] + [f"kustomize:{o}" for o in OVERLAYS]


def deployment_docs(which: str) -> list[dict]:
    kind, name = which.split(":", 1)
    return rendered_set(name)[1] if kind == "chart" else built(name)


@needs_coli
@pytest.mark.parametrize("which", deployment_sets())
def test_server_accepts_the_configuration(which, tmp_path):
    """`coli config --show` with the pod's arguments, configuration file and environment:
    the server refuses unknown keys and invalid values at start, so this is what it would do."""
    docs = [d for d in deployment_docs(which) if not is_router(d)]
    work = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")][0]
    container = work["spec"]["template"]["spec"]["containers"][0]
    config = write_config(docs, tmp_path)
    assert "host = \"0.0.0.0\"" in config_show(container, config, tmp_path)


# The engine options ci/engine-values.yaml sets, as colibri.toml and `coli config --show` spell
# them; `no_learn` comes from extraEnv.
ENGINE_VALUES = {
    "io": '"pool"',
    "io_threads": "8",
    "direct_io": "true",
    "cache_policy": '"lfru"',
    "pin_budget": '"1G"',
    "no_prefetch": "false",
    "mla_form": '"expanded"',
    "kv_dtype": '"bf16"',
    "draft": '"none"',
}


def test_chart_engine_options_reach_the_configuration():
    """Every engine option is a chart value (`config.KEY`) rendered into colibri.toml; a
    profile overrides one and extraEnv sets another as COLI_KEY."""
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert set(engine_keys()) - {"mirrors"} <= set(values["config"]), "an engine option has no chart value"
    rendered, docs = rendered_set("engine")
    facts = check_workload(docs)
    profile = facts["profile"]
    for key, text in ENGINE_VALUES.items():
        assert key in profile, f"{key} is not in colibri.toml"
        assert json.dumps(profile[key]) == text, f"{key} = {profile[key]!r}"
    assert profile["profiles"]["f32"] == {"kv_dtype": "f32"}
    assert facts["env"]["COLI_NO_LEARN"]["value"] == "true"
    # Unset values stay out of the file: the server's defaults apply.
    defaults = tomllib.loads(one(rendered_set("default")[1], "ConfigMap")["data"]["colibri.toml"])
    assert not set(ENGINE_VALUES) & set(defaults), "the default chart sets engine options"
    # config.mmap drops the budget derived from the memory limit (the server refuses both).
    mapped = tomllib.loads(one(manifests(template_stream(render({"config": {"mmap": True}}))), "ConfigMap")["data"]["colibri.toml"])
    assert mapped["mmap"] is True and "ram" not in mapped


@needs_coli
def test_server_reports_the_charts_engine_options(tmp_path):
    """`coli config --show` with the pod of ci/engine-values.yaml: each engine option has the
    chart's value and names colibri.toml (or the profile, or COLI_NO_LEARN) as its source."""
    _, docs = rendered_set("engine")
    container = [d for d in docs if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    config = write_config(docs, tmp_path)

    def show(*extra: str) -> str:
        return config_show(container, config, tmp_path, *extra)

    shown = show()
    for key, text in ENGINE_VALUES.items():
        assert f"{key} = {text}  # file {config}\n" in shown, f"{key} in:\n{shown}"
    assert "no_learn = true  # env COLI_NO_LEARN\n" in shown, shown
    assert f'kv_dtype = "f32"  # file {config} [profile f32]\n' in show("--profile", "f32")


@needs_coli
def test_default_chart_serves(tmp_path):
    """The default chart's configuration, environment and probes against `coli serve` (demo
    model): /health and /ready answer 200 within the startup budget, /metrics carries every
    metric the dashboard and the alerts use, and SIGTERM ends the process within the grace
    period, the usage history saved in COLI_STATE_DIR."""
    _, docs = rendered_set("default")
    pod = [d for d in docs if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config = write_config(docs, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state, cache = tmp_path / "state", tmp_path / "cache"
    state.mkdir()
    cache.mkdir()
    # Loopback only, on a free port: the pod's 0.0.0.0:8080 is not for a test machine.
    env = pod_environment(
        container,
        COLI_HOST="127.0.0.1",
        COLI_PORT=str(port),
        COLI_STATE_DIR=str(state),
        COLI_CACHE_DIR=str(cache),
        HOME=str(tmp_path),
    )
    env.pop("COLI_API_KEYS", None)
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen(server_command(container, config, "serve"), env=env, stdout=log, stderr=log, cwd=tmp_path)

    def get(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return None, ""

    try:
        probe = container["startupProbe"]
        deadline = time.monotonic() + min(600, probe["failureThreshold"] * probe["periodSeconds"])
        while get(probe["httpGet"]["path"])[0] != 200:
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(1)
        assert get(container["readinessProbe"]["httpGet"]["path"])[0] == 200
        assert get(container["livenessProbe"]["httpGet"]["path"])[0] == 200
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as r:
            assert r.status == 200
        status, metrics = get("/metrics")
        assert status == 200
        exposed = set(re.findall(r"^(coli_[a-z_]+)", metrics, re.M))
        dash = json.loads((MONITORING / "grafana-dashboard.json").read_text(encoding="utf-8"))
        exprs = [grafana_to_promql(t["expr"]) for p in dashboard_panels(dash) for t in p.get("targets", [])]
        exprs += [r["expr"] for g in alert_groups()[1]["groups"] for r in g["rules"]]
        used = {name for e in exprs for name, _ in promql_metrics(e)} - PROMETHEUS_METRICS
        assert used <= exposed, f"not in the live /metrics: {used - exposed}"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=pod["terminationGracePeriodSeconds"])
        assert proc.returncode == 0
        assert time.monotonic() - start < pod["terminationGracePeriodSeconds"] - container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert any(state.rglob("*")), "no usage history saved in COLI_STATE_DIR"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
