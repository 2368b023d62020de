"""The README's Kubernetes section works as written: its helm values exist, its patches are accepted by the API server,
the files it names exist."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml
from k8s_testing import DDT, EXAMPLE, REPO
from test_chart import HELM, template

DOC = (REPO / "README.md").read_text()


def commands(prefix: str) -> list[list[str]]:
    """Shell commands of the doc's code blocks starting with `prefix` (continuation lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC, flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip().startswith(prefix)]


@pytest.mark.skipif(HELM is None, reason="no helm")
def test_helm_values_in_the_doc_exist():
    sets = [arg for cmd in commands("helm ") for i, arg in enumerate(cmd) if i and cmd[i - 1] == "--set"]
    assert sets, "the doc installs with --set values"
    template(*[s.replace("$REGISTRY", "registry.example.com/ddtree") for s in sets if "rbac" not in s])
    template("rbac.cluster=false", "watchNamespaces={ml,research}")  # the namespaced variant it describes


def test_files_the_doc_names_exist():
    for path in set(re.findall(r"(?:examples|crds|charts|images)/[\w./-]+\w", DOC)):
        assert (REPO / path).exists(), path


@pytest.mark.cluster
def test_the_docs_patches_are_accepted(cluster, crd, namespace):
    res = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
    example = yaml.safe_load(EXAMPLE.read_text())
    res.create(body=example, namespace=namespace)
    patches = [cmd[cmd.index("-p") + 1] for cmd in commands("kubectl patch")]
    assert len(patches) >= 2
    for patch in patches:
        res.patch(name=example["metadata"]["name"], namespace=namespace, body=json.loads(patch),
                  content_type="application/merge-patch+json", query_params=[("dryRun", "All")])
