"""Decoding of the media a sample refers to, into what the model's processor takes.

Images come as a path (absolute, or relative to a base folder), raw bytes, a ``{"bytes", "path"}``
dict (Hugging Face ``datasets`` image columns) or a PIL image; they are converted to RGB and scaled,
aspect ratio kept, so that their pixel count lies within ``[min_pixels, max_pixels]``. Errors raise
:class:`MediaError` with the offending reference; the dataset adds the file and row.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

from PIL import Image

MIN_IMAGE_SIDE = 28  # Qwen-VL: one merged patch is 28×28 pixels; smaller images cannot be encoded


class MediaError(ValueError):
    """A media reference that cannot be decoded; the message says which and why."""


def _describe(ref: Any) -> str:
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, dict):
        return f"<dict path={ref.get('path')!r}, {len(ref.get('bytes') or b'')} bytes>"
    return repr(ref)[:200]


def _open_image(ref: Any, base_dir: str | None) -> Image.Image:
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return Image.open(io.BytesIO(ref["bytes"]))
        if ref.get("path"):
            return _open_image(ref["path"], base_dir)
        raise MediaError("image dict has neither 'bytes' nor 'path'")
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref))
    if isinstance(ref, str):
        path = ref if os.path.isabs(ref) or base_dir is None else os.path.join(base_dir, ref)
        if not os.path.isfile(path):
            raise MediaError(f"image file '{path}' does not exist")
        return Image.open(path)
    raise MediaError(
        f"an image must be a path, bytes, a {{'bytes','path'}} dict or a PIL image, found {type(ref).__name__}"
    )


def resize_to_pixel_range(image: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """Scale ``image`` (aspect kept) so that width × height lies within [min_pixels, max_pixels]."""
    pixels = image.width * image.height
    if pixels > max_pixels:
        scale = math.sqrt(max_pixels / pixels)
    elif pixels < min_pixels:
        scale = math.sqrt(min_pixels / pixels)
    else:
        return image
    # floor when shrinking and ceil when growing keeps the result inside the range
    rounding = math.floor if scale < 1 else math.ceil
    size = (max(1, rounding(image.width * scale)), max(1, rounding(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def load_image(ref: Any, min_pixels: int, max_pixels: int, base_dir: str | None = None) -> Image.Image:
    """Decode one image reference into an RGB PIL image within the pixel range."""
    try:
        image = _open_image(ref, base_dir)
        image.load()  # decode now, so a truncated file fails here and not inside the processor
    except MediaError:
        raise
    except Exception as err:  # PIL raises many types for corrupt data
        raise MediaError(f"cannot decode image {_describe(ref)}: {err}") from err
    if image.mode != "RGB":
        image = image.convert("RGB")
    image = resize_to_pixel_range(image, min_pixels, max_pixels)
    if min(image.size) < MIN_IMAGE_SIDE:
        raise MediaError(
            f"image {_describe(ref)} is {image.width}×{image.height} after resizing; both sides must be "
            f">= {MIN_IMAGE_SIDE} pixels (raise data.min_pixels or pad the image)"
        )
    return image
