"""Turn one decoded image into one model input item, as an `ImagePreprocess` spec describes.

Pure numpy + Pillow, so the HTTP frontend can preprocess without importing torch. The digits
example model is trained on images that went through this very function, so any change to
the arithmetic here changes what that model sees: rebuild it (bump its builder version).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from servewell.config.model import ImagePreprocess

#: ImageNet evaluation crops 224 out of 256: the crop keeps this fraction of the short side.
CENTER_CROP_FRACTION = 0.875
#: Border kept around the ink on each side, as a fraction of the ink's longer side.
INK_MARGIN_FRACTION = 0.05
#: Ink must stand this many grey levels (of 255) above the paper, else the image has no ink.
MIN_INK_CONTRAST = 32.0
#: Ink threshold, as a fraction of the way from the paper level to the ink level.
INK_THRESHOLD_FRACTION = 0.25
#: Ink is searched on a copy no longer than this: plenty for a bounding box, and cheap.
INK_ANALYSIS_MAX_SIDE = 512

#: Large images are inverted and cropped in bands of about this many pixels, so that the decoded
#: image is the only full-size copy (a 16-megapixel PNG peaked at +64 MB in its decode thread, now +21, of
#: which 16 are the decoded pixels).
_BAND_PIXELS = 262_144
_EXIF_ORIENTATION = 0x0112
#: Rows of the ink analysis image (at most 512 wide) processed at a time where a full-size temporary is not needed.
_ANALYSIS_ROWS = 64

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_HIGH_DEPTH_MODES = frozenset({"I", "F", "I;16", "I;16L", "I;16B", "I;16N"})


def transform_image(image: Image.Image, spec: ImagePreprocess, consume: bool = False) -> np.ndarray:
    """Preprocess one image into a float32 array of shape (C, H, W) or (H, W, C), per `spec.layout`.

    Steps: apply the EXIF orientation; convert to grayscale or RGB (transparent pixels are
    composited onto white, 16-bit and float images are rescaled to 0..255); invert if asked;
    fit to `spec.size` (stretch, ink_bbox or center_crop); multiply by `spec.scale`; then
    subtract `spec.mean` and divide by `spec.std` per channel when given.

    A JPEG that has not been loaded yet is decoded at a reduced scale when the target is much
    smaller (`Image.draft`), which mutates `image`. With `consume`, the caller gives `image` up:
    a large one is then inverted in place rather than copied (what bounds a 16-megapixel decode's
    memory to about the decoded image). Raises ValueError for an image mode that cannot be turned
    into grayscale or RGB, or for mean/std lengths that do not match.
    """
    height, width = spec.size
    draft(image, spec)
    given = image
    image = _to_mode(_upright(image), "L" if spec.channels == 1 else "RGB")
    if spec.invert:
        image = _invert(image, in_place=consume or image is not given)  # a converted copy is ours too
    if spec.fit == "stretch":
        # LANCZOS antialiases when shrinking (its support widens with the factor) and stays sharp
        # when enlarging; reducing_gap lets Pillow box-reduce large images first, for speed.
        image = image.resize((width, height), Image.Resampling.LANCZOS, reducing_gap=3.0)
    elif spec.fit == "center_crop":
        image = _center_crop(image, width, height)
    else:
        image = _ink_bbox(image, width, height)

    pixels = np.asarray(image, dtype=np.float32)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    pixels = pixels * np.float32(spec.scale)
    if spec.mean is not None:
        pixels = pixels - _per_channel(spec.mean, spec.channels, "mean")
    if spec.std is not None:
        pixels = pixels / _per_channel(spec.std, spec.channels, "std")
    if spec.layout == "CHW":
        pixels = pixels.transpose(2, 0, 1)
    return np.ascontiguousarray(pixels, dtype=np.float32)


def draft(image: Image.Image, spec: ImagePreprocess) -> None:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is far smaller (much faster).

    Call it before the pixels are loaded; afterwards `image.size` is the size that will be decoded
    (what the decode costs). Asks for a square so the guarantee survives an EXIF rotation. Other
    formats cannot decode at a reduced scale (PNG, GIF, ...), so only their pixel limits bound them;
    a second call changes nothing.
    """
    if image.format != "JPEG" or image.mode not in ("RGB", "L"):
        return
    target = max(spec.size)
    if spec.fit == "stretch":
        need = 2 * target
    elif spec.fit == "center_crop":
        need = math.ceil(target / CENTER_CROP_FRACTION)
    else:
        # The ink may fill only part of the picture; keep enough pixels to find and sample it.
        need = max(16 * target, 128)
    image.draft("L" if spec.channels == 1 else "RGB", (need, need))


def _upright(image: Image.Image) -> Image.Image:
    """`image` turned as its EXIF orientation says; `image` itself when it says nothing to turn
    (`ImageOps.exif_transpose` copies the whole image even then)."""
    if image.getexif().get(_EXIF_ORIENTATION, 1) in (1, None):
        return image
    return ImageOps.exif_transpose(image)


def _invert(image: Image.Image, in_place: bool) -> Image.Image:
    """The negative of `image`; a large one `in_place` is inverted band by band into itself."""
    if not in_place or image.width * image.height <= _BAND_PIXELS:
        return ImageOps.invert(image)
    rows = max(1, _BAND_PIXELS // image.width)
    for top in range(0, image.height, rows):
        box = (0, top, image.width, min(image.height, top + rows))
        image.paste(ImageOps.invert(image.crop(box)), box)
    return image


def _to_mode(image: Image.Image, mode: str) -> Image.Image:
    """Convert to "L" or "RGB" the way a person would look at the picture."""
    if image.mode == mode:
        return image
    if image.mode in ("P", "PA"):
        has_alpha = image.mode == "PA" or "transparency" in image.info
        image = image.convert("RGBA" if has_alpha else "RGB")
    if image.mode in _HIGH_DEPTH_MODES:
        image = _high_depth_to_l(image)
    if image.mode in _ALPHA_MODES:
        # Transparent regions of drawings and logos are meant to read as blank paper.
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return image.convert(mode)
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot convert an image of mode {image.mode!r} to {mode}") from exc


def _high_depth_to_l(image: Image.Image) -> Image.Image:
    """Map 16-bit, 32-bit integer and float images onto 0..255 grey levels."""
    values = np.asarray(image, dtype=np.float32)
    if image.mode == "F":
        # Float images conventionally hold 0..1; anything larger is taken as 0..255.
        if values.size and float(values.max()) <= 1.0:
            values = values * 255.0
    elif image.mode.startswith("I;16") or (values.size and float(values.max()) > 255.0):
        values = values / 257.0  # 65535 -> 255
    return Image.fromarray(np.clip(values + 0.5, 0, 255).astype(np.uint8), "L")


def _center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scale so the target covers CENTER_CROP_FRACTION of the image, then take the centre.

    Done as one resize of a source box, so no intermediate image is made.
    """
    src_w, src_h = image.size
    scale = max(width / src_w, height / src_h) / CENTER_CROP_FRACTION
    box_w, box_h = width / scale, height / scale
    left, top = (src_w - box_w) / 2, (src_h - box_h) / 2
    return image.resize(
        (width, height), Image.Resampling.LANCZOS, box=(left, top, left + box_w, top + box_h), reducing_gap=3.0
    )


@dataclass(frozen=True, slots=True)
class _Ink:
    """Where the ink is and how bright, after inversion, in full-image pixel coordinates."""

    box: tuple[float, float, float, float]  # left, top, right, bottom
    paper: tuple[float, float, float]  # paper level = p0 + p1 * x + p2 * y (a plane: uneven light)
    contrast: float  # ink level above the paper


def _ink_bbox(image: Image.Image, width: int, height: int) -> Image.Image:
    """Crop to the bright ink (after inversion), centre it with a small margin, and resize.

    The paper level is mapped to 0 and the ink level to 255, so grey or unevenly lit paper and
    grey pencil in a photo look like the clean scans a digit model is trained on. The resize
    uses BOX (area averaging): the UCI digits were made by counting ink pixels in blocks.
    """
    ink = _find_ink(image if image.mode == "L" else image.convert("L"))
    left, top, right, bottom = ink.box
    # Grow the box to the target's aspect ratio around the ink's centre, plus the margin.
    side = max((right - left) / width, (bottom - top) / height) * (1.0 + 2.0 * INK_MARGIN_FRACTION)
    crop_w, crop_h = max(1, round(side * width)), max(1, round(side * height))
    x0 = round((left + right - crop_w) / 2)
    y0 = round((top + bottom - crop_h) / 2)
    # A huge crop (a large PNG) is box-reduced first, so the float work below stays small.
    step = max(1, min(crop_w // (16 * width), crop_h // (16 * height)))
    cropped = crop_reduced(image, (x0, y0, crop_w, crop_h), step)
    pixels = np.asarray(cropped, dtype=np.float32)
    p0, px, py = ink.paper
    xs = x0 + (np.arange(cropped.width, dtype=np.float32) + 0.5) * step - 0.5
    ys = y0 + (np.arange(cropped.height, dtype=np.float32) + 0.5) * step - 0.5
    paper = p0 + px * xs[None, :] + py * ys[:, None]
    if pixels.ndim == 3:
        paper = paper[:, :, None]
    levels = np.clip((pixels - paper) * (255.0 / ink.contrast) + 0.5, 0, 255).astype(np.uint8)
    cropped = Image.fromarray(levels, image.mode)
    shrinking = cropped.width >= width and cropped.height >= height
    return cropped.resize((width, height), Image.Resampling.BOX if shrinking else Image.Resampling.BILINEAR)


def crop_reduced(image: Image.Image, box: tuple[int, int, int, int], step: int,
                 band_pixels: int = _BAND_PIXELS) -> Image.Image:
    """`image.crop((x, y, x + w, y + h)).reduce(step)`, pixel for pixel, without making the crop.

    A box far outside the picture is mostly 0 (what crop() fills in): a 1x13000 image grown to a
    square box would crop 169 megapixels (which Pillow refused as a "decompression bomb") to keep
    13,000 of them. Only the reduce blocks that overlap the picture are cropped and reduced; they
    start on block boundaries of the box and end on one or at the box's edge, so every block
    averages exactly the pixels it would have averaged in the full crop, and the rest is 0.
    """
    x0, y0, crop_w, crop_h = box
    out_w, out_h = -(-crop_w // step), -(-crop_h // step)
    ax, bx = _overlap_blocks(x0, crop_w, image.width, step)
    ay, by = _overlap_blocks(y0, crop_h, image.height, step)
    if bx <= ax or by <= ay:
        return Image.new(image.mode, (out_w, out_h), 0)
    if step == 1:
        part = image.crop((x0 + ax, y0 + ay, x0 + bx, y0 + by))
        if part.size == (out_w, out_h):
            return part
        canvas = Image.new(image.mode, (out_w, out_h), 0)
        canvas.paste(part, (ax, ay))
        return canvas
    # Reduced in bands of whole blocks (each block averages exactly what it would in one piece),
    # so no full-size crop is ever made.
    canvas = Image.new(image.mode, (out_w, out_h), 0)
    band = step * max(1, band_pixels // max(1, (bx - ax) * step))
    for top in range(ay, by, band):
        part = image.crop((x0 + ax, y0 + top, x0 + bx, y0 + min(by, top + band))).reduce(step)
        canvas.paste(part, (ax // step, top // step))
    return canvas


def _overlap_blocks(start: int, length: int, extent: int, step: int) -> tuple[int, int]:
    """[a, b) in box coordinates: the blocks of `step` pixels of a box at `start` that overlap
    0..extent, from a block boundary to a block boundary or to the box's end."""
    first = step * (max(0, -start) // step)
    last = step * -(-max(0, extent - start) // step)
    return min(first, length), min(last, length)


def _find_ink(gray: Image.Image) -> _Ink:
    """Locate the ink of an inverted grayscale image (ink bright, paper dark).

    The paper level is a plane fitted to the image border, so a photo lit from one side does
    not read as ink. The box is the whole image when no ink stands out clearly.
    """
    factor = max(1, math.ceil(max(gray.size) / INK_ANALYSIS_MAX_SIDE))
    small = gray.reduce(factor) if factor > 1 else gray
    a = np.asarray(small, dtype=np.float32)
    h, w = a.shape
    # Full-image coordinates of the centres of the analysis pixels.
    xs = (np.arange(w, dtype=np.float32) + 0.5) * factor - 0.5
    ys = (np.arange(h, dtype=np.float32) + 0.5) * factor - 0.5
    paper = _fit_paper(a, xs, ys)
    flat = a  # in place, and the plane a band of rows at a time: each full array is a megabyte here
    across = paper[0] + paper[1] * xs[None, :]
    for top in range(0, h, _ANALYSIS_ROWS):
        flat[top : top + _ANALYSIS_ROWS] -= across + paper[2] * ys[top : top + _ANALYSIS_ROWS, None]
    # The k-th brightest pixel, not the brightest: a speck of dust or a JPEG spike is not ink.
    contrast = _kth_largest_level(flat, k=max(8, flat.size // 2000))
    full = (0.0, 0.0, float(gray.width), float(gray.height))
    if contrast < MIN_INK_CONTRAST:
        return _Ink(full, paper, MIN_INK_CONTRAST)
    mask = flat > INK_THRESHOLD_FRACTION * contrast
    mask &= _neighbour_count(mask) >= 2  # drop isolated specks; any stroke has neighbours
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if rows.size == 0:
        return _Ink(full, paper, contrast)
    box = (
        float(cols[0] * factor),
        float(rows[0] * factor),
        float(min(gray.width, (cols[-1] + 1) * factor)),
        float(min(gray.height, (rows[-1] + 1) * factor)),
    )
    return _Ink(box, paper, contrast)


def _fit_paper(a: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> tuple[float, float, float]:
    """Fit paper level = p0 + p1 * x + p2 * y to the border pixels of `a`, ignoring ink on the border."""
    h, w = a.shape
    edge = max(1, min(h, w) // 20)
    strips = [(slice(0, edge), slice(None)), (slice(h - edge, h), slice(None))]
    if h > 2 * edge:
        strips += [(slice(edge, h - edge), slice(0, edge)), (slice(edge, h - edge), slice(w - edge, w))]
    values, px, py = [], [], []
    for rows, cols in strips:
        block = a[rows, cols]
        values.append(block.ravel())
        px.append(np.broadcast_to(xs[cols][None, :], block.shape).ravel())
        py.append(np.broadcast_to(ys[rows][:, None], block.shape).ravel())
    # A thousand points pin down three numbers; more only costs time on large photos.
    step = max(1, sum(v.size for v in values) // 1024)
    v = np.concatenate(values)[::step].astype(np.float64)
    scale = float(max(xs[-1], ys[-1], 1.0))  # keeps the least-squares problem well conditioned
    design = np.stack([np.ones_like(v), np.concatenate(px)[::step] / scale, np.concatenate(py)[::step] / scale], 1)
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    residual = v - design @ coef
    spread = 1.4826 * _median(np.abs(residual - _median(residual)))
    # Ink is brighter than paper after inversion: refit without points far above the fit.
    keep = residual <= max(3.0 * spread, 4.0)
    if not keep.all() and keep.sum() >= 3:
        coef, *_ = np.linalg.lstsq(design[keep], v[keep], rcond=None)
    return float(coef[0]), float(coef[1] / scale), float(coef[2] / scale)


def _median(values: np.ndarray) -> float:
    """Median (upper, for even counts) without np.median's overhead, which shows on small images."""
    middle = values.size // 2
    return float(np.partition(values, middle)[middle])


def _kth_largest_level(values: np.ndarray, k: int) -> float:
    """The k-th largest of `values` (grey levels in -255..255), to the nearest level.

    A histogram, because a full partition of a photo's pixels costs milliseconds.
    """
    counts = np.zeros(511, dtype=np.intp)
    for top in range(0, values.shape[0], _ANALYSIS_ROWS):  # in bands: bincount copies to 64-bit integers
        levels = np.clip(np.rint(values[top : top + _ANALYSIS_ROWS]), -255, 255).astype(np.intp).ravel() + 255
        counts += np.bincount(levels, minlength=511)
    from_top = np.cumsum(counts[::-1])
    index = int(np.searchsorted(from_top, min(k, values.size)))
    return float(255 - index)


def _neighbour_count(mask: np.ndarray) -> np.ndarray:
    """How many of each pixel's 8 neighbours are set."""
    padded = np.pad(mask, 1).astype(np.uint8)
    h, w = mask.shape
    total = np.zeros((h, w), dtype=np.uint8)
    for dy in range(3):
        for dx in range(3):
            if dy != 1 or dx != 1:
                total += padded[dy : dy + h, dx : dx + w]
    return total


def _per_channel(values: list[float], channels: int, what: str) -> np.ndarray:
    if len(values) not in (1, channels):
        raise ValueError(f"preprocess {what} has {len(values)} values; the image has {channels} channels")
    return np.asarray(values, dtype=np.float32).reshape(1, 1, -1)
