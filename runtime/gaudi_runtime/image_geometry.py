"""Llava-NeXT "anyres" geometry: the tile grid an image gets and the patches left once its padding is cut.

Both sides of the service lay images out the same way: the router counts an image's
placeholder tokens from it, the model orders the image's features by it. It lives in
neither so that each can import it, and it stays pure (no torch): the router process
must not load the model side. The formulas are transformers' (`select_best_resolution`,
`unpad_image`), so our layout is the reference implementation's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageGeometry:
    image_size: int  # the vision tower's input side (pixels); one tile
    patch_size: int  # pixels per vision patch side
    grid_pinpoints: tuple[tuple[int, int], ...]  # candidate (height, width) resolutions

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ImageGeometry:
        """From a Llava-NeXT config.json dict (missing fields take transformers' defaults)."""
        vision = cfg.get("vision_config") or {}
        pinpoints = cfg.get("image_grid_pinpoints") or [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
        return cls(
            image_size=int(vision.get("image_size", 224)),
            patch_size=int(vision.get("patch_size", 32)),
            grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
        )

    @property
    def side(self) -> int:
        """Patches along one side of a tile."""
        return self.image_size // self.patch_size


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The pinpoint (height, width) keeping most of the image's pixels, then wasting least."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    if best is None:
        raise ValueError("image_grid_pinpoints is empty")
    return best


def tile_grid(height: int, width: int, geo: ImageGeometry) -> tuple[int, int]:
    """(rows, columns) of tiles the high-resolution view of an image is cut into."""
    h, w = best_resolution(height, width, geo.grid_pinpoints)
    return h // geo.image_size, w // geo.image_size


def unpadded_shape(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """Patch rows and columns of the tile grid (``rows`` x ``cols`` patches) left after removing
    the letterbox padding the image got when it was fitted into the grid."""
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        rows -= ((rows - new_rows) // 2) * 2
    else:
        new_cols = int(round(width * (rows / height), 7))
        cols -= ((cols - new_cols) // 2) * 2
    return rows, cols


def tile_count(height: int, width: int, geo: ImageGeometry) -> int:
    """Tiles the vision tower encodes for one image: the grid plus the downscaled whole image."""
    rows, cols = tile_grid(height, width, geo)
    return rows * cols + 1
