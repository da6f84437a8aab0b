"""Gemma 3 served through HTTP equals transformers' greedy output, with 1 and 2 shards, and with chunked
prefill and prefix caching.

The tiny random-weight model (`tiny_model.py`'s gemma3) has local layers with a window shorter than
the test prompts and answers, so tokens past the window must stop seeing the positions before it on
every path (prefill, prefill over cached blocks, the paged decode kernel); see the family's config in
`tiny_model.py` for the rest it sets apart. Norm weights get random values (transformers initializes
Gemma's to 0).
"""

from __future__ import annotations

import json

import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model, randomize_vectors
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve
from tests.runtime.windowed_family import check_chunked_and_cached


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3")
    randomize_vectors(path)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"gemma3-{request.param}"), request.param)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_an_image_text_checkpoint_serves_its_text_model(tmp_path_factory):
    """A Gemma3ForConditionalGeneration checkpoint (the published 4B-27B layout: text_config,
    language_model.* weights, a vision tower) on 2 shards answers as transformers' class on text prompts."""
    path = make_tiny_model(tmp_path_factory.mktemp("gemma3-vlm"), "gemma3_vlm")
    randomize_vectors(path)
    srv = serve(path, tmp_path_factory.mktemp("gemma3-vlm-2"), 2)
    try:
        check_single_requests(srv, n_prompts=2)
    finally:
        srv.stop()


def test_chunked_prefill_and_prefix_caching_match_transformers(model_dir, tmp_path):
    window = json.loads((model_dir / "config.json").read_text())["sliding_window"]
    check_chunked_and_cached(model_dir, tmp_path, window)
