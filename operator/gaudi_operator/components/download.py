"""spec.model.cache.prefetch: the model-cache download Job (prefetch_job.py), and the Downloaded
condition. The Job is shared by every InferenceService naming the same model, revision and claim:
each is one of its owners (none its controller), so it is created once, joined and left, never applied."""

from __future__ import annotations

from typing import Any

from ..prefetch_job import Download, render_job
from ..prefetch_job import summary as download_summary
from ..spec import InferenceServiceSpec
from .base import Component, Condition, Context, Observed, Rendered, Report


def _render(ctx: Context) -> list[dict[str, Any]]:
    job = render_job(ctx.body, ctx.spec)
    return [job] if job is not None else []


def _camel(reason: str) -> str:
    return "".join(part.capitalize() for part in reason.split("_"))


def downloaded(download: Download, spec: InferenceServiceSpec) -> Condition:
    """True once the model is in the claim; else why not yet, or why never without a change."""
    cache = spec.model.cache
    claim = cache.persistent_volume_claim.claim_name if cache and cache.persistent_volume_claim else "?"
    what = f"{spec.model.id}@{spec.model.revision or 'default branch'} in claim {claim}"
    if spec.model.hub_adapters:
        what += f" with {len(spec.model.hub_adapters)} LoRA adapter(s)"
    if download.state == "Complete":
        took = f" in {download.seconds:.1f}s" if download.seconds is not None else ""
        return Condition(True, "Downloaded", f"{what}: {download_summary(download)}{took} (job {download.job})")
    if download.state == "Failed":
        return Condition(False, _camel(download.reason or "error"), f"{what}: job {download.job} failed: "
                                                                    f"{download.reason}: {download.message}")
    progress = download_summary(download) if download.state == "Downloading" else "waiting for its pod to run"
    retry = (f"; attempt {download.attempts} failed ({download.reason}: {download.message}), retrying"
             if download.attempts else "")
    return Condition(False, "Downloading", f"{what}: job {download.job}: {progress}{retry}")


def _report(ctx: Context, rendered: Rendered, observed: Observed) -> Report | None:
    # Not a gate of Ready: pods of an earlier revision keep serving while the next one downloads.
    return None if observed.download is None else Report("Downloaded", downloaded(observed.download, ctx.spec))


DOWNLOAD = Component("model-download", ("Job",), render=_render, report=_report, shared=True)
