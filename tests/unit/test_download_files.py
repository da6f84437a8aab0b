"""What `gaudi-serve download` fetches and how it checks it, and the JSON lines it prints (the format the
operator parses). The real command against a hub stand-in is in tests/runtime/test_download.py."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from gaudi_runtime.download import DownloadError, check_file, serving_files
from gaudi_runtime.download_events import EXIT_CODES, JsonLines, Progress

REPO = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "chat_template.jinja", "preprocessor_config.json", "README.md", ".gitattributes", "original/params.json",
        "original/consolidated.00.pth", "pytorch_model.bin"]


def test_the_runtime_files_and_the_indexed_weights_only():
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    names = REPO + shards + ["model.safetensors.index.json", "consolidated.safetensors"]
    files = serving_files(names, indexed=shards + shards[:1])
    assert files == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors.index.json",
                     "preprocessor_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
                     *shards]


@pytest.mark.parametrize("weights, expected", [
    (["model.safetensors", "consolidated.safetensors"], ["model.safetensors"]),
    (["consolidated.safetensors", "a.safetensors", "b.safetensors"], ["a.safetensors", "b.safetensors"]),
])
def test_weights_without_an_index_as_the_loader_picks_them(weights, expected):
    assert [f for f in serving_files(REPO + weights, None) if f.endswith(".safetensors")] == expected


def test_a_repository_the_runtime_cannot_serve_is_not_found():
    with pytest.raises(DownloadError, match="no .safetensors") as e:
        serving_files(REPO, None)
    assert e.value.reason == "not_found" and e.value.exit_code == EXIT_CODES["not_found"]
    with pytest.raises(DownloadError, match="model-00002-of-00002.safetensors") as e:
        serving_files(REPO + ["model-00001-of-00002.safetensors"], ["model-00001-of-00002.safetensors",
                                                                    "model-00002-of-00002.safetensors"])
    assert e.value.reason == "not_found"


def test_check_file_sizes_and_safetensors_headers(tmp_path):
    weights = tmp_path / "w"
    save_file({"w": np.zeros((64, 64), dtype=np.float32)}, str(weights))
    data = weights.read_bytes()
    assert check_file(weights, "model.safetensors", len(data)) is None
    assert "where the hub has" in check_file(weights, "model.safetensors", len(data) + 1)
    assert check_file(tmp_path / "absent", "config.json", 3) == "missing"
    weights.write_bytes(data[:-8])  # truncated: the header no longer covers the file
    assert "not a valid safetensors file" in check_file(weights, "model.safetensors", None)
    weights.write_bytes(bytes(b ^ 0xFF for b in data[:64]) + data[64:])  # same size, scrambled header
    assert "not a valid safetensors file" in check_file(weights, "model.safetensors", len(data))
    assert check_file(weights, "config.json", len(data)) is None  # only weights have a header to check


def test_json_lines_are_one_object_per_line_with_an_event():
    out = io.StringIO()
    lines = JsonLines(out)
    progress = Progress(lines, total=300, done=100, interval_s=3600)
    progress.report()
    progress.advance(50, "model.safetensors")  # within the interval: not reported
    progress.report()
    lines.done({"path": "/c/snapshots/abc", "bytes": 300, "fetched": 200, "seconds": 1.5, "repo": "o/m",
                "revision": None, "commit": "abc"})
    lines.error("no_space", "full")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert events == [
        {"event": "progress", "done": 100, "total": 300, "file": None},
        {"event": "progress", "done": 150, "total": 300, "file": "model.safetensors"},
        {"event": "done", "path": "/c/snapshots/abc", "bytes": 300, "fetched": 200, "seconds": 1.5, "repo": "o/m",
         "revision": None, "commit": "abc"},
        {"event": "error", "reason": "no_space", "message": "full"},
    ]


def test_exit_codes_tell_retriable_failures_apart():
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES)
    assert 0 not in EXIT_CODES.values() and 2 not in EXIT_CODES.values()  # 2: argparse's usage errors
