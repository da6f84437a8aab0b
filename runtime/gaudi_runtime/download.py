"""A model's serving files from the Hugging Face hub into the hub cache: `gaudi-serve download`, and
what `launch` does with a hub id.

Only what the runtime loads is fetched: config and generation config, tokenizer files and chat
templates, Llava's preprocessor config, and the safetensors weights the runtime reads (those the
index names, else model.safetensors: `weight_files`, which the loader uses too). Files land in huggingface_hub's own
cache layout (blobs, snapshot links, refs), so that `launch` with the same `--model-id` and cache finds
them, online or with HF_HUB_OFFLINE=1, and so does any other hub client.

Each file is fetched into `blobs/<etag>.incomplete`, which a later run resumes with a ranged request
(huggingface_hub's own partial files are per process and deleted on failure, so they cannot survive a
killed pod). A partial file becomes the blob only once its size matches the hub's and, for weights, its
safetensors header parses and covers the file; one that fails is fetched again once. When every file
passed, a marker in the snapshot records the files and sizes: a snapshot without it is incomplete, and
an offline start refuses it.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from gaudi_runtime import download_events as report

log = logging.getLogger(__name__)

WEIGHTS_INDEX = "model.safetensors.index.json"
# A config.json larger than this (a label table, say) is left out of the "done" event rather than make a log line
# the kubelet and the operator's tail of the log would have to carry.
MAX_CONFIG_BYTES = 32 << 10
# Besides the weights: config.json, generation_config.json, tokenizer*.json / tokenizer.model,
# special_tokens_map.json, chat templates (*.jinja, chat_template.json), preprocessor_config.json, merges.txt.
SERVING_PATTERNS = ("*.json", "*.jinja", "tokenizer*", "*.model", "*.txt")
COMPLETE_MARKER = ".gaudi-serve-complete.json"
# How long `launch` spent getting the model, handed to the shards for /info.
DOWNLOAD_SECONDS_ENV = "GAUDI_SERVE_DOWNLOAD_SECONDS"


class DownloadError(Exception):
    """A download that cannot complete; `reason` is one of `download_events.EXIT_CODES`."""

    def __init__(self, reason: str, message: str, adapter: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.adapter = adapter  # the LoRA adapter (its name) whose download failed, when it was one

    @property
    def exit_code(self) -> int:
        return report.EXIT_CODES.get(self.reason, 1)


def weight_files(top_level: list[str], indexed: list[str] | None) -> list[str]:
    """The safetensors files the runtime reads: those the index names, else model.safetensors, else every
    *.safetensors but Mistral's duplicate consolidated.safetensors."""
    present = sorted(n for n in top_level if n.endswith(".safetensors"))
    if indexed is not None:
        missing = sorted(set(indexed) - set(present))
        if missing:
            raise DownloadError("not_found", f"{WEIGHTS_INDEX} names {', '.join(missing)}, which the repository lacks")
        return sorted(set(indexed))
    if "model.safetensors" in present:
        return ["model.safetensors"]
    return [n for n in present if not n.startswith("consolidated")]


def serving_files(names: list[str], indexed: list[str] | None) -> list[str]:
    """Of a repository's file names, those the runtime loads (top level only: it reads one directory)."""
    top = [n for n in names if "/" not in n]
    weights = weight_files(top, indexed)
    if not weights:
        raise DownloadError("not_found", "the repository has no .safetensors weights (the runtime loads only those)")
    others = [n for n in top if not n.endswith(".safetensors") and any(fnmatch(n, p) for p in SERVING_PATTERNS)]
    return sorted(others) + weights


def check_file(path: Path, name: str, size: int | None) -> str | None:
    """What is wrong with a fetched file, or None: its size against the hub's and, for weights
    (`name` *.safetensors), a safetensors header that parses and whose tensors cover the file exactly."""
    try:
        actual = path.stat().st_size
    except OSError:
        return "missing"
    if size is not None and actual != size:
        return f"{actual} bytes where the hub has {size}"
    if name.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except Exception as e:  # safetensors raises its own error types for every malformed header
            return f"not a valid safetensors file ({e})"
    return None


@dataclass
class Repo:
    """One repository at one commit in one cache directory."""

    repo_id: str
    commit: str
    cache: Path

    @property
    def storage(self) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        return self.cache / repo_folder_name(repo_id=self.repo_id, repo_type="model")

    @property
    def snapshot(self) -> Path:
        return self.storage / "snapshots" / self.commit


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def resolve_commit(repo_id: str, revision: str | None, cache: Path) -> str:
    """The commit `revision` names: asked of the hub (recording it under refs/), or read from the
    cache's refs/ when the hub is offline or unreachable."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionResolutionError

    try:
        return HfApi().resolve_revision(repo_id, revision=revision, cache_dir=cache,
                                        local_files_only=_offline()).resolved
    except RevisionResolutionError as e:
        if _offline():
            raise DownloadError("not_cached", f"{repo_id}@{revision or 'main'} is not in the cache {cache} and "
                                "HF_HUB_OFFLINE is set: run `gaudi-serve download` where the hub is reachable") from e
        raise DownloadError("unreachable", str(e)) from e


def complete_files(snapshot: Path) -> dict[str, int] | None:
    """The files of a snapshot a previous run completed, each checked again; None if it is not complete."""
    try:
        record = json.loads((snapshot / COMPLETE_MARKER).read_text())
        files = {str(k): int(v) for k, v in record["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return files if all_present(snapshot, files) else None


def all_present(snapshot: Path, files: dict[str, int]) -> bool:
    for name, size in files.items():
        problem = check_file(snapshot / name, name, size)
        if problem is not None:
            log.warning("%s in %s: %s", name, snapshot, problem)
            return False
    return True


def planned_files(repo: Repo, listing: dict[str, int]) -> dict[str, int]:
    """The serving files of a listing (name -> size); the weights index, when listed, must be in the snapshot."""
    indexed = None
    if WEIGHTS_INDEX in listing:
        indexed = list(json.loads((repo.snapshot / WEIGHTS_INDEX).read_text())["weight_map"].values())
    return {name: listing[name] for name in serving_files(list(listing), indexed)}


def cached_files(repo: Repo) -> dict[str, int] | None:
    """A snapshot another hub client completed (`huggingface-cli download`, `snapshot_download`), without our
    marker: complete when every serving file of the tree listing huggingface_hub cached for the commit is
    there and checks. None when there is no such listing or a file is missing."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        tree = get_cached_repo_tree(repo.repo_id, revision=repo.commit, cache_dir=repo.cache)
        files = planned_files(repo, {f.path: f.size for f in tree if "/" not in f.path})
    except (CachedRepoTreeNotFoundError, OSError, ValueError, KeyError, DownloadError):
        return None
    return files if all_present(repo.snapshot, files) else None


def ensure_snapshot(repo_id: str, revision: str | None = None, cache_dir: str | None = None,
                    reporter: report.Reporter | None = None) -> dict:
    """Make the cache hold a complete, checked snapshot of `repo_id` at `revision`; return the "done"
    event's fields (path, bytes, fetched, seconds, repo, revision, commit). Raises DownloadError."""
    from huggingface_hub import constants

    t0 = time.monotonic()
    reporter = reporter or report.LogLines(log)
    cache = Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve()
    with hub_errors(repo_id):
        repo = Repo(repo_id, resolve_commit(repo_id, revision, cache), cache)
        files, fetched = complete_files(repo.snapshot), 0
        if files is None and _offline():
            files = cached_files(repo)
            if files is None:
                raise DownloadError("not_cached", f"the cache {cache} holds no complete snapshot of {repo_id} at "
                                    f"{repo.commit} and HF_HUB_OFFLINE is set: run `gaudi-serve download` first")
        if files is None:
            files, fetched = fetch_snapshot(repo, reporter)
        else:
            reporter.progress(sum(files.values()), sum(files.values()), None)
    total = sum(files.values())
    result = {"path": str(repo.snapshot), "bytes": total, "fetched": fetched,
              "seconds": round(time.monotonic() - t0, 3), "repo": repo_id, "revision": revision, "commit": repo.commit}
    config = model_config(repo.snapshot)
    if config is not None:
        result["config"] = config
    reporter.done(result)
    return result


def model_config(snapshot: Path) -> dict | None:
    """The snapshot's config.json, for the "done" event (the operator's memory estimate reads it from the download
    Job's log); None without one (an adapter), when it is not a JSON object, or when it is too large for a log line."""
    path = snapshot / "config.json"
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def fetch_snapshot(repo: Repo, reporter: report.Reporter) -> tuple[dict[str, int], int]:
    """Fetch and check every serving file not yet in the snapshot; write the completion marker.
    Returns the files with their sizes, and the bytes transferred."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    listing = {f.path: f.size for f in HfApi().list_repo_tree(repo.repo_id, revision=repo.commit, recursive=False)
               if isinstance(f, RepoFile)}
    (repo.snapshot / COMPLETE_MARKER).unlink(missing_ok=True)
    fetched = 0
    if WEIGHTS_INDEX in listing:  # small, and it says which weights to fetch
        fetched += ensure_file(repo, WEIGHTS_INDEX, listing[WEIGHTS_INDEX], None)
    files = planned_files(repo, listing)
    present = {n for n, size in files.items() if check_file(repo.snapshot / n, n, size) is None}
    progress = report.Progress(reporter, sum(files.values()), sum(files[n] for n in present))
    progress.report()
    for name, size in files.items():
        if name not in present:
            fetched += ensure_file(repo, name, size, progress)
            progress.report()
    _write_marker(repo, files)
    return files, fetched


def _write_marker(repo: Repo, files: dict[str, int]) -> None:
    marker = repo.snapshot / COMPLETE_MARKER
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"repo": repo.repo_id, "commit": repo.commit, "files": files}, indent=1))
    os.replace(tmp, marker)


def _discard(pointer: Path) -> None:
    """Remove a snapshot entry and the blob behind it (a link, or a copy where links are unsupported)."""
    target = pointer.resolve()
    pointer.unlink(missing_ok=True)
    if target != pointer:
        target.unlink(missing_ok=True)


def ensure_file(repo: Repo, name: str, size: int | None, progress: report.Progress | None) -> int:
    """Put `name` in the snapshot, checked; return the bytes transferred."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    pointer = repo.snapshot / name
    if pointer.is_symlink() or pointer.exists():
        problem = check_file(pointer, name, size)
        if problem is None:
            return 0
        log.warning("%s: %s; fetching it again", name, problem)
        _discard(pointer)
    meta = get_hf_file_metadata(hf_hub_url(repo.repo_id, name, revision=repo.commit))
    if not meta.etag:
        raise DownloadError("error", f"the hub sent no ETag for {name}: HF_ENDPOINT is not a hub-compatible server")
    size = meta.size if meta.size is not None else size
    fetched = fetch_blob(repo, name, size, meta.location, repo.storage / "blobs" / meta.etag, progress)
    # huggingface_hub links the blob into the snapshot (or copies it where links are unsupported) and records refs.
    hf_hub_download(repo.repo_id, name, revision=repo.commit, cache_dir=repo.cache)
    return fetched


def fetch_blob(repo: Repo, name: str, size: int | None, url: str, blob: Path,
               progress: report.Progress | None) -> int:
    """Fetch into `<blob>.incomplete` (resuming what is there), check, and only then move it into place.
    A file that fails its check is fetched once more from scratch before giving up. Under huggingface_hub's
    lock of the blob: a concurrent download of the same file (another Job, another revision) waits, then
    finds the blob in place."""
    from huggingface_hub.utils import WeakFileLock

    part = blob.with_name(blob.name + ".incomplete")
    lock = repo.cache / ".locks" / repo.storage.name / f"{blob.name}.lock"  # huggingface_hub's own lock path
    lock.parent.mkdir(parents=True, exist_ok=True)
    fetched = 0
    with WeakFileLock(lock):
        if check_file(blob, name, size) is None:
            if progress is not None:
                progress.advance(size or 0, name)
            return 0
        for attempt in (1, 2):
            fetched += transfer(url, part, name, size, progress)
            problem = check_file(part, name, size)
            if problem is None:
                os.replace(part, blob)
                return fetched
            log.warning("%s: %s (attempt %d); fetching it again", name, problem, attempt)
            if progress is not None:
                progress.advance(-part.stat().st_size, name)
            part.unlink()
    raise DownloadError("corrupt", f"{name} failed its check twice: {problem}")


def transfer(url: str, part: Path, name: str, size: int | None, progress: report.Progress | None) -> int:
    """Append the rest of `url` to `part` with a ranged GET (huggingface_hub's http_get, which also resumes
    within the run after a dropped connection); return the bytes transferred."""
    import shutil
    from urllib.parse import urlparse

    from huggingface_hub import constants
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    needed = (size or 0) - have
    free = shutil.disk_usage(part.parent).free
    if needed > free:
        raise DownloadError("no_space", f"{name} needs {needed} more bytes; {part.parent} has {free} free")
    if have:
        log.info("%s: resuming at byte %d of %s", name, have, size)
    if progress is not None:
        progress.advance(have, name)
    headers = build_hf_headers()
    if urlparse(url).netloc != urlparse(constants.ENDPOINT).netloc:
        headers.pop("authorization", None)  # a signed CDN location must not get the hub token
    counter = progress.bar_class(name) if progress is not None else None
    with open(part, "ab") as f:
        http_get(url, f, resume_size=have, headers=headers, expected_size=size, tqdm_class=counter)
    return part.stat().st_size - have


@contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """huggingface_hub's and the file system's failures as DownloadError with a reason."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except DownloadError:
        raise
    except GatedRepoError as e:
        raise DownloadError("unauthorized", f"{repo_id} is gated: accept its terms on the hub, and give the "
                            f"token of an account that did (HF_TOKEN): {_first_line(e)}") from e
    except (RevisionNotFoundError, RemoteEntryNotFoundError) as e:
        raise DownloadError("not_found", _first_line(e)) from e
    except RepositoryNotFoundError as e:
        if _status(e) in (401, 403):
            raise DownloadError("unauthorized", f"the hub refused access to {repo_id} ({_status(e)}): it does not "
                                "exist, or it is private or gated and HF_TOKEN is missing or lacks access") from e
        raise DownloadError("not_found", f"no repository {repo_id} on the hub") from e
    except HfHubHTTPError as e:
        raise _http_error(repo_id, e) from e
    except OfflineModeIsEnabled as e:
        raise DownloadError("not_cached", str(e)) from e
    except httpx2.TransportError as e:
        raise DownloadError("unreachable", f"cannot reach the hub: {type(e).__name__}: {e}") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DownloadError("no_space", f"no space left on the cache volume: {e}") from e
        raise


def _status(e) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _first_line(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(e).__name__


def _http_error(repo_id: str, e: Exception) -> DownloadError:
    status = _status(e)
    if status in (401, 403):
        return DownloadError("unauthorized", f"the hub refused the request for {repo_id} ({status}): check HF_TOKEN")
    if status is not None and (status >= 500 or status == 429):
        return DownloadError("unreachable", f"the hub answered {status}: {_first_line(e)}")
    return DownloadError("error", _first_line(e))


def fetch_adapters(lora_adapters: str | None, cache_dir: str | None, reporter: report.Reporter) -> None:
    """Each hub adapter of a --lora-adapters value into the cache (its own `done` event each), before the
    model, so that the model's `done` stays the last line of a success. Raises DownloadError naming it."""
    from gaudi_runtime.adapters import AdapterError, is_hub_id, parse_specs

    try:
        specs = parse_specs(lora_adapters, None)
    except AdapterError as e:
        raise DownloadError("error", f"--lora-adapters: {e}") from None
    for a in specs:
        if is_hub_id(a.source) and not os.path.isdir(a.source):  # a directory: nothing to fetch
            fetch_adapter(a, cache_dir, reporter)


def fetch_adapter(spec, cache_dir: str | None, reporter: report.Reporter | None = None) -> str:
    """The directory of an adapter's (`adapters.AdapterSpec`) hub snapshot, fetched and checked as a
    model's is. Raises DownloadError naming the adapter."""
    try:
        return ensure_snapshot(spec.source, spec.revision, cache_dir, reporter)["path"]
    except DownloadError as e:
        raise DownloadError(e.reason, f"adapter {spec.name!r} ({spec.source}): {e}", spec.name) from e


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gaudi-serve download", description="Fetch a model's serving files from the Hugging Face hub into the "
                                "hub cache: resumable, checked, with progress.",
                                epilog="JSON lines format and exit codes: docs/operations.md, \"Cold start\".")
    env = os.environ.get
    p.add_argument("--model-id", default=env("MODEL_ID"), help="Hugging Face hub id. [env: MODEL_ID]")
    p.add_argument("--revision", default=env("REVISION"),
                   help="Branch, tag or commit (default: the default branch). [env: REVISION]")
    p.add_argument("--huggingface-hub-cache", default=env("HUGGINGFACE_HUB_CACHE"),
                   help="Cache directory (default: huggingface_hub's, ~/.cache/huggingface/hub). "
                        "[env: HUGGINGFACE_HUB_CACHE]")
    p.add_argument("--lora-adapters", default=env("LORA_ADAPTERS"),
                   help="LoRA adapters, as `launch` takes them (`id`, `id@revision`, `name=id[@revision]`, "
                        "comma-separated): each hub adapter is fetched before the model (a local directory is "
                        "skipped), so that an offline `launch` finds them. [env: LORA_ADAPTERS]")
    p.add_argument("--progress", choices=("auto", "bar", "json"), default="auto",
                   help="auto: a bar on a terminal, JSON lines on stdout otherwise. [default: auto]")
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.model_id:
        _parser().error("--model-id (or MODEL_ID) is required")
    reporter = report.for_output(args.progress, sys.stdout)
    signal.signal(signal.SIGTERM, _interrupt)  # a deleted Job's pod: keep the partial file for the next run
    try:
        fetch_adapters(args.lora_adapters, args.huggingface_hub_cache, reporter)
        ensure_snapshot(args.model_id, args.revision, args.huggingface_hub_cache, reporter)
    except DownloadError as e:
        reporter.error(e.reason, str(e), adapter=e.adapter)
        return e.exit_code
    except KeyboardInterrupt:
        reporter.error("interrupted", "stopped by a signal; the next run resumes where this one stopped")
        return report.EXIT_CODES["interrupted"]
    except Exception as e:  # anything unforeseen still ends with an error event
        log.exception("download failed")
        reporter.error("error", f"{type(e).__name__}: {e}")
        return 1
    return 0
