"""Training of the digits CNN: seeded paper-like renderings, a small network, a fixed schedule.

Every random choice comes from a seeded generator and torch runs single-threaded with
deterministic algorithms during training, so a rebuild gives the same model.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter
from torch import nn

from servewell.examples.artifacts import ProgressFn
from servewell.examples.digits import DIGITS_PREPROCESS, render_digit
from servewell.imaging import transform_image

SEED = 0
#: Extra varied renderings of each training sample, on top of the plain `render_digit` one.
VARIANTS_PER_SAMPLE = 2
EPOCHS = 6
BATCH_SIZE = 64


class DigitsNet(nn.Module):
    """Three 3x3 convolutions and two linear layers: (N, 1, 8, 8) -> (N, 10) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 4x4 -> 2x2
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(64 * 2 * 2, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of preprocessed digits."""
        return self.classifier(self.features(x))


def preprocess(image: Image.Image) -> np.ndarray:
    """The (1, 8, 8) float32 item the server would make of `image`."""
    return transform_image(image, DIGITS_PREPROCESS)


def render_varied(x8x8: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A paper rendering of one sample with seeded variations that photos and scans show.

    Varies canvas size, digit size, aspect, position and slant, paper and ink grey levels,
    uneven light, sensor noise and JPEG compression.
    """
    canvas = int(rng.integers(24, 73))
    fill = rng.uniform(0.45, 0.9)
    ink_h = max(8, round(canvas * fill))
    ink_w = max(8, round(ink_h * rng.uniform(0.85, 1.15)))
    grid = np.clip(np.asarray(x8x8, dtype=np.float32) * (255.0 / 16.0) + 0.5, 0, 255).astype(np.uint8)
    ink = Image.fromarray(grid, "L").resize((ink_w, ink_h), Image.Resampling.BICUBIC)
    ink = ink.rotate(rng.uniform(-12.0, 12.0), Image.Resampling.BILINEAR, expand=True, fillcolor=0)
    if rng.random() < 0.2:
        ink = ink.filter(ImageFilter.MaxFilter(3))  # a thicker pen
    layer = Image.new("L", (max(canvas, ink.width), max(canvas, ink.height)), 0)
    slack_x, slack_y = layer.width - ink.width, layer.height - ink.height
    layer.paste(ink, (int(rng.integers(0, slack_x + 1)), int(rng.integers(0, slack_y + 1))))

    coverage = np.asarray(layer, dtype=np.float32) / 255.0
    paper = rng.uniform(150.0, 255.0)
    ink_level = rng.uniform(0.0, min(90.0, paper - 80.0))
    h, w = coverage.shape
    light = rng.uniform(-20.0, 20.0) * np.linspace(-0.5, 0.5, w)[None, :] + rng.uniform(-20.0, 20.0) * np.linspace(
        -0.5, 0.5, h
    )[:, None]
    pixels = paper + light - coverage * (paper - ink_level)
    pixels = pixels + rng.normal(0.0, rng.uniform(0.0, 6.0), size=pixels.shape)
    image = Image.fromarray(np.clip(pixels + 0.5, 0, 255).astype(np.uint8), "L")
    if rng.random() < 0.3:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=int(rng.integers(50, 96)))
        image = Image.open(io.BytesIO(buffer.getvalue()))
    return image


def training_set(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Preprocessed items for every sample: its plain rendering plus `VARIANTS_PER_SAMPLE` varied ones."""
    items, labels = [], []
    for grid, label in zip(x, y, strict=True):
        items.append(preprocess(render_digit(grid)))
        items.extend(preprocess(render_varied(grid, rng)) for _ in range(VARIANTS_PER_SAMPLE))
        labels.extend([int(label)] * (1 + VARIANTS_PER_SAMPLE))
    return np.stack(items), np.asarray(labels, dtype=np.int64)


@contextmanager
def deterministic_torch(seed: int = SEED) -> Iterator[None]:
    """Seed torch, run single-threaded with deterministic kernels, and restore the settings after."""
    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def train_digits(x_train: np.ndarray, y_train: np.ndarray, progress: ProgressFn) -> DigitsNet:
    """Train a `DigitsNet` on rendered and preprocessed training samples; returns it in eval mode."""
    rng = np.random.default_rng(SEED)
    progress(f"rendering {len(x_train) * (1 + VARIANTS_PER_SAMPLE)} training images")
    items, labels = training_set(x_train, y_train, rng)
    with deterministic_torch():
        model = DigitsNet()
        inputs, targets = torch.from_numpy(items), torch.from_numpy(labels)
        steps_per_epoch = (len(inputs) + BATCH_SIZE - 1) // BATCH_SIZE
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=3e-3, total_steps=EPOCHS * steps_per_epoch, pct_start=0.2
        )
        loss_fn = nn.CrossEntropyLoss(label_smoothing=0.05)
        generator = torch.Generator().manual_seed(SEED)
        for epoch in range(1, EPOCHS + 1):
            model.train()
            order = torch.randperm(len(inputs), generator=generator)
            total = 0.0
            for start in range(0, len(inputs), BATCH_SIZE):
                batch = order[start : start + BATCH_SIZE]
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(inputs[batch]), targets[batch])
                loss.backward()
                optimizer.step()
                schedule.step()
                total += loss.item() * len(batch)
            progress(f"training epoch {epoch}/{EPOCHS} (loss {total / len(inputs):.3f})")
    return model.eval()


def evaluate_onnx(path: Path, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """Accuracy of the exported model on test samples rendered with `render_digit` and preprocessed."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    items = np.stack([preprocess(render_digit(grid)) for grid in x_test])
    (logits,) = session.run(["logits"], {"input": items})
    return float((logits.argmax(axis=1) == y_test).mean())
