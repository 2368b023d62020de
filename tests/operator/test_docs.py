"""The Kubernetes docs work as written (the README's Kubernetes section and docs/kubernetes.md): their helm values
exist, their patches are accepted by the API server, the files and anchors they name exist, and the guide covers
every spec field and every status reason the operator sets."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml
from ddtree_operator import fleet, resource, status
from k8s_testing import CRD_FILE, DDT, EXAMPLE, REPO
from test_chart import HELM, template

README = (REPO / "README.md").read_text()
SECTION = README[README.index("## Kubernetes\n"):README.index("\n## ", README.index("## Kubernetes\n") + 1)]
GUIDE = (REPO / "docs" / "kubernetes.md").read_text()
DOCS = {"README.md": SECTION, "docs/kubernetes.md": GUIDE}
# Ready reasons set in status.compute, beyond the failure reasons (status.WARNING_REASONS).
NORMAL_REASONS = {"Pulling", "Starting", "ScaledToZero", "Ready"}
# The other conditions and their reasons (status.compute, reconcile.choose_autoscaler and reconcile's monitor).
CONDITIONS = {
    "ModelsReady": {"Pulled", "Pulling", "PullFailed", "ConfigError", "ImagePullFailed", "CrashLooping"},
    "Progressing": {"Pulling", "RollingOut", "Complete"},
    "Available": {"MinimumReplicasAvailable"},
    "Autoscaling": {"KEDA", "HPA", "AutoscalerUnavailable", "PrometheusAddressMissing", "NoMetricsSource"},
    "Monitoring": {"ServiceMonitor", "PodMonitor", "MonitorUnavailable", "ApplyFailed"},
}
# Warning reasons that only the conditions Ready does not roll up have.
NOT_READY_REASONS = (CONDITIONS["Autoscaling"] | CONDITIONS["Monitoring"]) - {"ApplyFailed"}
READY_REASONS = (status.WARNING_REASONS - NOT_READY_REASONS) | NORMAL_REASONS


def commands(doc: str, prefix: str) -> list[list[str]]:
    """Shell commands of the doc's code blocks starting with `prefix` (continuation lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", doc, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip().startswith(prefix)]


@pytest.mark.skipif(HELM is None, reason="no helm")
@pytest.mark.parametrize("doc", DOCS)
def test_helm_values_in_the_doc_exist(doc):
    sets = [arg for cmd in commands(DOCS[doc], "helm ") for i, arg in enumerate(cmd) if i and cmd[i - 1] == "--set"]
    assert sets, "the doc installs with --set values"
    template(*[s.replace("$REGISTRY", "registry.example.com/ddtree") for s in sets if "rbac" not in s])
    template("rbac.cluster=false", "watchNamespaces={ml,research}")  # the namespaced variant it describes


@pytest.mark.parametrize("doc", DOCS)
def test_files_and_anchors_the_doc_names_exist(doc):
    for path in set(re.findall(r"(?:examples|crds|charts|images|docs|operator|scripts)/[\w./-]+\w", DOCS[doc])):
        assert (REPO / path.split("#")[0]).exists(), path
    headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", GUIDE, flags=re.M)}
    for anchor in re.findall(r"\]\((?:docs/kubernetes\.md)?#([\w-]+)\)", DOCS[doc]):
        assert anchor in headings, anchor


def test_the_guide_covers_every_spec_field_and_reason():
    spec = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]
    fields = GUIDE[GUIDE.index("## The spec"):GUIDE.index("## Status and reasons")]
    for field in spec:
        assert f"`{field}`" in fields, f"spec.{field} is not in the guide's field table"
    reasons = GUIDE[GUIDE.index("| Ready reason"):GUIDE.index("## Storage and pulls")]
    for reason in READY_REASONS:
        assert f"| `{reason}` |" in reasons, f"Ready reason {reason} is not in the guide's table"
    for metric in fleet.AUTOSCALING_METRICS.values():
        assert f"`{metric}`" in GUIDE


@pytest.mark.parametrize("doc", DOCS)
def test_the_doc_names_every_condition_and_its_reasons(doc):
    """The README's operator section too: what `kubectl describe ddt` can say, and what each reason means."""
    assert set(CONDITIONS) >= status.INDEPENDENT_CONDITIONS
    for type_, reasons in {"Ready": READY_REASONS, **CONDITIONS}.items():
        assert f"`{type_}`" in DOCS[doc], f"{doc} does not name the {type_} condition"
        for reason in reasons:
            assert f"`{reason}`" in DOCS[doc], f"{doc} does not name the {type_} reason {reason}"


@pytest.mark.parametrize("doc", DOCS)
def test_the_retry_command_is_the_operators(doc):
    retries = [cmd for cmd in commands(DOCS[doc], "kubectl annotate")] or [
        shlex.split(m) for m in re.findall(r"`(kubectl annotate [^`]+)`", DOCS[doc])]
    assert retries and all(f"{resource.ANNOTATION_RETRY_PULL}=" in " ".join(cmd) for cmd in retries)


@pytest.mark.cluster
@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_patches_are_accepted(cluster, crd, namespace, doc):
    res = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
    example = yaml.safe_load(EXAMPLE.read_text())
    res.create(body=example, namespace=namespace)
    patches = [cmd[cmd.index("-p") + 1] for cmd in commands(DOCS[doc], "kubectl patch")]
    assert patches
    for patch in patches:
        res.patch(name=example["metadata"]["name"], namespace=namespace, body=json.loads(patch),
                  content_type="application/merge-patch+json", query_params=[("dryRun", "All")])
