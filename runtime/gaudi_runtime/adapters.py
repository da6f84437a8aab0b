"""LoRA adapters served beside the base model: what the flags name, and what a PEFT directory holds.

Torch-free (the launcher checks every adapter before it starts a shard, and the router reads the
parsed list): parsing `--lora-adapters` (TGI: `id`, `name=path`, `id@revision`) and `--lora-modules`
(vLLM: `name=path`), and reading an adapter's `adapter_config.json` and the header of its
`adapter_model.safetensors` against the base model's `config.json`. The shard loads the tensors
(`models/lora.py`) from the same facts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The families whose linear layers take adapters, and those layers under PEFT's names.
ADAPTER_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+\.layers\.(\d+)\.[a-z_]+\.([a-z_]+))\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter cannot be served; the message names it and what is wrong."""


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter to serve: as the user named it (a flag's entry, or a load request's body), and once
    `resolve_and_check` has found it, its local directory and the digest of its files."""

    name: str
    source: str  # a local directory or a hub id, as given
    revision: str | None = None
    path: str | None = None  # the local directory: `source`, or the hub snapshot of it
    digest: str | None = None  # SHA-256 of its files: salts its prefix-cache chains


class AdapterNotFound(AdapterError):
    """No local directory and no hub repository holds the adapter (an HTTP 404 on a load request)."""


def parse_specs(lora_adapters: str | None, lora_modules: str | None) -> list[AdapterSpec]:
    """Both flags' entries, in order; a name given twice is an error."""
    out: list[AdapterSpec] = []
    for item in _items(lora_adapters):
        named = "=" in item
        name, _, source = item.partition("=") if named else (item, "", item)
        revision = None
        if "@" in source and not os.path.isdir(source):
            source, _, revision = source.rpartition("@")
        if not named:
            name = source  # a hub id is served under its own name, without the revision
        out.append(AdapterSpec(name.strip(), source.strip(), revision or None))
    for item in _items(lora_modules):
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            raise AdapterError(f"--lora-modules {item!r}: expected name=path")
        out.append(AdapterSpec(name.strip(), path.strip()))
    seen: set[str] = set()
    for a in out:
        if not a.name or not a.source:
            raise AdapterError(f"adapter {a.name!r} ({a.source!r}): empty name or path")
        if a.name in seen:
            raise AdapterError(f"adapter name {a.name!r} is given twice")
        seen.add(a.name)
    return out


def is_hub_id(source: str) -> bool:
    """Whether `source` may name a hub repository: `name` or `owner/name`, not a path (the hub's rule)."""
    return not source.startswith((os.sep, ".")) and source.count("/") <= 1


def _items(value: str | None) -> list[str]:
    return [s for s in re.split(r"[,\s]+", value or "") if s]


@dataclass(frozen=True)
class AdapterFacts:
    """What the shard needs of a checked adapter."""

    rank: int
    scale: float  # lora_alpha / rank (/ sqrt(rank) with use_rslora), folded into B
    modules: dict[str, tuple[str, str]]  # module path in the checkpoint -> (A key, B key)


def expected_shapes(model_config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer an adapter may target, from the base model's config.json."""
    hidden, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    kv = (model_config.get("num_key_value_heads") or heads) * head_dim
    inter = model_config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def read_config(name: str, adapter_dir: Path) -> dict:
    path = adapter_dir / CONFIG_FILE
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: {adapter_dir} has no {CONFIG_FILE} (not a PEFT adapter)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: {path} is not a LoRA adapter (peft_type "
                           f"{cfg.get('peft_type') if isinstance(cfg, dict) else None!r})")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if cfg.get(key):
            raise AdapterError(f"adapter {name!r}: {key} is not supported yet")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias {cfg['bias']!r} is not supported (only 'none')")
    return cfg


def _header(name: str, adapter_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors header (no tensor is read)."""
    from safetensors import safe_open

    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"adapter {name!r}: {adapter_dir} has no {WEIGHTS_FILE}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for every malformed file
        raise AdapterError(f"adapter {name!r}: {path} is not a valid safetensors file ({e})") from None


def check_adapter(name: str, adapter_dir: str | Path, model_config: dict, max_rank: int) -> AdapterFacts:
    """Check an adapter against the base model and --max-lora-rank; AdapterError says what is wrong."""
    adapter_dir = Path(adapter_dir)
    arch = (model_config.get("architectures") or [""])[0]
    if arch not in ADAPTER_ARCHITECTURES:
        raise AdapterError(f"adapter {name!r}: LoRA adapters are served for {', '.join(ADAPTER_ARCHITECTURES)}, "
                           f"not {arch or 'this model'}")
    cfg = read_config(name, adapter_dir)
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) & {"lm_head", "embed_tokens"})
        if unsupported:
            raise AdapterError(f"adapter {name!r} targets {', '.join(unsupported)}: adapters on the embeddings "
                               f"or the LM head are not supported (only {', '.join(TARGETS)})")
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise AdapterError(f"adapter {name!r} targets {', '.join(unknown)}, which the model does not have "
                               f"(its adapter targets: {', '.join(TARGETS)})")
    shapes = _header(name, adapter_dir)
    modules, rank = _modules(name, shapes, model_config)
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterFacts(rank=rank, scale=scale, modules=modules)


def _modules(name: str, shapes: dict[str, list[int]], model_config: dict) -> tuple[dict[str, tuple[str, str]], int]:
    """Each targeted module's (A key, B key), every shape checked against the model; and the rank."""
    expected, layers = expected_shapes(model_config), model_config["num_hidden_layers"]
    pairs: dict[str, dict[str, str]] = {}
    rank = 0
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a linear layer "
                               "(embeddings, lm_head and extra modules are not supported)")
        module, layer, target, which = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if target not in expected or layer >= layers:
            raise AdapterError(f"adapter {name!r} targets {module}, which the model does not have")
        fan_in, fan_out = expected[target]
        r = shape[0] if which == "A" else shape[1]
        want = [r, fan_in] if which == "A" else [fan_out, r]
        if shape != want or (rank and r != rank):
            raise AdapterError(f"adapter {name!r}: {key} has shape {shape}, the model needs {want} with one rank "
                               "for every module: an adapter for another base model?")
        rank = r
        pairs.setdefault(module, {})[which] = key
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    half = sorted(m for m, p in pairs.items() if len(p) != 2)
    if half:
        raise AdapterError(f"adapter {name!r}: {half[0]} has only one of lora_A and lora_B")
    return {m: (p["A"], p["B"]) for m, p in pairs.items()}, rank


def digest(adapter_dir: str | Path) -> str:
    """SHA-256 of the adapter's config and weights: what names its KV blocks in the prefix cache."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(Path(adapter_dir) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
