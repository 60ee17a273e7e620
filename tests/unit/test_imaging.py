"""transform_image: shapes, value ranges, colour modes and the ink_bbox fit."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw

from servewell.config.model import ImagePreprocess
from servewell.imaging import transform_image

DIGITS = ImagePreprocess(size=(8, 8), channels=1, invert=True, fit="ink_bbox", scale=16 / 255, layout="CHW")


def ink_sheet(size: tuple[int, int], box: tuple[int, int, int, int], paper: int = 255, ink: int = 0) -> Image.Image:
    """A sheet of paper with one dark "digit": a thick ring inside `box`."""
    image = Image.new("L", size, paper)
    ImageDraw.Draw(image).ellipse(box, outline=ink, width=max(2, (box[2] - box[0]) // 6))
    return image


def encoded(image: Image.Image, fmt: str, **options: object) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return Image.open(io.BytesIO(buffer.getvalue()))


def test_stretch_grayscale_gives_chw_float32_in_scaled_range() -> None:
    spec = ImagePreprocess(size=(8, 6), channels=1, fit="stretch", scale=1 / 255)
    gradient = Image.fromarray(np.tile(np.arange(0, 256, dtype=np.uint8), (40, 1)), "L")
    out = transform_image(gradient, spec)
    assert out.shape == (1, 8, 6)
    assert out.dtype == np.float32
    assert 0.0 <= out.min() and out.max() <= 1.0
    assert out[0, 0, 0] < out[0, 0, -1]  # left-to-right gradient survives


def test_rgb_hwc_and_chw_hold_the_same_values() -> None:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8), "RGB")
    hwc = transform_image(image, ImagePreprocess(size=(16, 16), channels=3, layout="HWC"))
    chw = transform_image(image, ImagePreprocess(size=(16, 16), channels=3, layout="CHW"))
    assert hwc.shape == (16, 16, 3) and chw.shape == (3, 16, 16)
    np.testing.assert_array_equal(chw, hwc.transpose(2, 0, 1))
    assert chw.flags["C_CONTIGUOUS"]


def test_mean_and_std_apply_per_channel() -> None:
    image = Image.new("RGB", (30, 30), (255, 0, 51))
    spec = ImagePreprocess(size=(4, 4), channels=3, mean=[0.5, 0.0, 0.1], std=[0.5, 1.0, 0.1])
    out = transform_image(image, spec)
    np.testing.assert_allclose(out[:, 0, 0], [1.0, 0.0, 1.0], atol=1e-5)


def test_mean_of_the_wrong_length_is_refused() -> None:
    # Refused when the config loads (tests/unit/config), so no request ever meets it.
    with pytest.raises(ValueError, match="mean"):
        ImagePreprocess(size=(4, 4), channels=3, mean=[0.5, 0.5])


def test_invert_turns_white_paper_into_zero() -> None:
    spec = ImagePreprocess(size=(4, 4), channels=1, invert=True, scale=1.0)
    assert transform_image(Image.new("L", (10, 10), 255), spec).max() == 0.0
    assert transform_image(Image.new("L", (10, 10), 0), spec).min() == 255.0


def test_center_crop_keeps_the_middle_of_a_wide_image() -> None:
    image = Image.new("L", (300, 100), 0)
    image.paste(255, (100, 0, 200, 100))  # white middle third
    out = transform_image(image, ImagePreprocess(size=(20, 20), channels=1, fit="center_crop", scale=1.0))
    assert out.shape == (1, 20, 20)
    assert out.min() > 250  # only the white middle is left


def test_ink_bbox_centres_an_off_centre_digit() -> None:
    centred = transform_image(ink_sheet((64, 64), (16, 12, 48, 52)), DIGITS)
    corner = transform_image(ink_sheet((400, 300), (20, 30, 84, 110)), DIGITS)
    assert centred.shape == corner.shape == (1, 8, 8)
    for out in (centred, corner):
        ys, xs = np.nonzero(out[0] > 1.0)
        assert abs(ys.mean() - 3.5) < 0.6 and abs(xs.mean() - 3.5) < 0.6
        assert out.max() > 12.0  # full ink strength is close to 16
    assert np.abs(centred - corner).mean() < 1.5


def test_ink_bbox_ignores_grey_unevenly_lit_paper_and_noise() -> None:
    clean = transform_image(ink_sheet((200, 150), (60, 30, 130, 120)), DIGITS)
    rng = np.random.default_rng(1)
    sheet = np.asarray(ink_sheet((200, 150), (60, 30, 130, 120), paper=190, ink=60), dtype=np.float32)
    photo = sheet + np.linspace(-25, 25, 200)[None, :] + rng.normal(0, 4, sheet.shape)
    noisy = encoded(Image.fromarray(np.clip(photo, 0, 255).astype(np.uint8)), "JPEG", quality=75)
    out = transform_image(noisy, DIGITS)
    assert out[0, :, 0].max() < 2.0 and out[0, :, -1].max() < 2.0  # margins stay blank
    assert np.abs(out - clean).mean() < 1.5


def test_ink_bbox_of_blank_paper_is_all_zero() -> None:
    assert transform_image(Image.new("L", (50, 40), 240), DIGITS).max() == 0.0


def test_transparent_pixels_count_as_white_paper() -> None:
    rgba = Image.new("RGBA", (64, 64), (0, 0, 0, 0))  # transparent black
    ImageDraw.Draw(rgba).ellipse((16, 12, 48, 52), outline=(0, 0, 0, 255), width=5)
    on_white = transform_image(ink_sheet((64, 64), (16, 12, 48, 52)), DIGITS)
    np.testing.assert_allclose(transform_image(rgba, DIGITS), on_white, atol=1.0)
    assert transform_image(rgba.convert("LA"), DIGITS).shape == (1, 8, 8)


def test_palette_image_with_transparency() -> None:
    # Index 0 is transparent black: it must read as white paper, not as black (which would be all ink).
    ring = np.asarray(ink_sheet((64, 64), (16, 12, 48, 52))) == 0
    indexed = Image.fromarray(ring.astype(np.uint8), "P")
    indexed.putpalette([0, 0, 0, 10, 10, 40])
    indexed.info["transparency"] = 0
    out = transform_image(encoded(indexed, "PNG"), DIGITS)
    np.testing.assert_allclose(out, transform_image(ink_sheet((64, 64), (16, 12, 48, 52)), DIGITS), atol=1.0)


def test_sixteen_bit_grayscale_matches_eight_bit() -> None:
    sheet = ink_sheet((64, 64), (16, 12, 48, 52))
    wide = Image.fromarray(np.asarray(sheet, dtype=np.uint16) * 257)
    assert wide.mode.startswith("I")
    np.testing.assert_allclose(transform_image(wide, DIGITS), transform_image(sheet, DIGITS), atol=0.2)


def test_exif_orientation_is_applied() -> None:
    sheet = ink_sheet((120, 80), (10, 10, 50, 70)).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: viewers turn it 90 degrees clockwise
    tagged = encoded(sheet, "JPEG", quality=95, exif=exif)
    upright = encoded(sheet.transpose(Image.Transpose.ROTATE_270), "JPEG", quality=95)
    spec = ImagePreprocess(size=(12, 8), channels=1, fit="stretch")
    np.testing.assert_allclose(transform_image(tagged, spec), transform_image(upright, spec), atol=0.05)


def test_photo_sized_jpeg_is_decoded_at_a_reduced_scale_and_matches_the_lossless_result() -> None:
    """Draft decoding (libjpeg at 1/2, 1/4 or 1/8 scale) is what keeps a photo cheap for an 8x8
    model; `bench` measures the time, this checks that it happens and changes nothing that matters."""
    sheet = ink_sheet((640, 480), (250, 140, 390, 340), paper=215, ink=40).convert("RGB")
    data = io.BytesIO()
    sheet.save(data, "JPEG", quality=90)
    reference = transform_image(sheet, DIGITS)
    photo = Image.open(io.BytesIO(data.getvalue()))
    out = transform_image(photo, DIGITS)
    assert photo.size[0] <= 640 // 2 and photo.size[1] <= 480 // 2  # decoded at half the size or less
    assert out.shape == (1, 8, 8)
    assert np.abs(out - reference).mean() < 1.0


@pytest.mark.parametrize("spec", [DIGITS, ImagePreprocess(size=(28, 28), channels=1, invert=True, fit="stretch")])
def test_a_consumed_large_image_gives_the_same_input_as_a_kept_one(spec: ImagePreprocess) -> None:
    # Above a quarter of a megapixel a consumed image is inverted in place and cropped in bands.
    sheet = ink_sheet((1600, 1100), (300, 200, 1100, 1000), paper=230, ink=20)
    kept = transform_image(encoded(sheet, "PNG"), spec)
    consumed = transform_image(encoded(sheet, "PNG"), spec, consume=True)
    assert np.array_equal(kept, consumed)
    assert np.array_equal(kept, transform_image(sheet.copy(), spec, consume=True))
