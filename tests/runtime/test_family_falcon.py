"""Falcon served through HTTP equals transformers' greedy output, with 1 and 2 shards, in both decoder layouts.

* ``falcon``: the new decoder architecture of Falcon-40B/180B: 4 query heads in 2 KV groups,
  ``query_key_value`` stored group by group (2 shards: one group per rank), ``ln_attn`` and
  ``ln_mlp`` feeding attention and MLP in parallel, a separate LM head.
* ``falcon7b``: Falcon-7B's layout: multi-query (one KV head, replicated on both ranks with 2
  shards), one ``input_layernorm`` for attention and MLP, a tied LM head; with biases, so the
  fused ``query_key_value`` bias is sliced per rank too.

Norm weights and biases get random values (transformers initializes them to 1 and 0). The
other layouts transformers accepts (sequential attention then MLP, per-head q/k/v without
multi-query, one norm in the new architecture) are checked in process, one forward pass each.
"""

from __future__ import annotations

import json

import pytest
import torch

from gaudi_runtime.layers.fused_qkv import FusedQKVParallelLinear
from gaudi_runtime.layers.linear import TPContext
from gaudi_runtime.tools.tiny_model import make_config, make_tiny_model, randomize_vectors
from tests.runtime.family_parity import check_concurrent_requests, check_single_requests, serve
from tests.runtime.forward_parity import assert_prefill_logits_match, write_model
from tests.runtime.launched import SMALL_ARGS, launch


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for family in ("falcon", "falcon7b"):
        dirs[family] = make_tiny_model(tmp_path_factory.mktemp(family), family)
        randomize_vectors(dirs[family])
    return dirs


@pytest.fixture(scope="module", params=[("falcon", 1), ("falcon", 2), ("falcon7b", 1), ("falcon7b", 2)],
                ids=["new-decoder-1shard", "new-decoder-2shards", "7b-1shard", "7b-2shards"])
def server(request, model_dirs, tmp_path_factory):
    family, shards = request.param
    srv = serve(model_dirs[family], tmp_path_factory.mktemp(f"{family}-{shards}"), shards)
    yield srv
    srv.stop()


def test_greedy_single_requests_match_transformers(server):
    check_single_requests(server)


def test_greedy_concurrent_requests_match_transformers(server):
    check_concurrent_requests(server)


@pytest.mark.parametrize("overrides", [
    dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True),
    dict(new_decoder_architecture=False, multi_query=False, parallel_attn=True),
    dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1, num_kv_heads=1),
], ids=["sequential-per-head-qkv", "parallel-per-head-qkv", "new-decoder-one-norm-one-kv-head"])
def test_other_layouts_match_transformers(overrides, tmp_path):
    cfg = make_config("falcon7b", vocab_size=128, **overrides)
    assert_prefill_logits_match(write_model(cfg, tmp_path / "model"))


@pytest.mark.parametrize("layout,heads,kv_heads", [("grouped", 8, 2), ("grouped", 4, 4), ("grouped", 8, 1),
                                                   ("multi_query", 8, 1)])
def test_fused_qkv_rows_per_rank(layout, heads, kv_heads):
    """Each of 4 ranks holds [its query heads; its KV head(s); their values], read from the checkpoint layout."""
    head_dim, hidden, ranks = 2, 3, 4
    group = heads // kv_heads
    # Row blocks named by what they hold: ("q", h), ("k", g), ("v", g), in the checkpoint's order.
    if layout == "multi_query":
        names = [("q", h) for h in range(heads)] + [("k", 0), ("v", 0)]
    else:
        names = [n for g in range(kv_heads) for n in [("q", g * group + i) for i in range(group)] + [("k", g), ("v", g)]]
    code = {n: float(i) for i, n in enumerate(names)}
    fused = torch.tensor([code[n] for n in names]).repeat_interleave(head_dim)[:, None].expand(-1, hidden)
    for rank in range(ranks):
        layer = FusedQKVParallelLinear(hidden, head_dim, heads, kv_heads, layout, tp=TPContext(rank, ranks))
        layer.weight.weight_loader(layer.weight, fused)
        q_heads = range(rank * heads // ranks, (rank + 1) * heads // ranks)
        kv = [q_heads[0] // group] if kv_heads < ranks else range(rank * kv_heads // ranks,
                                                                     (rank + 1) * kv_heads // ranks)
        want = [code["q", h] for h in q_heads] + [code["k", g] for g in kv] + [code["v", g] for g in kv]
        assert layer.weight[::head_dim, 0].tolist() == want, rank


def test_alibi_falcon_fails_at_start_naming_it(model_dirs, tmp_path):
    """ALiBi Falcons (Falcon-RW) have no rotary positions: refused at start, not served wrong."""
    import shutil

    model = tmp_path / "alibi"
    shutil.copytree(model_dirs["falcon7b"], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "alibi": True}))
    srv = launch(model, tmp_path, "--device", "cpu", *SMALL_ARGS)
    try:
        assert srv.proc.wait(timeout=120) == 2  # refused by the launcher, before any shard starts
    finally:
        srv.stop()
    assert "Falcon with alibi: true" in srv.log() and "not supported" in srv.log()
    assert "Traceback" not in srv.log()
