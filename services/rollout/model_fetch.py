"""`r3flow model fetch --uri URI --out DIR`: put a model into a (shared) volume once.

Runs as the init container of rollout and trainer pods when the chart's `model.download.uri`
is set. Pods start together, so the first takes an exclusive lock on `DIR.lock` and downloads
into `DIR.partial`, then renames it to DIR with a completion marker; the others wait on the
lock and find the marker. A failure exits non-zero and writes its reason to the termination
message file, so it shows in `kubectl get pods` (Init:Error) and `kubectl describe pod`.
URIs: hf://ORG/REPO[@REVISION] (huggingface_hub; hf://datasets/ORG/REPO a dataset repo, as
the chart's `model.download.datasetUri` fetches the prompts), anything fsspec opens (s3://, gs://,
file://; object stores need their fsspec package, e.g. s3fs, in the image).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
MARKER = ".r3flow-fetched"
TERMINATION_LOG = Path("/dev/termination-log")


def _download(uri: str, dest: Path) -> None:
    if uri.startswith("hf://"):
        from huggingface_hub import snapshot_download

        repo, _, revision = uri[len("hf://"):].partition("@")
        kind = "dataset" if repo.startswith("datasets/") else "model"
        snapshot_download(repo_id=repo.removeprefix("datasets/"), repo_type=kind,
                          revision=revision or None, local_dir=str(dest))
        return
    import fsspec

    fs, _, paths = fsspec.get_fs_token_paths(uri)
    if not fs.isdir(paths[0]):
        raise ValueError(f"--uri {uri}: not a directory")
    fs.get(paths[0].rstrip("/") + "/", str(dest), recursive=True)


def fetch(uri: str, out: str | Path) -> Path:
    """Download `uri` into `out` unless a previous fetch of the same URI completed there."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = out / MARKER
        if marker.is_file() and marker.read_text() == uri:
            log.info("model already fetched: %s", out)
            return out
        if out.exists():
            raise ValueError(f"--out {out}: exists but holds no completed fetch of {uri}")
        partial = out.parent / f"{out.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        _download(uri, partial)
        (partial / MARKER).write_text(uri)
        partial.rename(out)
    log.info("model fetched: %s -> %s", uri, out)
    return out


def run_fetch(uri: str, out: str) -> int:
    """CLI body: 0 on success; 1 with the reason in the termination message on failure."""
    try:
        print(fetch(uri, out))
        return 0
    except Exception as e:  # noqa: BLE001 -- any failure must reach the pod status, then exit 1
        msg = f"model fetch {uri} -> {out} failed: {type(e).__name__}: {e}"
        log.error(msg)
        if TERMINATION_LOG.parent.is_dir():
            try:
                TERMINATION_LOG.write_text(msg[:4000])
            except OSError:
                pass
        return 1
