import pytest

from gaudi_runtime.config import ConfigError, resolve


def env(**kw):
    base = {"MODEL_ID": "/m"}
    base.update({k: str(v) for k, v in kw.items()})
    return base


def test_defaults_follow_tgi():
    cfg = resolve(None, env())
    assert cfg.max_total_tokens == 2048
    assert cfg.max_input_tokens == 2047
    # TGI's max-input-tokens + 50, at most one chunk of 384: a longer prompt is prefilled in chunks.
    assert cfg.max_batch_prefill_tokens == 384
    assert resolve(None, env(MAX_INPUT_TOKENS=256)).max_batch_prefill_tokens == 256 + 50
    assert cfg.max_concurrent_requests == 128
    assert cfg.max_waiting_tokens == 20
    assert cfg.waiting_served_ratio == 0.0
    assert cfg.num_shard == 1 and not cfg.sharded


def test_flag_wins_over_env():
    import argparse

    from gaudi_runtime.config import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model-id", "/x", "--max-batch-size", "7"])
    cfg = resolve(args, env(MAX_BATCH_SIZE=3, MAX_TOTAL_TOKENS=100))
    assert cfg.model_id == "/x"
    assert cfg.max_batch_size == 7
    assert cfg.max_total_tokens == 100


@pytest.mark.parametrize(
    "settings, names",
    [
        ({"MAX_INPUT_TOKENS": 100, "MAX_TOTAL_TOKENS": 100}, "--max-input-tokens"),
        ({"MAX_INPUT_TOKENS": 10, "MAX_INPUT_LENGTH": 11}, "--max-input-length"),
        ({"MAX_BATCH_PREFILL_TOKENS": 10, "MAX_INPUT_TOKENS": 20}, "--max-batch-prefill-tokens"),
        ({"MAX_BATCH_TOTAL_TOKENS": 10}, "--max-batch-total-tokens"),
        ({"MAX_BATCH_SIZE": "many"}, "MAX_BATCH_SIZE"),
        ({"SHARDED": "false", "NUM_SHARD": 2}, "--sharded"),
        ({"DTYPE": "int3"}, "--dtype"),
        ({"BATCH_BUCKET_SIZE": 0}, "BATCH_BUCKET_SIZE"),
    ],
)
def test_contradictions_fail_naming_the_setting(settings, names):
    with pytest.raises(ConfigError, match=names):
        resolve(None, env(**settings))


def test_model_id_required():
    with pytest.raises(ConfigError, match="--model-id"):
        resolve(None, {})


def test_config_round_trips_json():
    from gaudi_runtime.config import Config

    cfg = resolve(None, env(CORS_ALLOW_ORIGIN="a,b"))
    assert Config.from_json(cfg.to_json()) == cfg
    assert cfg.cors_allow_origin == ["a", "b"]


def test_the_logged_configuration_masks_the_api_key():
    import json

    cfg = resolve(None, env(API_KEY="s3cret-value"))
    logged = cfg.to_log_json()
    assert "s3cret-value" not in logged and json.loads(logged)["api_key"] == "<redacted>"
    # Everything else is logged as resolved; the children still get the key itself.
    assert {**json.loads(logged), "api_key": None} == {**json.loads(cfg.to_json()), "api_key": None}
    assert json.loads(cfg.to_json())["api_key"] == "s3cret-value"
    assert json.loads(resolve(None, env()).to_log_json())["api_key"] is None  # unset stays visibly unset
