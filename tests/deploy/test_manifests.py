"""The Kubernetes manifests (deploy/k8s), rendered as `kubectl apply -k` would, against the code.

Both overlays are rendered with the kubectl the dev extras install next to the venv's Python.
Built-in objects are validated strictly against the newest Kubernetes schemas that
kubernetes-validate ships; custom resources (Prometheus Operator, KEDA) are checked field by
field. Then the objects are held against the code: the settings classes of shared/runtime/config.py,
the metrics of shared/runtime/metrics.py, the service entry points and the `cronbus` subcommands.
"""

from __future__ import annotations

import argparse
import ast
import base64
import binascii
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pydantic
import pytest
import yaml

from cronbus.cli.main import build_parser
from shared.contract import keys
from shared.runtime.config import (
    CommonSettings,
    ConsoleSettings,
    DispatcherSettings,
    ExecutorSettings,
    SweeperSettings,
)

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "production", "keda")
NAMESPACE = "cronbus"
KUBECTL = Path(sys.executable).parent / "kubectl"
#: The newest Kubernetes version kubernetes-validate has schemas for.
K8S_VERSION: str = kubernetes_validate.latest_version()

#: The settings class each component's container reads (`cronbus migrate` reads the sweeper's).
SETTINGS: dict[str, type[CommonSettings]] = {
    "dispatcher": DispatcherSettings,
    "executor": ExecutorSettings,
    "sweeper": SweeperSettings,
    "console": ConsoleSettings,
    "migrate": SweeperSettings,
}
SERVICES = ("dispatcher", "executor", "sweeper", "console")
#: Settings that come from the Secret, never from a ConfigMap: field -> key in the Secret.
SECRET_NAME = "cronbus-secrets"
SECRET_KEYS = {"redis_url": "redis-url", "amqp_url": "amqp-url", "database_url": "database-url"}
#: What each component connects to (the dev overlay's NetworkPolicies must let it).
NEEDS = {
    "dispatcher": ("redis_url", "amqp_url", "database_url"),
    "executor": ("redis_url", "amqp_url", "database_url"),
    "sweeper": ("redis_url", "amqp_url", "database_url"),
    "console": ("redis_url", "amqp_url", "database_url"),
    "migrate": ("database_url",),
}
DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "amqp": 5672, "amqps": 5671, "postgresql": 5432}
#: Custom resource kinds the overlays may use, by API group.
CUSTOM_KINDS = {
    "monitoring.coreos.com": {"ServiceMonitor", "PrometheusRule"},
    "keda.sh": {"ScaledObject"},
}
SEVERITIES = {"critical", "warning", "info"}
#: Grace a pod needs beyond CRONBUS_SHUTDOWN_GRACE_S to close its connections and exit.
SHUTDOWN_MARGIN_S = 5
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"


# --- rendering ---------------------------------------------------------------------------------


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    if not KUBECTL.exists():
        pytest.fail(f"{KUBECTL} is missing: install the dev extras (scripts/bootstrap.sh)")
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {overlay} failed:\n{done.stderr}")
    objects = tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)
    assert objects, f"{overlay} renders no object"
    return objects


def ident(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def of_kind(objects: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def named(objects: tuple[Obj, ...], kind: str, name: str) -> Obj | None:
    found = [obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name]
    assert len(found) <= 1, f"{kind}/{name} rendered twice"
    return found[0] if found else None


def is_builtin(obj: Obj) -> bool:
    group = obj["apiVersion"].rpartition("/")[0]
    return group == "" or "." not in group or group.endswith(".k8s.io")


def labels_of(obj: Obj) -> dict[str, str]:
    return dict(obj["metadata"].get("labels") or {})


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects these labels."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True


# --- workloads -----------------------------------------------------------------------------------


def workloads(objects: tuple[Obj, ...]) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] in {"Deployment", "StatefulSet", "Job"}]


def pod_labels(workload: Obj) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"].get("labels") or {})


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Obj) -> list[Obj]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def cronbus_workloads(objects: tuple[Obj, ...]) -> Iterator[tuple[Obj, str]]:
    """Each cronbus Deployment or Job with its component (dispatcher, ..., migrate)."""
    for workload in workloads(objects):
        labels = pod_labels(workload)
        if labels.get(LABEL_NAME) == "cronbus":
            yield workload, labels.get(LABEL_COMPONENT, "")


def cronbus_services(objects: tuple[Obj, ...]) -> Iterator[tuple[Obj, str]]:
    for workload, component in cronbus_workloads(objects):
        if workload["kind"] == "Deployment":
            yield workload, component


def container_env(objects: tuple[Obj, ...], container: Obj) -> dict[str, str | None]:
    """The container's environment: name -> value (None: from a Secret or the pod's fields)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            config_map = named(objects, "ConfigMap", source["configMapRef"]["name"])
            assert config_map is not None, f"ConfigMap {source['configMapRef']['name']} missing"
            env.update({prefix + k: str(v) for k, v in (config_map.get("data") or {}).items()})
        else:
            secret = named(objects, "Secret", source["secretRef"]["name"])
            assert secret is not None, (
                f"envFrom Secret {source['secretRef']['name']} is not rendered, so its keys are"
                " unknown: use env with secretKeyRef"
            )
            env.update(dict.fromkeys((prefix + k for k in secret.get("data") or {}), None))
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value") if "valueFrom" not in entry else None
    return env


def secret_refs(container: Obj) -> dict[str, tuple[str, str]]:
    """Env name -> (Secret name, key) for each variable read from a Secret."""
    refs: dict[str, tuple[str, str]] = {}
    for entry in container.get("env", []):
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            refs[entry["name"]] = (ref["name"], ref["key"])
    return refs


def env_name(cls: type[CommonSettings], field: str) -> str:
    return (str(cls.model_config.get("env_prefix", "")) + field).upper()


def effective_settings(cls: type[CommonSettings], env: Mapping[str, str | None]) -> CommonSettings:
    """The settings this environment gives (values from a Secret keep their defaults).

    pydantic-settings would also read the test process's own environment for the fields not
    given here; tests/conftest.py removes every CRONBUS_* variable from it first.
    """
    values = {
        field: env[env_name(cls, field)]
        for field in cls.model_fields
        if env.get(env_name(cls, field)) is not None
    }
    return cls.model_validate(values)


def is_secret_name(name: str) -> bool:
    """cronbus-secrets, or the name a secretGenerator gives it (a hash suffix)."""
    return re.fullmatch(rf"{SECRET_NAME}(-[a-z0-9]{{10}})?", name) is not None


def resolve_port(port: int | str, container: Obj) -> int | None:
    if isinstance(port, int):
        return port
    for declared in container.get("ports", []):
        if declared.get("name") == port:
            return int(declared["containerPort"])
    return None


# --- metrics and PromQL --------------------------------------------------------------------------

_METRIC_KINDS = {"Counter", "Gauge", "Histogram", "Summary"}
_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"} | {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_OFFSETS = re.compile(r"\boffset\s+-?[\w$]+")
_FUNCTIONS = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*(?=\s*\()")
_NAMES = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")


def exported_names(kind: str, name: str) -> set[str]:
    """The series names prometheus_client exports for one metric."""
    if kind == "Counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind == "Histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "Summary":
        return {name, f"{name}_sum", f"{name}_count", f"{name}_created"}
    return {name}


@functools.cache
def metric_catalogue() -> frozenset[str]:
    """Every series name the metrics of shared/runtime/metrics.py export."""
    tree = ast.parse((ROOT / "shared" / "runtime" / "metrics.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        first = node.args[0]
        if kind in _METRIC_KINDS and isinstance(first, ast.Constant):
            names |= exported_names(kind, str(first.value))
    return frozenset(names)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    text = _STRINGS.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _OFFSETS.sub(" ", text)
    text = _FUNCTIONS.sub(" ", text)
    return {name for name in _NAMES.findall(text) if name.lower() not in _PROMQL_WORDS}


def unknown_metrics(expr: str) -> list[str]:
    """Problems with the metric names of one expression (empty when all exist)."""
    names = promql_metric_names(expr)
    if not names:
        return [f"selects no metric by name: {expr!r}"]
    return [
        f"{name!r} is not a metric of shared/runtime/metrics.py"
        for name in sorted(names - metric_catalogue())
    ]


# --- the tests -----------------------------------------------------------------------------------


def test_the_promql_reader_finds_metric_names() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (namespace, le) (rate(cronbus_fire_lateness_seconds_bucket"
        '{job="x", le!="+Inf"}[5m] offset 1h))) > 10 and on (namespace) '
        'absent(cronbus_dependency_up{dependency="redis"}) or vector(1) * up'
    )
    assert promql_metric_names(expr) == {
        "cronbus_fire_lateness_seconds_bucket",
        "cronbus_dependency_up",
        "up",
    }
    assert unknown_metrics(expr) == ["'up' is not a metric of shared/runtime/metrics.py"]
    assert unknown_metrics("rate(cronbus_fire_lateness_seconds[5m])") != []
    assert unknown_metrics("cronbus_dead") != []
    assert unknown_metrics('{__name__="cronbus_dead_total"}') != []


def test_the_metric_catalogue_knows_the_suffixes() -> None:
    catalogue = metric_catalogue()
    assert len(catalogue) > 20
    assert {"cronbus_dead_total", "cronbus_due_backlog", "cronbus_fire_lateness_seconds_count"} <= (
        catalogue
    )
    assert "cronbus_fire_lateness_seconds" not in catalogue


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_built_in_objects_are_valid(overlay: str) -> None:
    assert tuple(int(part) for part in K8S_VERSION.split(".")[:2]) >= (1, 30), K8S_VERSION
    errors: list[str] = []
    for obj in render(overlay):
        if not is_builtin(obj):
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            errors.append(f"{ident(obj)}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(f"{ident(obj)}: {exc.message}")
    assert errors == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_is_in_the_cronbus_namespace(overlay: str) -> None:
    objects = render(overlay)
    assert named(objects, "Namespace", NAMESPACE) is not None
    elsewhere = [
        ident(obj)
        for obj in objects
        if obj["kind"] != "Namespace" and obj["metadata"].get("namespace") != NAMESPACE
    ]
    assert elsewhere == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_are_known_and_complete(overlay: str) -> None:
    objects = render(overlay)
    errors: list[str] = []
    checks = {
        "ServiceMonitor": service_monitor_errors,
        "PrometheusRule": prometheus_rule_errors,
        "ScaledObject": scaled_object_errors,
    }
    for obj in objects:
        if is_builtin(obj):
            continue
        group = obj["apiVersion"].rpartition("/")[0]
        if obj["kind"] not in CUSTOM_KINDS.get(group, set()):
            errors.append(f"{ident(obj)}: no check for {obj['apiVersion']} {obj['kind']}")
            continue
        errors += [f"{ident(obj)}: {error}" for error in checks[obj["kind"]](obj, objects)]
    assert errors == []


def service_monitor_errors(monitor: Obj, objects: tuple[Obj, ...]) -> list[str]:
    spec = monitor.get("spec") or {}
    selector = spec.get("selector")
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return ["spec.selector is empty"]
    services = [svc for svc in of_kind(objects, "Service") if selects(selector, labels_of(svc))]
    errors = [] if services else ["spec.selector selects no Service"]
    endpoints = spec.get("endpoints") or []
    if not endpoints:
        errors.append("spec.endpoints is empty")
    for endpoint in endpoints:
        port = endpoint.get("port")
        if not port:
            errors.append(f"endpoint without a named port: {endpoint}")
            continue
        missing = [
            svc["metadata"]["name"]
            for svc in services
            if port not in {p.get("name") for p in svc["spec"]["ports"]}
        ]
        if missing:
            errors.append(f"port {port!r} is not a port of {missing}")
    return errors


def prometheus_rule_errors(rule: Obj, _: tuple[Obj, ...]) -> list[str]:
    groups = (rule.get("spec") or {}).get("groups") or []
    errors = [] if groups else ["spec.groups is empty"]
    for group in groups:
        if not group.get("name") or not group.get("rules"):
            errors.append(f"group {group.get('name')!r} has no name or no rules")
        for item in group.get("rules") or []:
            errors += [f"{item.get('alert')}: {error}" for error in alert_errors(item)]
    alerts = [item.get("alert") for group in groups for item in group.get("rules") or []]
    errors += [
        f"alert {name} is defined twice" for name in {a for a in alerts if alerts.count(a) > 1}
    ]
    return errors


def alert_errors(item: Obj) -> list[str]:
    errors = []
    if not isinstance(item.get("alert"), str) or not item["alert"]:
        errors.append("no alert name (recording rules belong elsewhere)")
    if not isinstance(item.get("expr"), str) or not item["expr"].strip():
        return [*errors, "no expr"]
    if (item.get("labels") or {}).get("severity") not in SEVERITIES:
        errors.append(f"labels.severity must be one of {sorted(SEVERITIES)}")
    if not (item.get("annotations") or {}).get("summary"):
        errors.append("no annotations.summary")
    if "for" in item and not re.fullmatch(r"(\d+(ms|[smhdwy]))+", str(item["for"])):
        errors.append(f"for: {item['for']!r} is not a duration")
    return errors + unknown_metrics(item["expr"])


#: What KEDA's ScaledObject CRD and its rabbitmq scaler require.
RABBITMQ_MODES = {"QueueLength", "MessageRate"}


def scaled_object_errors(scaled: Obj, objects: tuple[Obj, ...]) -> list[str]:
    spec = scaled.get("spec") or {}
    ref = spec.get("scaleTargetRef") or {}
    target = ref.get("name")
    deployment = named(objects, "Deployment", str(target))
    errors = [] if deployment else [f"no Deployment {target}"]
    triggers = spec.get("triggers") or []
    if not triggers or any(not t.get("type") or not t.get("metadata") for t in triggers):
        errors.append("spec.triggers must each have a type and metadata")
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high):
        errors.append(f"replica counts {low}..{high} are not 0 <= min <= max")
    for trigger in triggers:
        if trigger.get("type") == "rabbitmq" and deployment is not None:
            errors += rabbitmq_trigger_errors(trigger.get("metadata") or {}, deployment, objects)
    for hpa in of_kind(objects, "HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"]["name"] == target:
            errors.append(f"{ident(hpa)} scales {target} too: KEDA makes its own")
    return errors


def rabbitmq_trigger_errors(meta: Obj, deployment: Obj, objects: tuple[Obj, ...]) -> list[str]:
    errors = []
    if meta.get("queueName") != keys.DELIVERIES_QUEUE:
        errors.append(f"rabbitmq trigger watches {meta.get('queueName')!r}, not the deliveries")
    if meta.get("mode") not in RABBITMQ_MODES or not str(meta.get("value", "")).isdigit():
        errors.append("rabbitmq trigger needs mode QueueLength or MessageRate and a value")
    if meta.get("protocol", "auto") not in {"amqp", "http", "auto"}:
        errors.append(f"rabbitmq trigger protocol {meta.get('protocol')!r} is unknown")
    if not (meta.get("host") or meta.get("hostFromEnv")):
        errors.append("rabbitmq trigger has no host or hostFromEnv")
    variable = meta.get("hostFromEnv")
    if variable:
        # KEDA reads it from the scale target's container environment.
        first = containers(deployment)[0]
        if variable not in container_env(objects, first):
            errors.append(f"hostFromEnv {variable} is not in {ident(deployment)}'s environment")
    return errors


def test_the_keda_overlay_scales_executors_on_the_deliveries_queue_only() -> None:
    objects = render("keda")
    scaled = of_kind(objects, "ScaledObject")
    assert [s["spec"]["scaleTargetRef"]["name"] for s in scaled] == ["cronbus-executor"]
    assert [t["type"] for t in scaled[0]["spec"]["triggers"]] == ["rabbitmq"]
    assert of_kind(objects, "HorizontalPodAutoscaler") == []
    # Everything else is production's.
    production = {ident(o) for o in render("production")}
    assert production - {ident(o) for o in objects} == {"HorizontalPodAutoscaler/cronbus-executor"}


def test_production_is_watched() -> None:
    objects = render("production")
    assert of_kind(objects, "ServiceMonitor"), "no ServiceMonitor"
    rules = of_kind(objects, "PrometheusRule")
    watched: set[str] = set()
    for rule in rules:
        for group in rule["spec"]["groups"]:
            for item in group["rules"]:
                watched |= promql_metric_names(item["expr"])
    # What the engineer on call must hear about.
    for metric in (
        "cronbus_due_backlog",
        "cronbus_fire_lateness_seconds_bucket",
        "cronbus_dead_total",
        "cronbus_index_epoch_present",
        "cronbus_rebuild_running",
        "cronbus_dependency_up",
        "cronbus_backpressure",
    ):
        assert metric in watched, f"no alert watches {metric}"


def test_production_has_a_grafana_dashboard() -> None:
    dashboards = [
        cm
        for cm in of_kind(render("production"), "ConfigMap")
        if labels_of(cm).get("grafana_dashboard") == "1"
    ]
    assert dashboards, "no ConfigMap labelled grafana_dashboard: '1'"
    errors: list[str] = []
    for config_map in dashboards:
        for key, text in (config_map.get("data") or {}).items():
            dashboard = json.loads(text)
            panels = [*dashboard.get("panels", [])]
            panels += [inner for panel in panels for inner in panel.get("panels", [])]
            targets = [t for panel in panels for t in panel.get("targets", [])]
            assert targets, f"{key}: no panel queries anything"
            errors += [f"{key}: {e}" for t in targets for e in unknown_metrics(t["expr"])]
    assert errors == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_runs_from_a_labelled_deployment(overlay: str) -> None:
    objects = render(overlay)
    components = sorted(c for _, c in cronbus_services(objects))
    assert components == sorted(SERVICES)
    jobs = [w for w, c in cronbus_workloads(objects) if c == "migrate"]
    assert [w["kind"] for w in jobs] == ["Job"], "one migration Job"
    for obj in objects:
        if labels_of(obj).get(LABEL_NAME) == "cronbus" and obj["kind"] in {
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "Job",
            "HorizontalPodAutoscaler",
        }:
            assert labels_of(obj).get(LABEL_COMPONENT), f"{ident(obj)}: no component label"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_are_set_known_and_valid(overlay: str) -> None:
    objects = render(overlay)
    errors: list[str] = []
    for workload, component in cronbus_workloads(objects):
        cls = SETTINGS.get(component)
        if cls is None:
            errors.append(f"{ident(workload)}: unknown component {component!r}")
            continue
        for container in containers(workload):
            where = f"{ident(workload)} {container['name']}"
            env = container_env(objects, container)
            errors += [f"{where}: {e}" for e in settings_errors(cls, env, workload)]
            errors += [f"{where}: {e}" for e in secret_errors(cls, container, workload)]
    assert errors == []


#: Where the base ConfigMaps deliberately differ from the code's defaults: the value they set
#: (why: the Job cronbus-migrate applies migrations, not the services).
DELIBERATE_OVERRIDES = {"CRONBUS_MIGRATE_ON_START": "false"}


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.partition("=") for line in path.read_text().splitlines())
    return {name: value for name, _, value in pairs if name.startswith("CRONBUS_")}


@pytest.mark.parametrize("component", SERVICES)
def test_the_base_config_maps_hold_the_code_s_defaults(component: str) -> None:
    """A default changed in the code and not in the manifests would leave every Kubernetes
    install on the old value without a word (CRONBUS_COMPLETE_FLUSH_MS stayed 5 there when
    the default became 20)."""
    cls = SETTINGS[component]
    config = DEPLOY / "base" / "config"
    env = env_file(config / "common.env") | env_file(config / f"{component}.env")
    # Empty values too: the services read CRONBUS_X= as an empty value, not as unset.
    effective = effective_settings(cls, env)
    differ = [
        f"{env_name(cls, field)}={getattr(effective, field)!r}, default {info.default!r}"
        for field, info in cls.model_fields.items()
        if env_name(cls, field) in env
        and env_name(cls, field) not in DELIBERATE_OVERRIDES
        and getattr(effective, field) != info.get_default(call_default_factory=True)
    ]
    assert differ == []
    for name, value in DELIBERATE_OVERRIDES.items():
        assert env.get(name, value) == value, f"{name}={env[name]}, deliberately {value}"


def settings_errors(
    cls: type[CommonSettings], env: Mapping[str, str | None], workload: Obj
) -> list[str]:
    known = {env_name(cls, field) for field in cls.model_fields}
    errors = [
        f"{name} is not a setting of {cls.__name__} (a typo is silently ignored)"
        for name in env
        if name.upper().startswith("CRONBUS_") and name.upper() not in known
    ]
    upper = {name.upper() for name in env}
    for field, info in cls.model_fields.items():
        name = env_name(cls, field)
        if info.is_required() and name not in upper:
            errors.append(f"{name} is required and not set")
        # A service's ConfigMaps spell out every setting (the URLs come from the Secret).
        if workload["kind"] == "Deployment" and field not in SECRET_KEYS and name not in upper:
            errors.append(f"{name} is in no ConfigMap or env entry")
    try:
        effective_settings(cls, {k.upper(): v for k, v in env.items()})
    except pydantic.ValidationError as exc:
        errors.append(f"invalid settings: {exc}")
    return errors


def secret_errors(cls: type[CommonSettings], container: Obj, workload: Obj) -> list[str]:
    refs = secret_refs(container)
    errors = []
    for field, key in SECRET_KEYS.items():
        name = env_name(cls, field)
        if name not in refs:
            if workload["kind"] == "Deployment":
                errors.append(f"{name} does not come from the Secret")
            continue
        secret, used_key = refs[name]
        if not is_secret_name(secret) or used_key != key:
            errors.append(f"{name} comes from {secret}/{used_key}, not {SECRET_NAME}/{key}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_services_use_the_metrics_port(overlay: str) -> None:
    objects = render(overlay)
    errors: list[str] = []
    for workload, component in cronbus_services(objects):
        container = next(c for c in pod_spec(workload)["containers"] if c["name"] == component)
        settings = effective_settings(SETTINGS[component], container_env(objects, container))
        port = settings.metrics_port
        where = f"{ident(workload)}"
        if resolve_port("metrics", container) != port:
            errors.append(f"{where}: container port 'metrics' is not {port}")
        errors += [f"{where}: {e}" for e in probe_errors(container, port)]
        services = [
            svc
            for svc in of_kind(objects, "Service")
            if selects({"matchLabels": svc["spec"].get("selector") or {}}, pod_labels(workload))
            and svc["spec"].get("selector")
        ]
        if not services:
            errors.append(f"{where}: no Service exposes the metrics port")
        for svc in services:
            for svc_port in svc["spec"]["ports"]:
                target = resolve_port(svc_port.get("targetPort", svc_port["port"]), container)
                if component == "console" and svc_port.get("name") == "http":
                    # The console's pages: the port it serves them on.
                    pages = getattr(settings, "console_port", None)
                    if svc_port["port"] != pages or target != pages:
                        errors.append(f"{ident(svc)}: http port {svc_port} is not {pages}")
                    continue
                if svc_port["port"] != port or target != port:
                    errors.append(f"{ident(svc)}: port {svc_port} is not the metrics port {port}")
    assert errors == []


def probe_errors(container: Obj, port: int) -> list[str]:
    errors = []
    paths = {"readinessProbe": "/readyz", "livenessProbe": "/healthz", "startupProbe": "/healthz"}
    for probe_name, path in paths.items():
        probe = container.get(probe_name)
        if probe is None:
            if probe_name != "startupProbe":
                errors.append(f"no {probe_name}")
            continue
        get = probe.get("httpGet") or {}
        if get.get("path") != path:
            errors.append(f"{probe_name} must GET {path}, not {get.get('path')}")
        if resolve_port(get.get("port", ""), container) != port:
            errors.append(f"{probe_name} port {get.get('port')} is not the metrics port {port}")
    return errors


def subcommands() -> set[str]:
    found: set[str] = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            found |= set(action.choices)
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_existing_entry_points(overlay: str) -> None:
    errors: list[str] = []
    for workload, component in cronbus_workloads(render(overlay)):
        for container in containers(workload):
            # Without a command the image's ENTRYPOINT, `cronbus`, runs.
            argv = [*container.get("command", ["cronbus"]), *container.get("args", [])]
            problem = entry_point_error(argv, component, workload["kind"])
            if problem:
                errors.append(f"{ident(workload)} {container['name']}: {argv}: {problem}")
    assert errors == []


def entry_point_error(argv: list[str], component: str, kind: str) -> str | None:
    if argv[:2] == ["python", "-m"] and len(argv) == 3:
        module = re.fullmatch(r"services\.(\w+)", argv[2])
        if module is None or not (ROOT / "services" / module[1] / "__main__.py").is_file():
            return f"services/{argv[2].removeprefix('services.')}/__main__.py does not exist"
        if kind == "Deployment" and module[1] != component:
            return f"runs {module[1]} in the {component} Deployment"
        return None
    if argv[:1] == ["cronbus"] and len(argv) >= 2:
        if argv[1] not in subcommands():
            return f"`cronbus {argv[1]}` is not a subcommand of cronbus.cli"
        if argv[1] == "run" and argv[2:] != [component]:
            return f"`cronbus run` must run {component}"
        return None
    return "runs neither `python -m services.<name>` nor `cronbus <subcommand>`"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_outlive_the_shutdown_grace(overlay: str) -> None:
    objects = render(overlay)
    errors: list[str] = []
    for workload, component in cronbus_services(objects):
        container = next(c for c in pod_spec(workload)["containers"] if c["name"] == component)
        grace = effective_settings(SETTINGS[component], container_env(objects, container))
        period = pod_spec(workload).get("terminationGracePeriodSeconds", 30)
        if period <= grace.shutdown_grace_s + SHUTDOWN_MARGIN_S:
            errors.append(
                f"{ident(workload)}: terminationGracePeriodSeconds {period} is not above"
                f" CRONBUS_SHUTDOWN_GRACE_S {grace.shutdown_grace_s} + {SHUTDOWN_MARGIN_S}"
            )
    assert errors == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_the_restricted_pod_security_standard(overlay: str) -> None:
    errors: list[str] = []
    for workload in workloads(render(overlay)):
        spec = pod_spec(workload)
        pod = spec.get("securityContext") or {}
        if (pod.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            errors.append(f"{ident(workload)}: no RuntimeDefault seccomp profile")
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(flag):
                errors.append(f"{ident(workload)}: {flag}")
        for container in containers(workload):
            where = f"{ident(workload)} {container['name']}"
            own = container.get("securityContext") or {}
            if not own.get("runAsNonRoot", pod.get("runAsNonRoot")):
                errors.append(f"{where}: not runAsNonRoot")
            if own.get("allowPrivilegeEscalation") is not False:
                errors.append(f"{where}: allowPrivilegeEscalation is not false")
            if (own.get("capabilities") or {}).get("drop") != ["ALL"] or own.get("privileged"):
                errors.append(f"{where}: capabilities are not dropped (ALL)")
    assert errors == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cronbus_pods_are_locked_down(overlay: str) -> None:
    objects = render(overlay)
    errors: list[str] = []
    for workload, _ in cronbus_workloads(objects):
        errors += [f"{ident(workload)}: {e}" for e in lockdown_errors(workload, objects)]
    images = {c["image"] for w, _ in cronbus_workloads(objects) for c in containers(w)}
    assert len(images) == 1, f"one image for every service, not {images}"
    image = images.pop()
    assert re.fullmatch(r".+:[\w.-]+", image) and not image.endswith(":latest"), image
    assert errors == []


def lockdown_errors(workload: Obj, objects: tuple[Obj, ...]) -> list[str]:
    spec = pod_spec(workload)
    pod = spec.get("securityContext") or {}
    errors = []
    if spec.get("automountServiceAccountToken") is not False:
        errors.append("automountServiceAccountToken is not false")
    account = named(objects, "ServiceAccount", spec.get("serviceAccountName", "default"))
    if account is None or account.get("automountServiceAccountToken") is not False:
        errors.append("its ServiceAccount is missing or mounts a token")
    if spec.get("enableServiceLinks") is not False:
        # Service links set CRONBUS_<SERVICE>_... variables, in the settings' own prefix.
        errors.append("enableServiceLinks is not false")
    tmp_volumes = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    for container in containers(workload):
        own = container.get("securityContext") or {}
        user = own.get("runAsUser", pod.get("runAsUser"))
        if not isinstance(user, int) or user == 0:
            errors.append(f"{container['name']}: runAsUser is not a fixed non-root UID")
        if own.get("readOnlyRootFilesystem") is not True:
            errors.append(f"{container['name']}: the root file system is writable")
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        if mounts.get("/tmp") not in tmp_volumes:
            errors.append(f"{container['name']}: no emptyDir at /tmp")
        resources = container.get("resources") or {}
        for bound in ("requests", "limits"):
            if not {"cpu", "memory"} <= set(resources.get(bound) or {}):
                errors.append(f"{container['name']}: no cpu and memory {bound}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_and_disruption_budgets_match_the_deployments(overlay: str) -> None:
    objects = render(overlay)
    errors: list[str] = []
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    # The executors have one autoscaler: an HPA, or KEDA's ScaledObject (which makes one).
    scalers = [*hpas, *of_kind(objects, "ScaledObject")]
    assert [h["spec"]["scaleTargetRef"]["name"] for h in scalers] == ["cronbus-executor"]
    for hpa in hpas:
        spec = hpa["spec"]
        target = named(objects, "Deployment", spec["scaleTargetRef"]["name"])
        if target is None:
            errors.append(f"{ident(hpa)}: scales a Deployment that does not exist")
            continue
        if "replicas" in target["spec"]:
            errors.append(f"{ident(target)}: sets replicas, which the HPA owns")
        if not any((m.get("resource") or {}).get("name") == "cpu" for m in spec["metrics"]):
            errors.append(f"{ident(hpa)}: does not scale on CPU")
        if not all(
            "cpu" in (c.get("resources") or {}).get("requests", {}) for c in containers(target)
        ):
            errors.append(f"{ident(target)}: CPU utilisation needs CPU requests")
        if not 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"]:
            errors.append(f"{ident(hpa)}: minReplicas/maxReplicas out of order")
    budgets = of_kind(objects, "PodDisruptionBudget")
    for workload, component in cronbus_services(objects):
        if not any(selects(b["spec"]["selector"], pod_labels(workload)) for b in budgets):
            errors.append(f"{ident(workload)}: no PodDisruptionBudget for {component}")
    for budget in budgets:
        if not any(selects(budget["spec"]["selector"], pod_labels(w)) for w in workloads(objects)):
            errors.append(f"{ident(budget)}: selects no pod")
    assert errors == []


# --- NetworkPolicies -----------------------------------------------------------------------------


def policies_for(objects: tuple[Obj, ...], labels: Mapping[str, str], direction: str) -> list[Obj]:
    return [
        policy
        for policy in of_kind(objects, "NetworkPolicy")
        if selects(policy["spec"]["podSelector"], labels)
        and direction in policy["spec"].get("policyTypes", ["Ingress"])
    ]


def port_allowed(rule: Obj, port: int, container: Obj | None) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    for allowed in ports:
        number = allowed.get("port")
        if number is None:
            return True
        resolved = resolve_port(number, container) if container else number
        if resolved == port or (
            isinstance(resolved, int) and resolved <= port <= allowed.get("endPort", resolved)
        ):
            return True
    return False


def peer_allows(
    peers: list[Obj] | None, labels: Mapping[str, str], namespace: Mapping[str, str]
) -> bool:
    """Whether a rule's from/to admits a pod with these labels in a namespace with these labels."""
    if not peers:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            continue
        ns_ok = (
            selects(peer["namespaceSelector"], namespace)
            if "namespaceSelector" in peer
            else (namespace.get("kubernetes.io/metadata.name") == NAMESPACE)
        )
        pod_ok = selects(peer["podSelector"], labels) if "podSelector" in peer else True
        if ns_ok and pod_ok:
            return True
    return False


#: A pod as NetworkPolicies see it: its labels, its namespace's labels, its container (for
#: named ports; None when it has none).
Pod = tuple[Mapping[str, str], Mapping[str, str], Obj | None]
OWN_NAMESPACE = {"kubernetes.io/metadata.name": NAMESPACE}


def traffic_allowed(objects: tuple[Obj, ...], source: Pod, target: Pod, port: int) -> bool:
    """Whether the policies let the source open a connection to this port of the target."""
    src_labels, src_ns, _ = source
    dst_labels, dst_ns, dst_container = target
    egress = policies_for(objects, src_labels, "Egress") if src_ns == OWN_NAMESPACE else []
    ingress = policies_for(objects, dst_labels, "Ingress") if dst_ns == OWN_NAMESPACE else []
    out = not egress or any(
        peer_allows(rule.get("to"), dst_labels, dst_ns) and port_allowed(rule, port, dst_container)
        for policy in egress
        for rule in policy["spec"].get("egress") or []
    )
    into = not ingress or any(
        peer_allows(rule.get("from"), src_labels, src_ns)
        and port_allowed(rule, port, dst_container)
        for policy in ingress
        for rule in policy["spec"].get("ingress") or []
    )
    return out and into


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cronbus_pods_are_fenced_and_scraped(overlay: str) -> None:
    objects = render(overlay)
    prometheus: Pod = (
        {"app.kubernetes.io/name": "prometheus"},
        {"kubernetes.io/metadata.name": "monitoring"},
        None,
    )
    stranger: Pod = ({"app": "stranger"}, {"kubernetes.io/metadata.name": "default"}, None)
    dns: Pod = ({"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"}, None)
    webhook: Pod = ({"app": "billing"}, {"kubernetes.io/metadata.name": "billing"}, None)
    errors: list[str] = []
    for workload, component in cronbus_workloads(objects):
        labels = pod_labels(workload)
        where = ident(workload)
        for direction in ("Ingress", "Egress"):
            if not policies_for(objects, labels, direction):
                errors.append(f"{where}: no NetworkPolicy limits its {direction.lower()}")
        if not traffic_allowed(objects, (labels, OWN_NAMESPACE, None), dns, 53):
            errors.append(f"{where}: cannot reach DNS")
        # Webhooks go anywhere, so only the executor may open arbitrary connections.
        anywhere = traffic_allowed(objects, (labels, OWN_NAMESPACE, None), webhook, 8443)
        if anywhere != (component == "executor"):
            errors.append(f"{where}: connections to any pod and port: {anywhere}")
        if workload["kind"] != "Deployment":
            continue
        container = pod_spec(workload)["containers"][0]
        env = container_env(objects, container)
        port = effective_settings(SETTINGS[component], env).metrics_port
        own: Pod = (labels, OWN_NAMESPACE, container)
        if not traffic_allowed(objects, prometheus, own, port):
            errors.append(f"{where}: Prometheus cannot scrape port {port}")
        if traffic_allowed(objects, stranger, own, port):
            errors.append(f"{where}: any pod may connect to port {port}")
    assert errors == []


def test_dev_cronbus_reaches_its_own_dependencies() -> None:
    objects = render("dev")
    secret = next(s for s in of_kind(objects, "Secret") if is_secret_name(s["metadata"]["name"]))
    try:
        urls = {
            field: base64.b64decode(secret["data"][key]).decode()
            for field, key in SECRET_KEYS.items()
        }
    except (KeyError, binascii.Error) as exc:
        pytest.fail(f"{ident(secret)}: {exc!r}")
    errors: list[str] = []
    for workload, component in cronbus_workloads(objects):
        source: Pod = (pod_labels(workload), OWN_NAMESPACE, None)
        for field in NEEDS[component]:
            problem = reach_error(objects, source, urls[field])
            if problem:
                errors.append(f"{ident(workload)} -> {urls[field]}: {problem}")
    assert errors == []


def reach_error(objects: tuple[Obj, ...], source: Pod, url: str) -> str | None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or DEFAULT_PORTS[parts.scheme]
    service = named(objects, "Service", host.removesuffix(f".{NAMESPACE}.svc.cluster.local"))
    if service is None:
        return f"no Service {host}"
    svc_port = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    if svc_port is None:
        return f"Service {host} has no port {port}"
    pods = [
        w
        for w in workloads(objects)
        if selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
    ]
    if not pods:
        return f"Service {host} selects no pod"
    for pod in pods:
        container = pod_spec(pod)["containers"][0]
        target = resolve_port(svc_port.get("targetPort", port), container)
        if target is None:
            return f"{ident(pod)} has no port {svc_port.get('targetPort')}"
        if not traffic_allowed(
            objects, source, (pod_labels(pod), OWN_NAMESPACE, container), target
        ):
            return f"a NetworkPolicy blocks port {target} of {ident(pod)}"
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_and_never_committed(overlay: str) -> None:
    objects = render(overlay)
    secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
    errors: list[str] = []
    for workload in workloads(objects):
        for container in containers(workload):
            for env, (name, key) in secret_refs(container).items():
                if overlay == "production" and name != SECRET_NAME:
                    errors.append(f"{ident(workload)} {env}: Secret {name} is not {SECRET_NAME}")
                if overlay == "dev" and key not in (secrets.get(name) or {}).get("data", {}):
                    errors.append(f"{ident(workload)} {env}: Secret {name} has no key {key}")
    if overlay == "production":
        # The Secret is created in the cluster (docs/deployment.md), never rendered from git.
        assert sorted(secrets) == []
    assert errors == []


def test_the_image_runs_as_the_manifests_expect() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile, flags=re.MULTILINE))
    stages = [
        re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), image)
        for image in re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.MULTILINE)
    ]
    assert len(stages) >= 2, "a builder stage and a runtime stage"
    assert stages[-1] == "python:3.11-slim", stages
    runtime = dockerfile.rsplit("\nFROM ", 1)[1]
    assert re.search(r'^ENTRYPOINT \["cronbus"\]$', runtime, re.MULTILINE)
    assert "PYTHONUNBUFFERED=1" in runtime
    assert "build-essential" not in runtime and "gcc" not in runtime
    user = re.findall(r"^USER\s+(\d+)", runtime, re.MULTILINE)
    assert user and int(user[-1]) > 0, "the runtime stage ends as a numeric non-root USER"
    for overlay in OVERLAYS:
        for workload, _ in cronbus_workloads(render(overlay)):
            assert pod_spec(workload)["securityContext"]["runAsUser"] == int(user[-1])
