"""Encoded images (PNG, JPEG, ...) to model input tensors, with limits checked before decoding.

Decoding runs in two steps so that its cost is known before it is paid: `plan_decode` reads only
the header (tens of microseconds, on the event loop), refuses an image over the limits and says
how many pixels decoding will produce (after a JPEG's reduced-scale draft); `decode_planned`
decodes and transforms (milliseconds to a few hundred, in the decode pool).
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from servewell.config.model import ImagePreprocess
from servewell.errors import BadRequest, PayloadTooLarge
from servewell.imaging import draft, transform_image

ACCEPTED_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
#: What `decode_base64` accepts, for request schemas: padded standard base64, after an optional data: URL prefix.
BASE64_PATTERN = r"^(?:data:[^,]*,)?(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
#: Longest side accepted by default: the most WebP can hold, and 4x a 16-megapixel square.
DEFAULT_MAX_SIDE = 16_384


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one encoded image may decode to."""

    max_pixels: int
    max_side: int = DEFAULT_MAX_SIDE


@dataclass(slots=True)
class PlannedDecode:
    """An image whose header has been read and checked; `pixels` is what decoding will produce."""

    image: Image.Image
    pixels: int


def decode_base64(text: str, field: str) -> bytes:
    """Strict base64 (a `data:...;base64,` prefix is allowed); `BadRequest` otherwise."""
    if not isinstance(text, str) or not text:
        raise BadRequest(f"field '{field}' must be a non-empty base64 string")
    if text.startswith("data:") and "," in text:
        text = text.split(",", 1)[1]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"field '{field}' is not valid base64") from None


def open_image(data: bytes, limits: ImageLimits | int) -> Image.Image:
    """Identify an image from its header, refusing (413) one over the limits before any pixel is
    decoded. `limits` may be a plain pixel count (the default side limit then applies)."""
    if isinstance(limits, int):
        limits = ImageLimits(limits)
    try:
        with warnings.catch_warnings():
            # Our own limits are checked below; Pillow's global warning threshold (89 megapixels)
            # says nothing about them. Its hard error (179 megapixels) still stops the open.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError:
        raise PayloadTooLarge(f"image exceeds the limit of {min(limits.max_pixels, _pillow_limit())} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, struct.error):
        raise BadRequest("the data is not a decodable image (PNG, JPEG, GIF, BMP, WEBP or TIFF)") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise PayloadTooLarge(f"image of {width}x{height} pixels exceeds the limit of {limits.max_pixels} pixels")
    if max(width, height) > limits.max_side:
        raise PayloadTooLarge(f"image of {width}x{height} pixels has a side longer than the limit of "
                              f"{limits.max_side} pixels")
    return image


def plan_decode(data: bytes, spec: ImagePreprocess, limits: ImageLimits | int) -> PlannedDecode:
    """Read and check the header, choose a reduced-scale decode where the format allows it (JPEG)."""
    image = open_image(data, limits)
    try:
        draft(image, spec)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"the image could not be decoded: {exc}") from None
    width, height = image.size
    return PlannedDecode(image, width * height)


def decode_planned(planned: PlannedDecode, spec: ImagePreprocess) -> np.ndarray:
    """Decode a planned image and transform it into one input item (float32)."""
    try:
        # (No warnings.catch_warnings here: it swaps process-wide state, and this runs in threads.)
        return transform_image(planned.image, spec, consume=True)
    except (OSError, ValueError, SyntaxError, EOFError, struct.error,
            Image.DecompressionBombError) as exc:
        # Truncated or corrupt pixel data surfaces only when the pixels are read; Pillow's plugins
        # raise any of these for malformed files (found by fuzzing the decoder).
        raise BadRequest(f"the image could not be decoded: {str(exc)[:120] or type(exc).__name__}") from None


def image_to_array(data: bytes, spec: ImagePreprocess, limits: ImageLimits | int) -> np.ndarray:
    """Decode one encoded image and transform it into one input item (float32)."""
    return decode_planned(plan_decode(data, spec, limits), spec)


def _pillow_limit() -> int:
    return int(2 * (Image.MAX_IMAGE_PIXELS or 0)) or 2**62
