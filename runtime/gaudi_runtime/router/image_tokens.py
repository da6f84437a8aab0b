"""How many placeholder tokens an image becomes in a Llava-NeXT prompt.

The router expands each image into this many tokens and counts them against
--max-input-tokens; the model fills them with exactly as many features, laid out
by the same geometry (`gaudi_runtime.image_geometry`). The count is transformers'
(`LlavaNextProcessor._get_number_of_features`), so a prompt has the placeholder
count the reference implementation gives it.
"""

from __future__ import annotations

from gaudi_runtime.image_geometry import ImageGeometry, tile_grid, unpadded_shape


def image_token_count(height: int, width: int, geo: ImageGeometry) -> int:
    """Placeholder tokens for one image: the base tile's patches, then the unpadded high-resolution
    patches with one newline embedding ending each row."""
    grid_rows, grid_cols = tile_grid(height, width, geo)
    rows, cols = unpadded_shape(height, width, grid_rows * geo.side, grid_cols * geo.side)
    # The CLS token is dropped (vision_feature_select_strategy "default", the only one served).
    return geo.side * geo.side + rows * (cols + 1)
