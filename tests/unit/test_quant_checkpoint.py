"""A pre-quantized checkpoint is recognised from config.json, checked against --quantize, and anything
gaudi-serve does not read stops the start with one line naming it (before any shard starts)."""

from __future__ import annotations

import json

import pytest

from gaudi_runtime.config import ConfigError, resolve
from gaudi_runtime.quant.checkpoint import check_checkpoint, checkpoint_quant
from gaudi_runtime.tools.tiny_model import make_tiny_model
from tests.runtime.prequantized import write_block_fp8, write_compressed_tensors_fp8

CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                "symmetric": True, "dynamic": False},
                                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "symmetric": True, "dynamic": True}}}}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "version": "gemm", "group_size": 128, "zero_point": True}


def with_group(**changes) -> dict:
    group = json.loads(json.dumps(CT["config_groups"]["group_0"]))
    for key, value in changes.items():
        group[key] = value
    return {**CT, "config_groups": {"group_0": group}}


def test_formats_are_described():
    assert "per-channel weight scales, dynamic per-token activations" in checkpoint_quant(
        {"quantization_config": CT}).describe()
    block = checkpoint_quant({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert block.block == (128, 128) and "128x128 block" in block.describe()
    gptq = checkpoint_quant({"quantization_config": GPTQ})
    assert (gptq.weights, gptq.group_size, gptq.desc_act, gptq.sym) == ("int4", 128, True, False)
    awq = checkpoint_quant({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "GEMM",
                                                    "group_size": 128, "zero_point": True}})
    assert awq.weights == "int4" and not awq.sym
    assert checkpoint_quant({}) is None


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "bitnet"}, "quant_method: 'bitnet' is not a format gaudi-serve reads"),
    ({**GPTQ, "bits": 3}, "bits: 3-bit GPTQ"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version: 'gemv'"),
    ({**AWQ, "zero_point": False}, "zero_point: AWQ without zero points"),
    ({**CT, "format": "pack-quantized"}, "format: 'pack-quantized'"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    (with_group(weights={"num_bits": 4, "type": "int", "strategy": "group"}), "group_0.weights: 4-bit int"),
    (with_group(weights={"num_bits": 8, "type": "float", "strategy": "group"}), "strategy: 'group'"),
    (with_group(input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}),
     "input_activations: strategy 'token' with dynamic=False"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: [128]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
])
def test_unread_formats_and_options_are_one_line_errors(qc, field):
    with pytest.raises(ConfigError) as e:
        checkpoint_quant({"quantization_config": qc})
    message = str(e.value)
    assert message.startswith("config.json quantization_config.") and field in message and "\n" not in message


@pytest.mark.parametrize("flag,qc,problem", [
    ("gptq", None, "--quantize gptq: the checkpoint has no quantization_config"),
    ("awq", GPTQ, "--quantize awq does not match the checkpoint (quantization_config.quant_method 'gptq')"),
    ("gptq", CT, "--quantize gptq does not match the checkpoint"),
    ("gptq", AWQ, "--quantize gptq does not match the checkpoint (quantization_config.quant_method 'awq')"),
])
def test_flag_against_the_checkpoint(tmp_path, flag, qc, problem):
    cfg = {} if qc is None else {"quantization_config": qc}
    with pytest.raises(ConfigError, match="^" + problem.replace("(", r"\(").replace(")", r"\)")):
        check_checkpoint(tmp_path, cfg, [], flag, None)


@pytest.fixture(scope="module")
def ct_model(tmp_path_factory):
    return write_compressed_tensors_fp8(make_tiny_model(tmp_path_factory.mktemp("ct"), "llama"))


def test_fp8_checkpoint_answers_to_its_names(ct_model):
    from gaudi_runtime.models.registry import read_config, safetensors_files

    cfg = read_config(ct_model)
    for flag in (None, "fp8", "compressed-tensors"):
        assert check_checkpoint(ct_model, cfg, safetensors_files(ct_model), flag, None).weights == "fp8"
    with pytest.raises(ConfigError, match="^QUANT_CONFIG: the checkpoint is already quantized"):
        check_checkpoint(ct_model, cfg, safetensors_files(ct_model), "fp8", "/q.json")


def test_missing_scale_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_block_fp8(make_tiny_model(tmp_path, "llama"))
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, model_dir / "model.safetensors")
    from gaudi_runtime.launcher import check_quantized

    cfg = resolve(None, {"MODEL_ID": str(model_dir)})
    with pytest.raises(ConfigError, match=r"^checkpoint tensor 'model.layers.1.mlp.down_proj.weight' is float8 but "
                                          r"model.layers.1.mlp.down_proj.weight_scale_inv is missing$"):
        check_quantized(cfg, str(model_dir))


def test_quantize_names():
    import argparse

    from gaudi_runtime.config import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert resolve(p.parse_args(["--model-id", "/m", "--quantize", "gptq"]), {}).model.quantize == "gptq"
    assert resolve(None, {"MODEL_ID": "/m", "QUANTIZE": "awq"}).model.quantize == "awq"
    with pytest.raises(ConfigError, match="^--quantize bitsandbytes: not served by gaudi-serve"):
        resolve(None, {"MODEL_ID": "/m", "QUANTIZE": "bitsandbytes"})
    with pytest.raises(ConfigError, match="^--quantize 'int3': choose one of fp8, compressed-tensors, gptq, awq$"):
        resolve(None, {"MODEL_ID": "/m", "QUANTIZE": "int3"})


def test_lora_over_a_quantized_checkpoint_is_refused(ct_model):
    from gaudi_runtime.launcher import check_quantized

    cfg = resolve(None, {"MODEL_ID": str(ct_model), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    with pytest.raises(ConfigError, match=r"^--lora-adapters: LoRA over a quantized base model \(compressed-tensors"):
        check_quantized(cfg, str(ct_model))


def test_batch_invariant_mode_refuses_a_quantized_checkpoint(ct_model):
    from gaudi_runtime.launcher import check_quantized

    cfg = resolve(None, {"MODEL_ID": str(ct_model), "BATCH_INVARIANT": "true"})
    with pytest.raises(ConfigError, match=r"^--batch-invariant cannot be combined with a quantized checkpoint "
                                          r"\(compressed-tensors"):
        check_quantized(cfg, str(ct_model))


def test_gptq_packing_matches_hand_packed_words():
    """The format's documented packing, on words written by hand: input rows 0..7 of a 4-bit column are
    the nibbles of 0x87654321 lowest first; 8-bit: bytes of 0x04030201; a symmetric 4-bit zero is stored
    as 7 (0x77777777) and means 8."""
    import torch

    from gaudi_runtime.quant.gptq import gptq_zeros, unpack
    from tests.runtime.prequantized import pack_rows

    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    assert unpack(word, 4).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert unpack(torch.tensor([0x04030201], dtype=torch.int32), 8).tolist() == [1, 2, 3, 4]
    assert pack_rows(torch.arange(1, 9).reshape(8, 1), 4).tolist() == [[0x87654321 - 2**32]]
    assert gptq_zeros(4)(torch.tensor([[0x77777777]], dtype=torch.int32)).tolist() == [[8] * 8]


def test_a_gptq_zero_of_zero_borrows_from_the_field_above():
    """Asymmetric zeros 0..7 packed are 0x76543210; the `gptq` format stores that minus 0x11111111 as one
    number (0x654320FF: field 0 wraps to 15 and field 1 lends it one), and reading adds it back whole, as
    gptqmodel does. One per field instead would read 16, 0, 2, ..."""
    import torch

    from gaudi_runtime.quant.gptq import gptq_zeros
    from tests.runtime.prequantized import gptq_v1_zeros

    stored = gptq_v1_zeros(torch.tensor([[0x76543210]], dtype=torch.int32), 4)
    assert stored.tolist() == [[0x654320FF]]
    assert gptq_zeros(4)(stored).tolist() == [list(range(8))]
    assert gptq_zeros(8)(gptq_v1_zeros(torch.tensor([[0x03020100]], dtype=torch.int32), 8)).tolist() == [[0, 1, 2, 3]]


def test_awq_packing_matches_a_hand_packed_word():
    """AutoAWQ packs output columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7: the word 0x87654321 (nibble i
    = i + 1) holds columns 0..7 = 1, 5, 2, 6, 3, 7, 4, 8."""
    import torch

    from gaudi_runtime.quant.gptq import pack, unpack_awq
    from tests.runtime.prequantized import pack_awq

    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)
    assert unpack_awq(word).tolist() == [[1, 5, 2, 6, 3, 7, 4, 8]]
    assert pack_awq(torch.tensor([[1, 5, 2, 6, 3, 7, 4, 8]])).tolist() == word.tolist()
    assert pack(torch.arange(1, 9).reshape(1, 8), 4).tolist() == word.tolist()


def test_missing_gptq_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path / "m", "llama")
    from tests.runtime.prequantized import write_gptq

    write_gptq(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.scales"]
    save_file(tensors, model_dir / "model.safetensors")
    from gaudi_runtime.models.registry import read_config, safetensors_files

    with pytest.raises(ConfigError, match=r"^checkpoint tensor model.layers.0.self_attn.k_proj.scales is missing"):
        check_checkpoint(model_dir, read_config(model_dir), safetensors_files(model_dir), "gptq", None)
