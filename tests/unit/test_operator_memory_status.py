"""status.memory: the memory estimate (gaudi_operator.memory) from the config.json the download Job's last line
carries, written by the runtime's own reporter, for spec.shards and the host tier of spec.kvCache.offload."""

from __future__ import annotations

import copy
from typing import Any

from gaudi_operator import prefetch_job
from gaudi_operator.components import render
from gaudi_operator.memory import config_subset, model_memory
from gaudi_operator.spec import parse_spec
from gaudi_operator.status import Observed, compute_status, invalid_spec_status, status_patch
from tests.unit.test_operator_download import MODEL, lines, live_job, pod

NOW = "2026-01-01T00:00:00Z"
# Llama-3.1-8B's config.json, as the hub serves it (the estimate reads a few of its entries).
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}, "eos_token_id": [128001, 128008, 128009]}
COMPLETE = live_job([{"type": "Complete", "status": "True"}])
PODS = [pod("dl-a", "Succeeded", "2026-01-01T00:00:00Z", 0)]


def done_line(config: dict[str, Any] | None) -> str:
    event = {"path": "/data/hub/models--m/snapshots/abc", "bytes": 16_060_000_000, "fetched": 0, "seconds": 2.0,
             "repo": MODEL["id"], "revision": "v2", "commit": "abc"}
    return lines(("done", ({**event, "config": config} if config is not None else event,)))


def body(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    b = {"apiVersion": "gaudiserve.io/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1},
         "spec": {"model": MODEL, **spec}}
    if status is not None:
        b["status"] = status
    return b


def status_of(b: dict[str, Any], log: str | None) -> dict[str, Any]:
    spec = parse_spec(b["spec"])
    download = prefetch_job.observe(COMPLETE, PODS, log, (b.get("status") or {}).get("download"))
    return compute_status(b, spec, render(b, spec), Observed(download=download), now=NOW)


def test_the_estimate_is_shown_once_the_download_reported_the_config() -> None:
    st = status_of(body(shards=1), done_line(LLAMA_8B))
    est = model_memory(LLAMA_8B, 2, 1)
    assert st["memory"] == {"parameters": est.parameters, "weightBytesPerShard": est.weight_bytes_per_shard,
                            "kvBytesPerTokenPerShard": 2 * 32 * 8 * 128 * 2}
    assert 8.0e9 < st["memory"]["parameters"] < 8.1e9
    # The status keeps only what the estimate reads, not the whole config.json.
    assert st["download"]["config"] == config_subset(LLAMA_8B) and "rope_scaling" not in st["download"]["config"]


def test_a_later_pass_estimates_again_for_a_new_shard_count_without_the_log() -> None:
    first = status_of(body(shards=1), done_line(LLAMA_8B))
    b = body(status=first, shards=2)
    assert prefetch_job.log_pod(COMPLETE, PODS, first["download"]) is None  # the log is not read again
    st = status_of(b, None)
    assert st["memory"]["kvBytesPerTokenPerShard"] == 2 * 32 * 4 * 128 * 2  # 4 of the 8 KV heads on each card
    assert st["memory"]["weightBytesPerShard"] == model_memory(LLAMA_8B, 2, 2).weight_bytes_per_shard
    assert status_patch(first, st)["memory"] == st["memory"]


def test_the_host_tier_in_tokens() -> None:
    st = status_of(body(shards=2, kvCache={"offload": {"hostMemory": "64Gi"}}), done_line(LLAMA_8B))
    # 64 GiB shared by the 2 cards, 64 KiB a token on each: 2**36 / (2**16 * 2) tokens.
    assert st["memory"]["hostTierTokens"] == 2**19


def test_no_estimate_without_a_config_it_can_read() -> None:
    assert "memory" not in status_of(body(), done_line(None))  # a runtime before the config was in the event
    llava = {"model_type": "llava_next", "text_config": {"hidden_size": 4096}}  # nested: not this estimate's
    assert "memory" not in status_of(body(), done_line(llava))
    fp8 = body(precision="fp8", quantization={"configMapRef": {"name": "q"}})
    assert "memory" not in status_of(fp8, done_line(LLAMA_8B))  # its bytes depend on its QUANT_CONFIG
    no_prefetch = body()
    no_prefetch["spec"]["model"] = {"id": "org/m"}
    spec = parse_spec(no_prefetch["spec"])
    assert "memory" not in compute_status(no_prefetch, spec, render(no_prefetch, spec), Observed(), now=NOW)


def test_an_invalid_spec_keeps_the_downloads_config() -> None:
    first = status_of(body(), done_line(LLAMA_8B))
    st = invalid_spec_status(body(status=copy.deepcopy(first)), "spec.shards: bad", now=NOW)
    assert st["download"]["config"] == first["download"]["config"]
