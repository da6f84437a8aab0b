"""Images in prompts, as TGI takes them: markdown `![](url)` in `inputs` (chat `image_url` parts
become the same markdown), where the URL is a `data:image/...;base64,...` URL or an http(s)
URL the router fetches (size limit, timeout, and only where `media_fetch` allows).

For a vision model (Llava-NeXT) each image is decoded (Pillow) to learn its size and
replaced in the prompt text by its placeholder tokens, as many as the model makes of
it (router/image_tokens.py, over gaudi_runtime/image_geometry.py); the encoded bytes go to the shards with the request.
Every problem is a 422 naming the image. Text-only models leave markdown as text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaudi_runtime.config import ConfigError, LimitsConfig
from gaudi_runtime.image_geometry import ImageGeometry
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.image_tokens import image_token_count
from gaudi_runtime.router.media_fetch import FetchPolicy, fetch_url

# TGI's pattern: `![alt](url)`, optionally with a "title" after the URL.
IMAGE_MARKDOWN = re.compile(r"!\[[^\]]*\]\((.*?)\s*(\"(?:.*[^\"])\")?\s*\)")
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w=-]+)*?;base64,(.*)", re.DOTALL)
VISION_ARCHITECTURES = {"LlavaNextForConditionalGeneration"}
IMAGE_TOKEN = "<image>"
# Pixels an image may declare before it is decoded: a few KB of PNG can expand to gigabytes, and
# Llava downsizes to at most its largest pinpoint anyway.
MAX_PIXELS = 64 * 1024 * 1024


@dataclass
class PromptImages:
    text: str  # the prompt, each image replaced by its placeholder tokens
    image_token_id: int
    images: list[bytes] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)

    def place(self, input_ids: list[int], tokenized: int) -> tuple[list[bytes], list[int]]:
        """The images of a validated prompt `input_ids` (`tokenized` tokens before truncation) and where
        each one's placeholder tokens start, once its tokens hold exactly their placeholders."""
        if self.images and len(input_ids) != tokenized:
            raise ValidationError("`truncate` cannot cut a prompt that holds images")
        placeholders = input_ids.count(self.image_token_id)
        if placeholders != sum(self.token_counts):
            raise ValidationError(f"the prompt has {placeholders} image placeholder tokens but its images "
                                  f"need {sum(self.token_counts)}")
        positions = [i for i, t in enumerate(input_ids) if t == self.image_token_id]
        return list(self.images), [positions[sum(self.token_counts[:k])] for k in range(len(self.images))]


def split_markdown(text: str) -> list[str | tuple[str]]:
    """Prompt text -> its pieces: strings, and `(url,)` for each markdown image."""
    parts: list[str | tuple[str]] = []
    cursor = 0
    for m in IMAGE_MARKDOWN.finditer(text):
        if m.start() > cursor:
            parts.append(text[cursor:m.start()])
        parts.append((m.group(1),))
        cursor = m.end()
    if cursor < len(text):
        parts.append(text[cursor:])
    return parts


def decode_data_url(url: str, max_bytes: int) -> bytes:
    m = DATA_URL.fullmatch(url.strip())
    if m is None:
        raise ValidationError("invalid image: a data URL must be `data:image/<type>;base64,<data>`")
    payload = re.sub(r"\s+", "", m.group(3))
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ValidationError(f"image too large: more than {max_bytes} bytes (MAX_IMAGE_BYTES)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValidationError(f"invalid image: the data URL is not valid base64 ({e})") from None
    if len(data) > max_bytes:
        raise ValidationError(f"image too large: {len(data)} bytes, more than {max_bytes} (MAX_IMAGE_BYTES)")
    return data


def image_size(data: bytes) -> tuple[int, int]:
    """(height, width) of an encoded image, after fully decoding it (a truncated file fails here,
    not on the shard)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            if width * height > MAX_PIXELS:
                raise ValidationError(f"image too large: {width}x{height} pixels, more than {MAX_PIXELS}")
            im.load()
    except ValidationError:
        raise
    except Image.DecompressionBombError as e:
        raise ValidationError(f"image too large: {e}") from None
    except Exception as e:  # Pillow raises many types for undecodable data
        raise ValidationError(f"invalid image: cannot decode it ({type(e).__name__}: {e})") from None
    if width < 1 or height < 1:
        raise ValidationError("invalid image: it has no pixels")
    return height, width


class ImagePrompter:
    """Expands the images of a prompt for one vision model."""

    def __init__(self, geometry: ImageGeometry, image_token_id: int, limits: LimitsConfig):
        self.geometry = geometry
        self.image_token_id = image_token_id
        self.limits = limits
        self.fetch_policy = FetchPolicy.from_limits(limits)

    @classmethod
    def load(cls, model_dir: str | Path, limits: LimitsConfig) -> ImagePrompter | None:
        """The prompter of a vision model; None for a text-only one."""
        import json

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if not set(cfg.get("architectures") or []) & VISION_ARCHITECTURES:
            return None
        token = cfg.get("image_token_index", cfg.get("image_token_id"))
        return cls(ImageGeometry.from_config(cfg), int(token), limits)

    async def load_image(self, url: str, index: int) -> bytes:
        limit = self.limits.max_image_bytes
        try:
            if url.startswith("data:"):
                return decode_data_url(url, limit)
            if url.startswith(("http://", "https://")):
                return await fetch_url(url, limit, self.limits.image_fetch_timeout_s, self.fetch_policy)
            raise ValidationError("invalid image: the URL must be a data: URL or http(s)")
        except ValidationError as e:
            raise ValidationError(f"image {index}: {e}") from None

    async def expand(self, text: str) -> PromptImages:
        if IMAGE_TOKEN in text:
            raise ValidationError(f"the prompt contains the image placeholder `{IMAGE_TOKEN}` as text; "
                                  "give images as markdown `![](data:image/png;base64,...)`")
        out = PromptImages(text="", image_token_id=self.image_token_id)
        parts = split_markdown(text)
        check_image_count(sum(isinstance(p, tuple) for p in parts), self.limits.max_images_per_request)
        pieces = []
        for part in parts:
            if isinstance(part, str):
                pieces.append(part)
                continue
            index = len(out.images)
            data = await self.load_image(part[0], index)
            height, width = await asyncio.to_thread(_checked_size, data, index)
            count = image_token_count(height, width, self.geometry)
            if count > self.limits.max_input_tokens:
                raise ValidationError(
                    f"image {index} ({width}x{height}) takes {count} tokens, more than `--max-input-tokens` "
                    f"({self.limits.max_input_tokens})")
            out.images.append(data)
            out.token_counts.append(count)
            pieces.append(IMAGE_TOKEN * count)
        out.text = "".join(pieces)
        return out


def check_image_count(count: int, limit: int) -> None:
    """Before any image is fetched or decoded: at most `limit` of them in one prompt."""
    if count > limit:
        raise ValidationError(f"the prompt holds {count} images, more than --max-images-per-request ({limit})")


def _checked_size(data: bytes, index: int) -> tuple[int, int]:
    try:
        return image_size(data)
    except ValidationError as e:
        raise ValidationError(f"image {index}: {e}") from None


async def prompt_images(state, text: Any) -> PromptImages | None:
    """The prompt's images expanded for a vision model; None for a text-only model or a non-string prompt."""
    prompter: ImagePrompter | None = getattr(state, "images", None)
    if prompter is None or not isinstance(text, str):
        return None
    return await prompter.expand(text)


def check_image_budget(limits: LimitsConfig, model_config: dict[str, Any]) -> None:
    """At start: a vision model needs room for an image in every prompt (TGI-Gaudi's BASE_IMAGE_TOKENS)."""
    if not set(model_config.get("architectures") or []) & VISION_ARCHITECTURES:
        return
    if limits.max_input_tokens < limits.base_image_tokens:
        raise ConfigError(
            f"--max-input-tokens ({limits.max_input_tokens}) is below BASE_IMAGE_TOKENS "
            f"({limits.base_image_tokens}), the image-token budget of this vision model: raise "
            "--max-input-tokens (and --max-total-tokens) or lower BASE_IMAGE_TOKENS")
