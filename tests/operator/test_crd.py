"""The CRD: generated from its template and the upstream Kubernetes schemas (nothing edited by hand since), and the
Kubernetes versions the chart claims can run every CEL rule in it."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
import yaml
from k8s_testing import CRD_FILE, REPO

CHART = REPO / "charts" / "ddtree" / "Chart.yaml"
# The Kubernetes version from which a CRD's CEL rules may call each function or macro. A rule calling one that
# is missing here fails the test below: look the function up and add it, then check the chart's kubeVersion.
CEL_SINCE = {
    # CRD validation rules, on by default from 1.25: the core language, its macros and the string functions.
    **dict.fromkeys(("has", "size", "matches", "all", "exists", "exists_one", "filter", "map", "startsWith",
                     "endsWith", "contains"), (1, 25)),
    # The Kubernetes quantity library: compiled into CRD rules from 1.29 (1.28 only accepts it in stored rules).
    **dict.fromkeys(("quantity", "isQuantity", "compareTo", "isGreaterThan", "isLessThan", "add", "sub",
                     "asInteger", "asApproximateFloat", "sign"), (1, 29)),
}


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("crd_generate", REPO / "operator" / "crd" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rules(node: Any) -> list[str]:
    """Every x-kubernetes-validations rule in a schema."""
    if isinstance(node, list):
        return [r for item in node for r in rules(item)]
    if not isinstance(node, dict):
        return []
    found = [v["rule"] for v in node.get("x-kubernetes-validations", [])]
    return found + [r for k, v in node.items() if k != "x-kubernetes-validations" for r in rules(v)]


def test_kube_version_runs_every_cel_rule():
    crd = yaml.safe_load(CRD_FILE.read_text())
    functions = set()
    for rule in rules(crd):
        without_strings = re.sub(r"'(?:[^'\\]|\\.)*'", "''", rule)
        functions |= set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", without_strings))
    unknown = functions - CEL_SINCE.keys()
    assert not unknown, f"CEL functions without a known minimum Kubernetes version: {unknown}"
    needed = max(CEL_SINCE[f] for f in functions)
    floor = re.fullmatch(r">=(\d+)\.(\d+)\.0-0", yaml.safe_load(CHART.read_text())["kubeVersion"])
    assert (int(floor.group(1)), int(floor.group(2))) == needed, \
        f"Chart.yaml kubeVersion should be >={needed[0]}.{needed[1]}.0-0 (what the CRD's CEL needs)"


def test_generation_merges_and_inlines():
    generate = load_generator()
    schemas = {"io.k8s.api.core.v1.Toleration": {"type": "object", "description": "T", "properties": {
        "operator": {"type": "string", "description": "op", "default": "Equal"},
        "seconds": {"allOf": [{"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.api.resource.Quantity"}],
                    "description": "how long"}},
        "x-kubernetes-patch-strategy": "merge"}}
    template = {"items": {"$k8s": "io.k8s.api.core.v1.Toleration", "properties": {"operator": {"enum": ["Exists"]}}}}
    assert generate.expand(template, schemas) == {"items": {"type": "object", "description": "T", "properties": {
        "operator": {"type": "string", "description": "op", "enum": ["Exists"]},  # default and patch hints dropped
        "seconds": {**generate.QUANTITY, "description": "how long"}}}}
    omitted = generate.expand({"$k8s": "io.k8s.api.core.v1.Toleration", "$omit": ["seconds"]}, schemas)
    assert set(omitted["properties"]) == {"operator"}


@pytest.mark.cluster
def test_the_committed_crd_is_what_the_generator_writes(cluster):
    generate = load_generator()
    version, schemas = generate.fetch_openapi(cluster.api_client)
    if f"Kubernetes {version} OpenAPI" not in CRD_FILE.read_text():
        pytest.skip(f"the CRD embeds another Kubernetes version's schemas than this API server's ({version})")
    assert generate.generate(version, schemas) == CRD_FILE.read_text(), \
        "crds/ was edited by hand or the template changed: run python operator/crd/generate.py"
