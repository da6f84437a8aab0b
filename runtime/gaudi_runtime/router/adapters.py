"""Which LoRA adapter a request names: TGI's `parameters.adapter_id`, or OpenAI's `model`.

Adapters are numbered as the configuration lists them (`Config.lora_adapters`): slot i is the i-th,
slot 0 the base model, which its name (`--model-name`) and its id also select. An unknown name is a
422 on TGI's routes and OpenAI's 404 `model_not_found` on /v1.
"""

from __future__ import annotations

from gaudi_runtime.config import Config
from gaudi_runtime.router.errors import ModelNotFoundError, ValidationError


def slot(config: Config, name: str | None) -> int | None:
    """The slot `name` selects: 0 for none or the base model, i for the i-th adapter; None if unknown."""
    if name is None or name in (config.model_name, config.model_id):
        return 0
    for i, a in enumerate(config.lora_adapters, start=1):
        if a["name"] == name:
            return i
    return None


def tgi_slot(config: Config, adapter_id: str | None) -> int:
    """TGI's `parameters.adapter_id` -> slot; ValidationError (422) when no adapter has that name."""
    found = slot(config, adapter_id)
    if found is None:
        served = ", ".join(a["name"] for a in config.lora_adapters) or "none"
        raise ValidationError(f"`adapter_id` {adapter_id!r} is not a served adapter (served: {served})")
    return found


def openai_slot(config: Config, model: str | None) -> int:
    """OpenAI's `model` -> slot. Without adapters any name means the base model (TGI ignores `model`);
    with adapters it must name the base model or one of them (vLLM's 404 otherwise)."""
    if not config.lora_adapters:
        return 0
    found = slot(config, model)
    if found is None:
        raise ModelNotFoundError(model or "")
    return found


def name(config: Config, index: int) -> str | None:
    """The adapter in slot `index` (None: the base model)."""
    return config.lora_adapters[index - 1]["name"] if index else None
