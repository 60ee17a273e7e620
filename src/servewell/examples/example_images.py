"""The example images shipped in `servewell/examples/images/` for the README, the docs and the tests.

Each is a digit from the TEST split of the digits model (never seen in training), rendered as
dark ink on light paper. They vary format, size and framing the way user uploads do.
Regenerate with `python -m servewell.examples.example_images [OUT_DIR]`; output is deterministic.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from servewell.examples.digits import load_split, render_digit

#: Where the shipped example images live (package data).
EXAMPLE_IMAGES_DIR = Path(__file__).resolve().parent / "images"


@dataclass(frozen=True, slots=True)
class ExampleImage:
    """One example image: which test sample, how it is framed, and the file it goes to."""

    filename: str
    test_index: int  # index into x_test of `load_split()`
    size: int  # side of the rendered digit in pixels
    #: plain: the `render_digit` square; scan: the digit off-centre on a larger grey sheet.
    framing: Literal["plain", "scan"] = "plain"
    noise: float = 0.0  # scan only: standard deviation of sensor noise, in grey levels

    @property
    def label(self) -> str:
        """The digit shown, as its filename says (`digit-<label>-...`)."""
        return label_from_filename(self.filename)


#: The shipped set. The indices were picked as samples the model classifies confidently.
EXAMPLES: tuple[ExampleImage, ...] = (
    ExampleImage("digit-0-64px.png", 53, 64),
    ExampleImage("digit-3-200px.jpg", 63, 200),
    ExampleImage("digit-4-128px.png", 2, 128),
    ExampleImage("digit-7-scan.jpg", 9, 120, "scan", noise=2.0),
    ExampleImage("digit-8-96px.jpg", 15, 96),
    ExampleImage("digit-9-scan.png", 10, 90, "scan"),
)


def label_from_filename(filename: str) -> str:
    """The label encoded in an example image's name: "digit-7-scan.jpg" -> "7"."""
    return Path(filename).name.split("-")[1]


def render_example(example: ExampleImage, x_test: np.ndarray) -> Image.Image:
    """Draw one example image from its test sample."""
    digit = render_digit(x_test[example.test_index], size=example.size)
    if example.framing == "plain":
        return digit
    # A scan: off-white sheet lit a little unevenly, wider than tall, the digit left of centre.
    rng = np.random.default_rng(example.test_index)
    width, height = round(example.size * 2.6), round(example.size * 1.8)
    paper = 232.0
    sheet = np.full((height, width), paper, dtype=np.float32) + np.linspace(-12.0, 12.0, width)[None, :]
    ink = 1.0 - np.asarray(digit, dtype=np.float32) / 255.0
    top, left = round(height * 0.3), round(width * 0.18)
    region = sheet[top : top + example.size, left : left + example.size]
    region -= ink * (paper - 30.0)
    if example.noise > 0:
        sheet += rng.normal(0.0, example.noise, size=sheet.shape)
    return Image.fromarray(np.clip(sheet + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")


def write_example_images(out_dir: Path) -> list[Path]:
    """Write every image of `EXAMPLES` into `out_dir` (created if missing); returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, x_test, _, y_test = load_split()
    written = []
    for example in EXAMPLES:
        if str(y_test[example.test_index]) != example.label:
            raise ValueError(f"{example.filename}: test sample {example.test_index} is a {y_test[example.test_index]}")
        path = out_dir / example.filename
        image = render_example(example, x_test)
        if path.suffix == ".jpg":
            image.save(path, "JPEG", quality=85, optimize=True)
        else:
            image.save(path, "PNG", optimize=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """Write the examples into the directory given (default: the package's images folder)."""
    args = sys.argv[1:] if argv is None else argv
    for path in write_example_images(Path(args[0]) if args else EXAMPLE_IMAGES_DIR):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
