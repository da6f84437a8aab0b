"""The anyres geometry gives every image the placeholder count and tile count transformers gives it.

Checked on Llava-v1.6's own geometry (336-pixel tiles of 14-pixel patches, its five pinpoints)
and on the tiny test model's, over square, wide, tall, tiny and huge images: a wrong count
would make the prompt's placeholders and the image's features disagree.
"""

from __future__ import annotations

import itertools

import pytest

from gaudi_runtime.image_geometry import ImageGeometry, best_resolution, tile_count, tile_grid
from gaudi_runtime.router.image_tokens import image_token_count

LLAVA_16 = {"vision_config": {"image_size": 336, "patch_size": 14},
            "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}
TINY = {"vision_config": {"image_size": 32, "patch_size": 8},
        "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]]}
SIZES = [(h, w) for h, w in itertools.product([1, 17, 100, 336, 480, 673, 2000], repeat=2)] + [(1, 5000), (5000, 1)]


def processor(geometry: dict):
    """transformers' LlavaNextProcessor for the geometry, configured as llava-hf's."""
    import transformers

    from gaudi_runtime.tools.tiny_model import train_tokenizer

    tok = train_tokenizer(300)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    side = geometry["vision_config"]["image_size"]
    images = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        image_grid_pinpoints=geometry["image_grid_pinpoints"])
    return transformers.LlavaNextProcessor(
        image_processor=images, tokenizer=tok, patch_size=geometry["vision_config"]["patch_size"],
        vision_feature_select_strategy="default", num_additional_image_tokens=1)


@pytest.mark.parametrize("geometry", [LLAVA_16, TINY], ids=["llava-v1.6", "tiny"])
def test_token_counts_equal_transformers_processor(geometry):
    want = processor(geometry)._get_num_multimodal_tokens(image_sizes=SIZES)["num_image_tokens"]
    geo = ImageGeometry.from_config(geometry)
    assert [image_token_count(h, w, geo) for h, w in SIZES] == want


@pytest.mark.parametrize("geometry", [LLAVA_16, TINY], ids=["llava-v1.6", "tiny"])
def test_tiles_and_resolution_equal_transformers(geometry):
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    geo = ImageGeometry.from_config(geometry)
    for h, w in SIZES:
        assert best_resolution(h, w, geo.grid_pinpoints) == select_best_resolution((h, w), geometry["image_grid_pinpoints"])
        assert tile_count(h, w, geo) == image_size_to_num_patches((h, w), geometry["image_grid_pinpoints"], geo.image_size)


def test_llava_16_known_counts():
    """A 672x672 photo is the 2x2 grid: 576 base + 48 rows of 48 patches and a newline = 2928 tokens."""
    geo = ImageGeometry.from_config(LLAVA_16)
    assert tile_grid(672, 672, geo) == (2, 2)
    assert image_token_count(672, 672, geo) == 576 + 48 * 49
    assert tile_grid(300, 1000, geo) == (1, 3)  # wide: the 336x1008 pinpoint


def test_defaults_are_llava_16s():
    """A config.json that lists only what differs from transformers' defaults still has its pinpoints."""
    geo = ImageGeometry.from_config({"vision_config": {"image_size": 336, "patch_size": 14}})
    assert geo.grid_pinpoints == tuple(tuple(p) for p in LLAVA_16["image_grid_pinpoints"])
    assert geo.side == 24
