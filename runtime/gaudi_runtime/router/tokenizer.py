"""The router's tokenizer: the fast Hugging Face tokenizer `AutoTokenizer` loads from the model directory.

With SKIP_TOKENIZER_IN_TGI the router does not tokenize: `inputs` are comma-separated
token ids and decoded text is the comma-separated ids (TGI-Gaudi's benchmarking mode).
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gaudi_runtime.config import ServedModelConfig


class TokenizerError(ValueError):
    """The text (or id list) cannot be tokenized."""


def _ids_from_config(path: Path, key: str) -> list[int]:
    """eos/bos ids from generation_config.json, then config.json (int or list)."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            v = json.loads(f.read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(v, int):
            return [v]
        if isinstance(v, list) and all(isinstance(i, int) for i in v):
            return list(v)
    return []


def chat_template_from(path: str) -> str:
    """The chat template of a tokenizer_config.json (--tokenizer-config-path): a string, or the
    "default" entry of a list of named templates."""
    try:
        template = json.loads(Path(path).read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"--tokenizer-config-path {path}: not a readable tokenizer_config.json ({e})") from e
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(f"--tokenizer-config-path {path}: has no chat_template")
    return template


def keep_torch_out() -> None:
    """Make torch absent from this process as transformers sees it: for the router, which runs no model.

    AutoTokenizer reads the model's config.json through transformers' configuration module, which
    imports torch wherever it is installed: seconds at every start, for nothing a tokenizer uses.
    A None entry in sys.modules makes `import torch` fail and `find_spec` find nothing, so
    transformers, asked before its first import, takes torch for not installed (its tokenizers
    work as they do with it). Once transformers or torch is loaded, transformers has its answer:
    this leaves such a process as it is.
    """
    if "transformers" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None
    # transformers says at import that without torch "models won't be available": true, and the point.
    logging.getLogger("transformers").addFilter(lambda r: not str(r.msg).startswith("PyTorch was not found"))


def _auto_tokenizer(path: str, revision: str | None):
    """The tokenizer `transformers.AutoTokenizer` loads for the model in `path`: the one transformers
    and vLLM tokenize its prompts with.

    The class is AutoTokenizer's choice by its own rules, not a copy of them: the class named in
    tokenizer_config.json or config.json, the model type's (which replaces a generic class, and
    one transformers knows the hub names wrongly: Qwen2's tokenizer splits digits one by one where
    the generic one merges them), auto_map. Without trust_remote_code, as the shards' grammar
    vocabulary and vLLM by default load it.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, revision=revision)


# Text that `clean_up_tokenization` changes (a space before punctuation and contractions): if
# transformers' decode leaves it as the backend decodes it, its clean-up is off for this tokenizer.
_CLEAN_UP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're j"


def backend_decode(hf) -> Callable[[list[int], bool], str] | None:
    """The `tokenizers` library's own decode, where it gives exactly what `hf.decode` gives.

    transformers' decode converts its arguments and calls that same backend decode, at several
    times the decode's own cost on the router's per-token path; then it may clean up
    tokenization spaces. A tokenizer class with a decode of its own, or whose decode does clean up,
    keeps transformers' decode (None).
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(hf)
    if (getattr(cls, "decode", None) is not PreTrainedTokenizerBase.decode
            or getattr(cls, "_decode", None) is not PreTrainedTokenizerFast._decode):
        return None
    backend = hf.backend_tokenizer
    if getattr(hf, "clean_up_tokenization_spaces", False):
        ids = backend.encode(_CLEAN_UP_PROBE, add_special_tokens=False).ids
        raw = backend.decode(ids, skip_special_tokens=False)
        # The probe proves the clean-up off only where it would have changed the text.
        if raw == hf.clean_up_tokenization(raw) or hf.decode(ids) != raw:
            return None
    return backend.decode


class RouterTokenizer:
    def __init__(self, hf_tokenizer: Any | None, *, skip_tokenizer: bool = False,
                 eos_token_ids: list[int] | None = None, bos_token_id: int | None = None,
                 vocab_size: int | None = None):
        if hf_tokenizer is None and not skip_tokenizer:
            raise ValueError("a tokenizer is required unless SKIP_TOKENIZER_IN_TGI is set")
        self.hf = hf_tokenizer
        self.skip_tokenizer = skip_tokenizer
        eos = list(eos_token_ids or [])
        if hf_tokenizer is not None and hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.insert(0, hf_tokenizer.eos_token_id)
        self.eos_token_ids: list[int] = eos
        if bos_token_id is None and hf_tokenizer is not None:
            bos_token_id = hf_tokenizer.bos_token_id
        self.bos_token_id = bos_token_id
        self.special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids if hf_tokenizer else ())
        # Token ids a client may send (a prompt of ids, SKIP_TOKENIZER_IN_TGI): the tokenizer's, else the model's.
        self.vocab_size = len(hf_tokenizer) if hf_tokenizer is not None else vocab_size
        # Detokenization runs twice per generated token: the backend's decode where it is exact.
        self._decode = None if hf_tokenizer is None else backend_decode(hf_tokenizer) or hf_tokenizer.decode

    @classmethod
    def load(cls, path: str, model: ServedModelConfig) -> RouterTokenizer:
        p = Path(path)
        hf = None
        try:
            hf = _auto_tokenizer(path, model.revision)
        except Exception:
            if not model.skip_tokenizer_in_tgi:
                raise
        if hf is not None and not hf.is_fast:
            raise ValueError(f"{path}: the router needs a fast tokenizer (tokenizer.json)")
        if hf is not None and model.tokenizer_config_path:
            hf.chat_template = chat_template_from(model.tokenizer_config_path)
        bos = _ids_from_config(p, "bos_token_id")
        vocab = _ids_from_config(p, "vocab_size")
        return cls(hf, skip_tokenizer=model.skip_tokenizer_in_tgi, eos_token_ids=_ids_from_config(p, "eos_token_id"),
                   bos_token_id=bos[0] if bos else None, vocab_size=vocab[0] if vocab else None)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.skip_tokenizer:
            try:
                ids = [int(t) for t in text.split(",") if t.strip()]
            except ValueError:
                raise TokenizerError(
                    "SKIP_TOKENIZER_IN_TGI is set: `inputs` must be comma-separated token ids"
                ) from None
            self.check_ids(ids)
            return ids
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def check_ids(self, ids: list[int]) -> None:
        """Token ids sent by a client are ids of this model's vocabulary (TokenizerError if not)."""
        top = "" if self.vocab_size is None else f" and < {self.vocab_size}"
        for i in ids:
            if i < 0 or (self.vocab_size is not None and i >= self.vocab_size):
                raise TokenizerError(f"token id {i} is not in the vocabulary: ids must be >= 0{top}")

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, int, int]]:
        """[(id, start, stop)] with character offsets into `text` (for /tokenize)."""
        if self.skip_tokenizer:
            return [(i, 0, 0) for i in self.encode(text)]
        enc = self.hf(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [(i, s, e) for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.skip_tokenizer:
            return ",".join(str(i) for i in ids)
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The template's text (the default one of a list of named templates), None without one."""
        template = getattr(self.hf, "chat_template", None) if self.hf is not None else None
        if isinstance(template, dict):
            template = template.get("default")
        return template if isinstance(template, str) else None

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            variables: dict[str, Any] | None = None) -> str:
        """The conversation rendered, ready for the assistant's answer; `variables`: more for the
        template (a request's `chat_template_kwargs`), none of which may be the renderer's own options."""
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise TokenizerError("this model's tokenizer has no chat template")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        if variables:
            own = set(inspect.signature(self.hf.apply_chat_template).parameters) | {"messages"}
            taken = sorted(own & set(variables))
            if taken:
                raise TokenizerError(f"`chat_template_kwargs`: {', '.join(taken)} cannot be set this way")
            kwargs.update(variables)
        try:
            return self.hf.apply_chat_template(messages, **kwargs)
        except Exception as e:  # jinja errors raised by the template itself
            raise TokenizerError(f"chat template error: {e}") from e
