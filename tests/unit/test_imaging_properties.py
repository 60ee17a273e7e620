"""Property tests of image decoding: arbitrary bytes give BadRequest / PayloadTooLarge or an array,
never another exception; the cropped reduction equals Pillow's crop-then-reduce pixel for pixel;
long thin images cost memory in proportion to their pixels."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

import fuzzing
from servewell.api.codecs.image import ImageLimits, image_to_array, open_image, plan_decode
from servewell.config.model import ImagePreprocess
from servewell.errors import BadRequest, PayloadTooLarge
from servewell.imaging import crop_reduced

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the corrupt files we feed it

DIGITS = ImagePreprocess(size=(8, 8), channels=1, invert=True, fit="ink_bbox", scale=16 / 255, layout="CHW")
SPECS = [
    DIGITS,
    ImagePreprocess(size=(16, 12), channels=3, fit="stretch", scale=1 / 255),
    ImagePreprocess(size=(12, 12), channels=3, fit="center_crop", scale=1 / 255, mean=[0.5], std=[0.25], layout="HWC"),
]
LIMITS = ImageLimits(max_pixels=1_000_000, max_side=4096)


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


SEEDS = [encode(Image.new("L", (9, 7), 200), "PNG"), encode(Image.new("RGB", (9, 7), (1, 2, 3)), "JPEG"),
         encode(Image.new("P", (5, 5)), "GIF"), encode(Image.new("RGB", (4, 3)), "BMP"),
         encode(Image.new("RGBA", (6, 4)), "WEBP"), encode(Image.new("I;16", (5, 5)), "TIFF")]


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """A real image with some bytes replaced, cut short, or extended: past the format checks, into
    the decoders."""
    return st.tuples(st.lists(st.tuples(st.integers(0, len(seed) - 1), st.integers(0, 255)), max_size=8),
                     st.integers(8, len(seed) + 16), st.binary(max_size=16)).map(
        lambda t: bytes(_patch(seed, t[0]))[: t[1]] + t[2])


def _patch(seed: bytes, changes: list[tuple[int, int]]) -> bytearray:
    data = bytearray(seed)
    for at, value in changes:
        data[at] = value
    return data


def decodes_or_refuses(data: bytes, spec: ImagePreprocess) -> None:
    try:
        out = image_to_array(data, spec, LIMITS)
    except (BadRequest, PayloadTooLarge):
        return
    assert out.dtype == np.float32 and out.size == spec.channels * spec.size[0] * spec.size[1]


@given(st.binary(max_size=300), st.sampled_from(SPECS))
def test_arbitrary_bytes_decode_or_are_refused(data, spec):
    decodes_or_refuses(data, spec)


@given(st.sampled_from(SEEDS).flatmap(mutated), st.sampled_from(SPECS))
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
def test_corrupted_images_decode_or_are_refused(data, spec):
    decodes_or_refuses(data, spec)


@given(st.integers(1, 40), st.integers(1, 40), st.integers(-60, 60), st.integers(-60, 60), st.integers(1, 90),
       st.integers(1, 90), st.integers(1, 9), st.sampled_from(["L", "RGB"]), st.integers(1, 2000))
@example(1, 40, -20, 0, 40, 40, 5, "L", 2000)
@example(40, 40, -3, -7, 90, 90, 4, "L", 1)  # one row of blocks per band
def test_crop_reduced_equals_crop_then_reduce(w, h, x0, y0, cw, ch, step, mode, band_pixels):
    rng = np.random.default_rng(w * 1000 + h)
    shape = (h, w) if mode == "L" else (h, w, 3)
    image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)
    expected = image.crop((x0, y0, x0 + cw, y0 + ch))
    if step > 1:
        expected = expected.reduce(step)
    got = crop_reduced(image, (x0, y0, cw, ch), step, band_pixels=band_pixels)
    assert got.size == expected.size and got.mode == expected.mode
    assert np.array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("size", [(1, 13000), (13000, 1), (1, 12000), (3, 16000)])
def test_long_thin_images_are_decoded_with_memory_in_proportion_to_their_pixels(size):
    data = encode(Image.new("L", size, 255), "PNG")
    tracemalloc.start()
    try:
        out = image_to_array(data, DIGITS, ImageLimits(16_000_000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (1, 8, 8)
    assert peak < 8_000_000  # the square crop of a 1x13000 image was 169 MB (and refused as a bomb)


def test_a_side_over_the_limit_is_refused_from_the_header():
    data = encode(Image.new("L", (1, 5000), 255), "PNG")
    with pytest.raises(PayloadTooLarge, match="side"):
        open_image(data, ImageLimits(max_pixels=16_000_000, max_side=4096))


def test_a_jpeg_is_planned_at_its_reduced_decode_size():
    data = encode(Image.new("L", (4000, 4000), 255), "JPEG")
    planned = plan_decode(data, DIGITS, ImageLimits(16_000_000))
    assert planned.pixels <= 500 * 500  # libjpeg decodes at 1/8 scale: 250,000 pixels, not 16 million
    png = plan_decode(encode(Image.new("L", (2000, 2000), 255), "PNG"), DIGITS, ImageLimits(16_000_000))
    assert png.pixels == 4_000_000  # PNG cannot draft: its full size is its cost


assert fuzzing.PROPERTY_EXAMPLES > 0
