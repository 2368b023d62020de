"""`ddtree pull`: put a model where the server will read it, once.

Sources: `hf://org/name[@revision]` (Hugging Face Hub), `pvc://claim/path` (a claim the pod mounts under
$DDTREE_PVC_ROOT, default /mnt/pvc) and local paths (air-gapped: weights already in the image or on a
volume). Hub models are downloaded into DEST and marked complete, so a repeated pull (a restarted Job, a
new pod) costs a stat and a header read per file; local and pvc sources are linked, not copied. Several
pairs pull concurrently: one process fetches the target and its draft at the same time. What was downloaded
is checked against the Hub (sizes, and the sha256 of LFS files) and against its safetensors headers: a
damaged file (an interrupted pull, a full disk) is fetched again, never marked complete.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ddtree.errors import DDTreeError
from ddtree.models.checkpoint import INDEX, CheckpointError, read_header, weight_files

MARKER = ".ddtree-pull.json"
# Weights in formats the server never reads (Flax, TF, ONNX, GGUF, Meta's originals): not worth the bytes.
SKIP = ["*.msgpack", "*.h5", "*.onnx", "*.onnx_data", "*.gguf", "original/*"]


@dataclass(frozen=True)
class Source:
    """A parsed model URI."""

    uri: str
    kind: str  # hf | pvc | local
    location: str  # repo id for hf, a filesystem path otherwise
    revision: str | None = None


def parse_uri(uri: str) -> Source:
    """Split a model URI; a one-line error for anything else (s3://, relative paths, ...)."""
    if uri.startswith("hf://"):
        repo, _, revision = uri[len("hf://"):].partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise DDTreeError(f"{uri!r}: expected hf://org/name or hf://org/name@revision")
        return Source(uri, "hf", repo, revision or None)
    if uri.startswith("pvc://"):
        claim, _, path = uri[len("pvc://"):].partition("/")
        if not claim:
            raise DDTreeError(f"{uri!r}: expected pvc://claim/path")
        root = os.environ.get("DDTREE_PVC_ROOT", "/mnt/pvc")
        return Source(uri, "pvc", str(Path(root, claim, path)))
    if "://" in uri:
        raise DDTreeError(f"{uri!r}: unsupported scheme; use hf://org/name, pvc://claim/path or a local path")
    if not os.path.isabs(uri):
        raise DDTreeError(f"{uri!r}: local model paths must be absolute")
    return Source(uri, "local", uri)


def _tree_bytes(root: Path) -> int:
    """Bytes of regular files under root (partial downloads included, symlinks skipped)."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                # a file may be renamed away between listing and stat (a finished .incomplete file)
                with contextlib.suppress(OSError):
                    total += os.path.getsize(p)
    return total


class Progress:
    """Prints progress every `interval` seconds: JSON lines on stdout (read back by the operator from the
    pod log) or a human line on stderr."""

    def __init__(self, mode: str, interval: float = 5.0, out: TextIO | None = None) -> None:
        self.mode, self.interval = mode, interval
        self.out = out or (sys.stdout if mode == "json" else sys.stderr)
        self.lock = threading.Lock()

    def emit(self, source: Source, dest: str, done_bytes: int, total: int | None, speed: float, done: bool) -> None:
        if self.mode == "none":
            return
        remaining = (total - done_bytes) / speed if total and speed > 0 and not done else (0.0 if done else None)
        with self.lock:
            if self.mode == "json":
                record = {"uri": source.uri, "dest": dest, "bytesDone": done_bytes, "bytesTotal": total,
                          "speedBytesPerSecond": round(speed, 1),
                          "remainingSeconds": None if remaining is None else round(remaining, 1), "done": done}
                print(json.dumps(record), file=self.out, flush=True)
            else:
                of = f" of {total / 1e9:.2f} GB" if total else ""
                state = "done" if done else f"{speed / 1e6:.1f} MB/s"
                print(f"{source.uri}: {done_bytes / 1e9:.2f} GB{of} ({state})", file=self.out, flush=True)

    def watch(self, source: Source, dest: Path, total: int | None, work: Callable[[], Any]) -> Any:
        """Run `work` while sampling the bytes under dest; report the final size when it returns."""
        stop = threading.Event()
        started = time.monotonic()

        def sample() -> None:
            last_bytes, last_time = _tree_bytes(dest), time.monotonic()
            while not stop.wait(self.interval):
                now_bytes, now = _tree_bytes(dest), time.monotonic()
                self.emit(source, str(dest), now_bytes, total, (now_bytes - last_bytes) / (now - last_time), False)
                last_bytes, last_time = now_bytes, now

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            result = work()
        finally:
            stop.set()
            sampler.join()
        size = _tree_bytes(dest)
        self.emit(source, str(dest), size, total or size, size / max(time.monotonic() - started, 1e-9), True)
        return result


def _marker(dest: Path) -> dict[str, Any] | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _link(source: Source, dest: Path, progress: Progress) -> str:
    src = Path(source.location)
    if not src.is_dir():
        raise DDTreeError(f"{source.uri}: {src} is not a directory")
    if not (src / "config.json").is_file():
        raise DDTreeError(f"{source.uri}: {src} has no config.json; is it a model directory?")
    if dest.is_symlink() and Path(os.readlink(dest)) == src:
        return "present"
    if dest.is_symlink():
        dest.unlink()  # a link to an earlier source
    elif dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    elif dest.exists():
        raise DDTreeError(f"{dest} already exists and is not a link to {src}; remove it or pick another DEST")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.symlink_to(src, target_is_directory=True)
    progress.emit(source, str(dest), 0, 0, 0.0, True)
    return "linked"


@dataclass(frozen=True)
class HubFile:
    """What the Hub says one file of a repo is: its size and, for LFS files (the weights), its sha256."""

    size: int | None
    sha256: str | None = None


def _hub_files(source: Source, token: str | None) -> dict[str, HubFile] | None:
    """The files a pull fetches (SKIP left out), for progress percentages and for checking the download;
    None when the Hub does not say (a mirror, an old revision): the files are then checked by their own
    headers only."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(source.location, revision=source.revision, token=token, files_metadata=True)
    except Exception:  # a nicety: never fail a pull over it
        return None
    files = {}
    for s in info.siblings or []:
        if not any(fnmatch.fnmatch(s.rfilename, p) for p in SKIP):
            lfs = s.lfs.get("sha256") if isinstance(s.lfs, dict) else getattr(s.lfs, "sha256", None)
            files[s.rfilename] = HubFile(s.size, lfs)
    return files or None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * 2**20):
            digest.update(block)
    return digest.hexdigest()


def damaged(dest: Path, expected: dict[str, HubFile] | None) -> dict[str, str]:
    """What is wrong with a pulled directory, {file: reason} ({} when sound): files missing or not the size
    (or LFS sha256) the Hub gave, and safetensors files whose headers do not match their bytes or shards
    an index names but nobody fetched."""
    problems: dict[str, str] = {}
    for name, want in (expected or {}).items():
        path = dest / name
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            problems[name] = "missing"
        elif want.size is not None and size != want.size:
            problems[name] = f"{size} bytes, the Hub has {want.size}"
        elif want.sha256 and _sha256(path) != want.sha256:
            problems[name] = "its sha256 differs from the Hub's"
    for path in sorted(dest.glob("*.safetensors")):
        if path.name not in problems:
            try:
                read_header(path)
            except CheckpointError as exc:
                problems[path.name] = str(exc)
    try:
        weight_files(dest)
    except CheckpointError as exc:
        problems.setdefault(INDEX, str(exc))
    return problems


def _present(source: Source, dest: Path) -> bool:
    """A completed pull of this URI whose files are still whole (sizes as recorded, safetensors headers
    matching their bytes): a stat per file and a header read, not a download."""
    marker = _marker(dest)
    if not (marker and marker.get("uri") == source.uri and marker.get("complete")):
        return False
    recorded = {name: HubFile(size) for name, size in (marker.get("files") or {}).items()}
    problems = damaged(dest, recorded)
    if problems:
        name, reason = next(iter(problems.items()))
        _note(f"{source.uri}: {dest / name}: {reason}; pulling it again")
        _discard(dest, [MARKER, *problems])
    return not problems


def _note(line: str) -> None:
    """A human line on stderr (in JSON mode too: the operator reads only the JSON lines)."""
    print(line, file=sys.stderr, flush=True)


def _discard(dest: Path, names: list[str]) -> None:
    """Delete damaged files and what huggingface_hub remembers of them, so the next download fetches them."""
    for name in names:
        for path in (dest / name, dest / ".cache" / "huggingface" / "download" / f"{name}.metadata"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _download(source: Source, dest: Path, token: str | None, progress: Progress) -> str:
    if _present(source, dest):
        return "present"
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    dest.mkdir(parents=True, exist_ok=True)
    files = _hub_files(source, token)
    total = (sum(f.size or 0 for f in files.values()) or None) if files else None

    def fetch() -> str:
        return progress.watch(source, dest, total, lambda: snapshot_download(
            source.location, revision=source.revision, local_dir=dest, token=token, ignore_patterns=SKIP))

    try:
        commit = fetch()
        problems = damaged(dest, files)
        if problems:  # e.g. a file an interrupted pull left behind that huggingface_hub took as complete
            _note(f"{source.uri}: damaged after download ({', '.join(f'{n}: {r}' for n, r in problems.items())}); "
                  "fetching those files again")
            _discard(dest, list(problems))
            commit = fetch()
            problems = damaged(dest, files)
    except GatedRepoError:
        raise DDTreeError(f"{source.uri}: gated model; accept its terms on the Hub and pass a token "
                          "(HF_TOKEN or --token-env)") from None
    except RevisionNotFoundError:
        raise DDTreeError(f"{source.uri}: revision {source.revision!r} not found") from None
    except RepositoryNotFoundError:
        raise DDTreeError(f"{source.uri}: repository not found (or private: pass a token)") from None
    except LocalEntryNotFoundError as exc:
        raise DDTreeError(f"{source.uri}: cannot reach the Hub and no local copy ({exc})") from None
    except HfHubHTTPError as exc:
        raise DDTreeError(f"{source.uri}: download failed: {exc}") from None
    if problems:
        name, reason = next(iter(problems.items()))
        raise DDTreeError(f"{source.uri}: {dest / name} is still damaged after a second download: {reason}")
    sizes = {p.relative_to(dest).as_posix(): p.stat().st_size for p in dest.rglob("*")
             if p.is_file() and ".cache" not in p.relative_to(dest).parts and p.name != MARKER}
    (dest / MARKER).write_text(json.dumps({"uri": source.uri, "revision": source.revision,
                                           "commit": Path(str(commit)).name, "complete": True, "files": sizes}))
    return "downloaded"


def pull_one(uri: str, dest: str, token: str | None, progress: Progress) -> str:
    """Pull one model; returns what happened: downloaded, linked or present (nothing to do)."""
    source = parse_uri(uri)
    target = Path(dest)
    if source.kind == "hf":
        return _download(source, target, token, progress)
    return _link(source, target, progress)


def pull(pairs: list[tuple[str, str]], tokens: list[str | None], progress: Progress,
         timeout: float | None = None) -> list[str]:
    """Pull every (uri, dest) pair concurrently; the first error (a DDTreeError) ends the pull at once. Past
    `timeout` seconds it gives up with a DDTreeError. The downloads run in daemon threads, which do not hold
    the process open, and what they fetched stays for the next pull to resume from."""
    for uri, _ in pairs:
        parse_uri(uri)  # reject bad URIs before starting any download
    futures: list[Future[str]] = []
    for (uri, dest), token in zip(pairs, tokens, strict=True):
        future: Future[str] = Future()
        threading.Thread(target=_settle, args=(future, pull_one, uri, dest, token, progress), daemon=True,
                         name=f"ddtree-pull-{len(futures)}").start()
        futures.append(future)
    wait(futures, timeout=timeout, return_when=FIRST_EXCEPTION)
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()
    unfinished = [f"{uri} -> {dest}" for (uri, dest), f in zip(pairs, futures, strict=True) if not f.done()]
    if unfinished:
        raise DDTreeError(f"not finished after {timeout:g} s (--timeout): {', '.join(unfinished)}; the next pull "
                          "resumes from what was fetched")
    return [f.result() for f in futures]


def _settle(future: Future[str], fn: Callable[..., str], *args: Any) -> None:
    """Run `fn` and put its result, or its exception, in `future`."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)
