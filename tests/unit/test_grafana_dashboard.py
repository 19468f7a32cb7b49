"""The Grafana dashboard (deploy/grafana/rlfleet.json) is well formed and every query names a metric
the services export.

The exported set is read from the code, not from a list: every module under ``services/`` that uses
prometheus_client is imported, and the registry ``serve_metrics`` serves (prometheus_client's
default ``REGISTRY``) is collected, the collector's status-derived families included (produced from
an empty ``GetStatusResponse``). The generation service's engine registers vLLM's Prometheus logger
in the same registry (``AsyncLLM`` does unless ``disable_log_stats``); the test builds that logger
from the generation engine's own engine arguments on the tiny model. Each family is expanded to the
names Prometheus stores: a counter ``foo`` is ``foo_total``, a histogram ``h`` is ``h_bucket``,
``h_sum`` and ``h_count``.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path

import pytest

from tests.dashboard import DASHBOARD, panels, queries

ROOT = Path(__file__).resolve().parents[2]
DOCS_PAGE = ROOT / "docs" / "guides" / "dashboards.md"
SERVICES = ROOT / "services"

# The names a family of each type is stored under (prometheus_client's exposition).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}

# PromQL words that look like identifiers but name no metric.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|\w+)")
_IDENTIFIER = re.compile(r"(?<![\w.:$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, aggregations,
    keywords, label names (in ``{...}`` or ``by (...)``), durations, numbers or Grafana variables."""
    names = {json.loads(m.group(1)) if m.group(1)[0] == '"' else m.group(1)[1:-1]
             for m in _NAME_MATCHER.finditer(expr)}
    text = _LABEL_LIST.sub(" ", expr)
    text = _BRACES.sub(" ", text)  # label matchers: the strings inside go with them
    text = _STRING.sub(" ", text)
    text = _BRACKETS.sub(" ", text)  # ranges and subqueries: [5m], [$__rate_interval:1m]
    text = _VARIABLE.sub(" ", text)
    for identifier, call in _IDENTIFIER.findall(text):
        if call or identifier.lower() in KEYWORDS:
            continue  # a function or an aggregation, or a keyword
        names.add(identifier)
    return names


def unknown_metrics(dashboard: dict, exported: set[str]) -> dict[str, list[str]]:
    """Where each query names a metric not in ``exported``: {where: [names]}; empty when all exist."""
    unknown: dict[str, list[str]] = {}
    for where, expr in queries(dashboard):
        missing = sorted(metric_names(expr) - exported)
        if missing:
            unknown.setdefault(where, []).extend(missing)
    return unknown


def structure_problems(dashboard: dict) -> list[str]:
    """What keeps the dashboard from loading as intended: duplicate panel ids, a panel without a
    datasource or without a target, a target without a query."""
    problems, seen = [], set()
    for panel in panels(dashboard.get("panels", [])):
        name = f"panel {panel.get('id')} {panel.get('title')!r}"
        if panel.get("id") in seen or not isinstance(panel.get("id"), int):
            problems.append(f"{name}: id missing or not unique")
        seen.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        if not panel.get("datasource"):
            problems.append(f"{name}: no datasource")
        if not panel.get("targets"):
            problems.append(f"{name}: no target")
        for target in panel.get("targets", []):
            if not target.get("expr", "").strip():
                problems.append(f"{name}: target {target.get('refId')} has no expr")
    return problems


def exported_names(families) -> set[str]:
    """The sample names Prometheus stores for these metric families."""
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


def service_families() -> list:
    """The families every service process's /metrics serves, from the modules that define them."""
    from prometheus_client import REGISTRY

    from rlfleet.services.collector.status_metrics import STATUS_METRICS
    from rlfleet.services.trajectory.buffer_metrics import BUFFER_METRICS, Occupancy
    from rlfleet.v1 import collector_pb2

    for path in sorted(SERVICES.rglob("*.py")):
        if path.name != "__main__.py" and "prometheus_client" in path.read_text():
            parts = path.relative_to(SERVICES).with_suffix("").parts
            importlib.import_module(".".join(("rlfleet", "services", *parts)).removesuffix(".__init__"))
    # The status- and buffer-derived families exist only while the collector (trajectory) service
    # lends its status (occupancy).
    previous = STATUS_METRICS.status, BUFFER_METRICS.occupancy
    STATUS_METRICS.status, BUFFER_METRICS.occupancy = collector_pb2.GetStatusResponse, lambda: Occupancy(0, 0, 1, 0, 1)
    try:
        return [family for family in REGISTRY.collect() if not family.name.startswith("vllm:")]
    finally:
        STATUS_METRICS.status, BUFFER_METRICS.occupancy = previous


def vllm_families(model_dir: Path) -> list:
    """The families the generation service's vLLM engine adds to the same registry."""
    pytest.importorskip("vllm")
    from prometheus_client import REGISTRY
    from vllm import AsyncEngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from rlfleet.services.generation.config import GenerationConfig
    from rlfleet.services.generation.vllm_engine import GenerationEngine

    # The arguments the service starts AsyncLLM with (engine_kwargs pass-through included).
    engine_args = AsyncEngineArgs(**GenerationEngine(GenerationConfig(model=str(model_dir)))._engine_kwargs())
    assert not engine_args.disable_log_stats, "the generation service no longer exports vLLM's metrics"
    PrometheusStatLogger(engine_args.create_engine_config(), [0])
    try:
        return [family for family in REGISTRY.collect() if family.name.startswith("vllm:")]
    finally:
        unregister_vllm_metrics()


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def services() -> list:
    return service_families()


@pytest.fixture(scope="module")
def exported(services, tiny_model_dir) -> set[str]:
    return exported_names(services) | exported_names(vllm_families(tiny_model_dir))


def test_the_dashboard_is_json_with_unique_ids_and_every_panel_has_a_datasource_and_a_query(dashboard):
    assert structure_problems(dashboard) == []
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dashboard["templating"]["list"])
    for panel in panels(dashboard["panels"]):
        if panel["type"] != "row":  # the datasource is the dashboard's variable, not a fixed uid
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_every_query_names_a_metric_the_services_export(dashboard, exported):
    assert unknown_metrics(dashboard, exported) == {}
    named = {name for _, expr in queries(dashboard) for name in metric_names(expr)}
    assert {"rlfleet_trainer_wait_seconds_total", "rlfleet_rpc_errors_total", "rlfleet_rpc_seconds_bucket",
            "rlfleet_filter_rate", "rlfleet_mismatch_kl_k3", "vllm:generation_tokens_total"} <= named


def test_a_panel_naming_a_metric_that_does_not_exist_is_reported(dashboard, exported):
    broken = copy.deepcopy(dashboard)
    panel = next(p for p in panels(broken["panels"]) if p["type"] != "row")
    panel["targets"].append({"refId": "Z", "datasource": panel["datasource"],
                             "expr": 'sum by (method) (rate(rlfleet_bogus_total{method="x"}[5m]))'
                                     " / rlfleet_tool_calls"})  # a counter's family name, not its series
    assert unknown_metrics(broken, exported) == {
        f"panel {panel['id']} {panel['title']!r}": ["rlfleet_bogus_total", "rlfleet_tool_calls"]}


def test_structural_faults_are_reported(dashboard):
    broken = copy.deepcopy(dashboard)
    first, second = [p for p in panels(broken["panels"]) if p["type"] != "row"][:2]
    second["id"] = first["id"]
    del first["datasource"]
    second["targets"] = []
    problems = structure_problems(broken)
    assert any("not unique" in p for p in problems)
    assert any("no datasource" in p for p in problems)
    assert any("no target" in p for p in problems)


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.95, sum by (le, method) (rate(rlfleet_rpc_seconds_bucket{job=~"$job", '
     'method="/rlfleet.v1.RewardService/ComputeRewards"}[$__rate_interval])))', {"rlfleet_rpc_seconds_bucket"}),
    ("sum(rate(a_total[5m] offset 1h)) by (code) / on (job) group_left (instance) b > bool 1e3",
     {"a_total", "b"}),
    ("rate(vllm:generation_tokens_total{model_name='m'}[${__rate_interval}])", {"vllm:generation_tokens_total"}),
    ('{__name__="rlfleet_ready", job="x"} == 1', {"rlfleet_ready"}),
    ("max_over_time(rlfleet_replicas[1h:5m]) and rlfleet_replicas_in_rotation unless nan",
     {"rlfleet_replicas", "rlfleet_replicas_in_rotation"}),
])
def test_metric_names_are_read_from_promql(expr, names):
    assert metric_names(expr) == names


def test_the_docs_page_lists_every_rlfleet_metric(services):
    page = DOCS_PAGE.read_text()
    # As the code declares them: a counter by its series name (``_total``), anything else by its family's.
    declared = {family.name + ("_total" if family.type == "counter" else "")
                for family in services if family.name.startswith("rlfleet_")}
    assert sorted(name for name in declared if not re.search(rf"`{name}[`{{]", page)) == []  # `x` or `x{label}`
