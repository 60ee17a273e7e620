"""Encoded images (PNG, JPEG, ...) to model input tensors, with limits checked before decoding."""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from servewell.config.model import ImagePreprocess
from servewell.errors import BadRequest, PayloadTooLarge
from servewell.imaging import transform_image

ACCEPTED_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")


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


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Identify and decode an image, refusing oversized ones before the pixels are decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise PayloadTooLarge(f"image exceeds the limit of {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise BadRequest("the data is not a decodable image (PNG, JPEG, GIF, BMP, WEBP or TIFF)") from None
    width, height = image.size
    if width * height > max_pixels:
        raise PayloadTooLarge(f"image of {width}x{height} pixels exceeds the limit of {max_pixels} pixels")
    return image


def image_to_array(data: bytes, spec: ImagePreprocess, max_pixels: int) -> np.ndarray:
    """Decode one encoded image and transform it into one input item (float32)."""
    image = open_image(data, max_pixels)
    try:
        return transform_image(image, spec)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # Truncated or corrupt pixel data surfaces only when the pixels are read.
        raise BadRequest(f"the image could not be decoded: {exc}") from None
