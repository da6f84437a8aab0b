import dataclasses

import pytest

from gaudi_runtime.config import ConfigError, resolve


def env(**kw):
    base = {"MODEL_ID": "/m"}
    base.update({k: str(v) for k, v in kw.items()})
    return base


def test_defaults_follow_tgi():
    cfg = resolve(None, env())
    assert cfg.limits.max_total_tokens == 2048
    assert cfg.limits.max_input_tokens == 2047
    # TGI's max-input-tokens + 50, at most one chunk of 256: a longer prompt is prefilled in chunks.
    assert cfg.scheduling.max_batch_prefill_tokens == 256
    assert resolve(None, env(MAX_INPUT_TOKENS=128)).scheduling.max_batch_prefill_tokens == 128 + 50
    assert cfg.limits.max_concurrent_requests == 128
    assert cfg.scheduling.max_waiting_tokens == 20
    assert cfg.scheduling.waiting_served_ratio == 0.0
    assert cfg.device.num_shard == 1 and not cfg.device.sharded


def test_flag_wins_over_env():
    import argparse

    from gaudi_runtime.config import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model-id", "/x", "--max-batch-size", "7"])
    cfg = resolve(args, env(MAX_BATCH_SIZE=3, MAX_TOTAL_TOKENS=100))
    assert cfg.model.model_id == "/x"
    assert cfg.scheduling.max_batch_size == 7
    assert cfg.limits.max_total_tokens == 100


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
    assert cfg.server.cors_allow_origin == ["a", "b"]


def test_the_logged_configuration_masks_the_api_key():
    import json

    cfg = resolve(None, env(API_KEY="s3cret-value"))
    logged = json.loads(cfg.to_log_json())
    assert "s3cret-value" not in cfg.to_log_json() and logged["server"]["api_key"] == "<redacted>"
    # Everything else is logged as resolved, part by part; the children still get the key itself.
    sent = json.loads(cfg.to_json())
    assert sent["server"].pop("api_key") == "s3cret-value"
    del logged["server"]["api_key"]
    assert logged == sent
    assert json.loads(resolve(None, env()).to_log_json())["server"]["api_key"] is None  # unset stays visibly unset


# ---- the parts -------------------------------------------------------------------------------------

def test_every_flag_and_env_setting_lands_in_exactly_one_part():
    from gaudi_runtime import config

    declared = [f.name for typ in config.PARTS.values() for f in dataclasses.fields(typ)]
    assert len(declared) == len(set(declared)), "a setting is declared by two parts"
    assert list(config.PARTS) == [f.name for f in dataclasses.fields(config.Config)]
    given = [config._attr(flag) for flag, *_ in config.FLAGS] + [env.lower() for env, *_ in config.ENV_ONLY]
    assert len(given) == len(set(given))
    for name in given:
        kept = config.FOLDED_FLAGS.get(name, name)  # --max-input-length lands in max_input_tokens
        assert kept in config.PART_OF, f"{name}: no part declares it"
    # Every field of a part is a flag or an environment setting: no setting without its flag table row.
    assert set(declared) == set(given) - set(config.FOLDED_FLAGS)


def test_each_setting_is_read_from_its_part():
    cfg = resolve(None, env(PORT=8080, MAX_N=3, PREFIX_CACHING="false", DEVICE="cpu", QUANTIZE="fp8",
                            TOOL_CALL_PARSER="hermes", MAX_LORA_RANK=8, MAX_INPUT_LENGTH=100))
    assert cfg.server.port == 8080 and cfg.server.shard_socket(1) == "/tmp/gaudi-serve-server-1"
    assert cfg.limits.max_n == 3 and cfg.limits.max_input_tokens == 100
    assert cfg.scheduling.prefix_caching is False and cfg.device.device == "cpu"
    assert cfg.model.quantize == "fp8" and cfg.structured_output.tool_call_parser == "hermes"
    assert cfg.adapters.max_lora_rank == 8
    assert not hasattr(cfg, "port") and not hasattr(cfg, "max_input_length")


def test_a_config_from_flat_settings_and_a_changed_copy():
    from gaudi_runtime.config import Config

    cfg = Config.of(model_id="m", max_input_tokens=80, port=9)
    assert (cfg.model.model_id, cfg.limits.max_input_tokens, cfg.server.port) == ("m", 80, 9)
    assert cfg.limits.max_total_tokens == 2048  # the rest defaulted
    changed = cfg.replace(log_level="warning", max_n=2)
    assert (changed.server.log_level, changed.limits.max_n, changed.server.port) == ("warning", 2, 9)
    assert cfg.server.log_level == "info" and changed.model is cfg.model  # parts not changed are shared
    assert changed.setting("max_n") == 2
    with pytest.raises(TypeError, match="no such setting: prot"):
        Config.of(prot=80)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # a part handed to a reader cannot be changed under the others
