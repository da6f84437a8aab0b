"""Mixtral (top-2 mixture of experts) served through HTTP equals transformers' greedy output.

A tiny random-weight Mixtral (8 experts, top-2) is served with 1 and 2 shards (each shard holds
half of every expert). Decode batches are padded to multiples of 2, so single requests decode
2 tokens at a time (the gathered-experts path: 2 x top-2 < 8 experts) and batches of 4 or more
take the loop over experts; both must give transformers' tokens.
"""

from __future__ import annotations

import pytest

from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve
from tests.runtime.launched import get_json


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral")


@pytest.fixture(scope="module", params=[1, 2], ids=["1shard", "2shards"])
def server(request, model_dir, tmp_path_factory):
    srv = serve(model_dir, tmp_path_factory.mktemp(f"mixtral-{request.param}"), request.param,
                env={"BATCH_BUCKET_SIZE": "2"})
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


def test_each_shard_holds_half_of_every_expert(server):
    code, info = get_json(server.url + "/info")
    assert code == 200 and info["num_shard"] == server.shards
    experts = _expert_bytes(server.model_dir)
    if server.shards == 1:
        assert info["weight_bytes_per_shard"] > experts
    else:  # a rank holding every expert whole would hold at least `experts` bytes
        assert info["weight_bytes_per_shard"] < experts


def _expert_bytes(model_dir) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if ".experts." in name:
                rows, cols = f.get_slice(name).get_shape()
                total += 4 * rows * cols  # fp32
    return total
