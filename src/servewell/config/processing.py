"""Image preprocessing and label postprocessing of model.yaml (`preprocess`, `postprocess`).

Each section checks here what it can alone; how it fits the model's inputs and outputs is
checked by `ModelConfig`, so a mismatch is a load-time error, never a per-request one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from servewell.config.problems import Problems
from servewell.config.strict import StrictModel

PositiveInt = Annotated[int, Field(gt=0)]


class ImagePreprocess(StrictModel):
    """How `/predict` (and BYTES inputs of the OIP API) turn an encoded image into the input tensor."""

    input: str | None = Field(None, description="Input tensor fed by the image; default: the model's only input.")
    size: tuple[PositiveInt, PositiveInt] = Field(description="Target height and width in pixels.")
    channels: Literal[1, 3] = Field(3, description="1 for grayscale, 3 for RGB.")
    invert: bool = Field(False, description="Invert intensities (dark ink on paper becomes bright strokes).")
    fit: Literal["stretch", "ink_bbox", "center_crop"] = Field(
        "stretch",
        description="stretch: resize the whole image; ink_bbox: crop to the ink and centre it; "
        "center_crop: resize the short side then crop the centre.",
    )
    scale: float = Field(1.0 / 255.0, description="Multiplier applied to 0..255 pixel values.")
    mean: list[float] | None = Field(
        None, description="Per-channel mean subtracted after scaling: one value per channel, or one for all."
    )
    std: list[float] | None = Field(
        None, description="Per-channel standard deviation divided after the mean: one value per channel, or one "
        "for all; none may be 0.",
    )
    layout: Literal["CHW", "HWC"] = Field("CHW", description="Memory layout of one image in the input tensor.")

    @model_validator(mode="after")
    def _per_channel_values_fit(self) -> ImagePreprocess:
        problems = Problems("ImagePreprocess")
        for name, values in (("mean", self.mean), ("std", self.std)):
            # One value broadcasts to every channel; image decoding accepts exactly these lengths.
            if values is not None and len(values) not in (1, self.channels):
                problems.add((name,), f"has {len(values)} values; channels is {self.channels}, so give "
                             f"{self.channels} (one per channel) or 1 (the same for every channel)", values)
        if self.std is not None and any(value == 0 for value in self.std):
            problems.add(("std",), "0 would divide by zero", self.std)
        problems.raise_if_any()
        return self

    @property
    def tensor_shape(self) -> list[int]:
        """Shape of one preprocessed image: [C, H, W] or [H, W, C] as `layout` says."""
        height, width = self.size
        return [self.channels, height, width] if self.layout == "CHW" else [height, width, self.channels]


class ClassifyPostprocess(StrictModel):
    """How `/predict` turns an output tensor into a label."""

    output: str | None = Field(None, description="Output tensor holding scores; default: the model's first output.")
    labels: list[str] | None = Field(
        None, min_length=1, description="Class names by index, one per score; default: the index as a string."
    )
    top_k: int = Field(3, ge=1, description="How many of the best classes to return.")
    apply_softmax: bool = Field(True, description="Turn logits into probabilities before ranking.")
