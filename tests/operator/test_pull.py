"""`ddtree pull`: URI parsing, linking local/pvc models, Hub downloads (huggingface_hub faked: nothing is
downloaded in tests), idempotence, concurrency, progress lines and one-line errors."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from ddtree import cli
from ddtree.errors import DDTreeError
from ddtree.models.pull import Progress, parse_uri, pull
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors.torch import save

WEIGHTS = save({"w": torch.arange(1024, dtype=torch.float32)})  # a real (tiny) safetensors file


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 1000)
    return path


class FakeHub:
    """Stands in for huggingface_hub: records calls, writes files, can wait for a concurrent peer, and can
    leave a damaged weights file behind (`damaged`: how many downloads do, as an interrupted pull would)."""

    def __init__(self, barrier: threading.Barrier | None = None, error: Exception | None = None,
                 damaged: int = 0, stalled: threading.Event | None = None) -> None:
        self.calls: list[dict] = []
        self.barrier, self.error, self.damaged, self.stalled = barrier, error, damaged, stalled

    def snapshot_download(self, repo_id, revision=None, local_dir=None, token=None, ignore_patterns=None):
        self.calls.append({"repo_id": repo_id, "revision": revision, "token": token, "ignore": ignore_patterns})
        if self.error:
            raise self.error
        if self.stalled:
            self.stalled.wait(timeout=30)  # a download that makes no progress until released
        if self.barrier:
            self.barrier.wait(timeout=5)  # both pulls must be in flight at once
        (Path(local_dir) / "config.json").write_text("{}")
        weights = Path(local_dir) / "model.safetensors"
        if not weights.exists():  # huggingface_hub keeps a file it believes complete
            weights.write_bytes(WEIGHTS[:-100] if self.damaged else WEIGHTS)
            self.damaged = max(0, self.damaged - 1)
        return str(local_dir)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        lfs = {"sha256": hashlib.sha256(WEIGHTS).hexdigest(), "size": len(WEIGHTS)}
        info = SimpleNamespace(siblings=[SimpleNamespace(rfilename="config.json", size=2, lfs=None),
                                         SimpleNamespace(rfilename="model.safetensors", size=len(WEIGHTS), lfs=lfs),
                                         SimpleNamespace(rfilename="model.gguf", size=10**9, lfs=None)])
        monkeypatch.setattr(huggingface_hub, "HfApi", lambda: SimpleNamespace(model_info=lambda *a, **k: info))
        return self


def test_parse_uri(monkeypatch):
    monkeypatch.setenv("DDTREE_PVC_ROOT", "/mnt/sources")
    assert parse_uri("hf://Qwen/Qwen3-8B@abc123") == parse_uri("hf://Qwen/Qwen3-8B@abc123")
    assert parse_uri("hf://Qwen/Qwen3-8B@abc123").revision == "abc123"
    assert parse_uri("hf://Qwen/Qwen3-8B").revision is None
    assert parse_uri("pvc://weights/qwen/8b").location == "/mnt/sources/weights/qwen/8b"
    assert parse_uri("/opt/models/x").kind == "local"
    for bad, message in [("s3://b/m", "unsupported scheme"), ("models/x", "must be absolute"),
                         ("hf://only-name", "expected hf://org/name")]:
        with pytest.raises(DDTreeError, match=message):
            parse_uri(bad)


def test_local_and_pvc_sources_are_linked_once(tmp_path, monkeypatch):
    src = model_dir(tmp_path / "src" / "tiny")
    monkeypatch.setenv("DDTREE_PVC_ROOT", str(tmp_path / "pvc"))
    pvc_model = model_dir(tmp_path / "pvc" / "claim" / "draft")
    dest, pvc_dest = tmp_path / "models" / "target", tmp_path / "models" / "draft"
    quiet = Progress("none")
    assert pull([(str(src), str(dest)), ("pvc://claim/draft", str(pvc_dest))], [None, None], quiet) == [
        "linked", "linked"]
    assert (dest / "config.json").is_file() and dest.resolve() == src
    assert pvc_dest.resolve() == pvc_model
    assert pull([(str(src), str(dest))], [None], quiet) == ["present"]


def test_local_source_errors(tmp_path):
    quiet = Progress("none")
    with pytest.raises(DDTreeError, match="is not a directory"):
        pull([(str(tmp_path / "missing"), str(tmp_path / "d"))], [None], quiet)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DDTreeError, match=r"no config\.json"):
        pull([(str(tmp_path / "empty"), str(tmp_path / "d"))], [None], quiet)
    src = model_dir(tmp_path / "src")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "other").write_text("x")
    with pytest.raises(DDTreeError, match="already exists"):
        pull([(str(src), str(occupied))], [None], quiet)


def test_hub_download_is_concurrent_idempotent_and_reports_progress(tmp_path, monkeypatch):
    hub = FakeHub(barrier=threading.Barrier(2)).install(monkeypatch)
    out = io.StringIO()
    pairs = [("hf://Qwen/Qwen3-8B@abc", str(tmp_path / "t")), ("hf://z-lab/Qwen3-8B-DFlash-b16", str(tmp_path / "d"))]
    assert pull(pairs, ["tok-t", None], Progress("json", interval=0.05, out=out)) == ["downloaded", "downloaded"]
    assert sorted((c["repo_id"], c["revision"], c["token"]) for c in hub.calls) == [
        ("Qwen/Qwen3-8B", "abc", "tok-t"), ("z-lab/Qwen3-8B-DFlash-b16", None, None)]
    assert all("*.gguf" in c["ignore"] for c in hub.calls)  # formats the server never reads are skipped
    final = [json.loads(line) for line in out.getvalue().splitlines() if json.loads(line)["done"]]
    assert {r["dest"] for r in final} == {str(tmp_path / "t"), str(tmp_path / "d")}
    total = 2 + len(WEIGHTS)
    assert all(r["bytesDone"] >= total and r["bytesTotal"] == total and r["remainingSeconds"] == 0 for r in final)
    marker = json.loads((tmp_path / "t" / ".ddtree-pull.json").read_text())
    assert marker["uri"] == "hf://Qwen/Qwen3-8B@abc" and marker["complete"] is True

    hub.calls.clear()
    hub.barrier = None
    assert pull(pairs, [None, None], Progress("none")) == ["present", "present"]
    assert hub.calls == []  # a completed pull is not repeated


def test_an_interrupted_pull_is_fetched_again_not_served(tmp_path, monkeypatch, capsys):
    """A weights file the first download left short is caught (size, sha256, header) and fetched again."""
    hub = FakeHub(damaged=1).install(monkeypatch)
    dest = tmp_path / "t"
    assert pull([("hf://org/m", str(dest))], [None], Progress("none")) == ["downloaded"]
    assert len(hub.calls) == 2 and (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert "model.safetensors" in capsys.readouterr().err  # it says what it fetches again
    marker = json.loads((dest / ".ddtree-pull.json").read_text())
    assert marker["complete"] and marker["files"]["model.safetensors"] == len(WEIGHTS)

    # Damaged after a completed pull (a full disk, a bad copy): the next pull notices and fetches it again.
    with open(dest / "model.safetensors", "r+b") as f:
        f.truncate(len(WEIGHTS) - 1)
    hub.calls.clear()
    assert pull([("hf://org/m", str(dest))], [None], Progress("none")) == ["downloaded"]
    assert len(hub.calls) == 1 and (dest / "model.safetensors").read_bytes() == WEIGHTS


def test_a_file_that_stays_damaged_fails_the_pull_in_one_line(tmp_path, monkeypatch):
    FakeHub(damaged=2).install(monkeypatch)
    with pytest.raises(DDTreeError, match="still damaged after a second download") as err:
        pull([("hf://org/m", str(tmp_path / "t"))], [None], Progress("none"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "t" / ".ddtree-pull.json").exists()


def test_hub_errors_are_one_line(tmp_path, monkeypatch):
    response = SimpleNamespace(status_code=404, headers={}, url="https://huggingface.co", request=None)
    FakeHub(error=RepositoryNotFoundError("404", response=response)).install(monkeypatch)
    with pytest.raises(DDTreeError, match="repository not found"):
        pull([("hf://nobody/nothing", str(tmp_path / "x"))], [None], Progress("none"))
    assert not (tmp_path / "x" / ".ddtree-pull.json").exists()


def test_cli_pull(tmp_path, monkeypatch, capsys):
    src = model_dir(tmp_path / "src")
    FakeHub().install(monkeypatch)
    monkeypatch.setenv("MY_TOKEN", "secret")
    assert cli.main(["pull", str(src), str(tmp_path / "a"), "hf://org/m", str(tmp_path / "b"),
                     "--token-env", "NONE_SET", "--token-env", "MY_TOKEN", "--progress", "json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["uri"] for r in lines if r["done"]} == {str(src), "hf://org/m"}

    assert cli.main(["pull", str(src)]) == 2
    assert "odd number of arguments" in capsys.readouterr().err
    assert cli.main(["pull", "s3://b/m", str(tmp_path / "c")]) == 2
    assert "unsupported scheme" in capsys.readouterr().err
    assert cli.main(["pull", str(src), "a", str(src), "b", "--token-env", "X", "--token-env", "Y",
                     "--token-env", "Z"]) == 2
    assert "once per pair" in capsys.readouterr().err


def test_a_pull_gives_up_after_its_timeout_in_one_line(tmp_path, monkeypatch, capsys):
    """What bounds a pull in emptyDir mode, where there is no Job deadline: it stops itself, and the
    kubelet's restart resumes it."""
    stalled = threading.Event()
    FakeHub(stalled=stalled).install(monkeypatch)
    dest = tmp_path / "t"
    started = time.monotonic()
    try:
        assert cli.main(["pull", "hf://org/m", str(dest), "--timeout", "0.5"]) == 2
    finally:
        stalled.set()
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ddtree pull: error: not finished after 0.5 s (--timeout): hf://org/m -> {dest}; the next pull "
                   "resumes from what was fetched"]
    assert cli.main(["pull", "hf://org/m", str(dest), "--timeout", "0"]) == 2
    assert "--timeout must be positive" in capsys.readouterr().err
