"""Builds the benchmark's model repository, images and request bodies (imports torch: run it as a process).

    python -m bench.models --work bench/results/work

Writes, under the work directory:

* `build/mlp/`: a tiny MLP (512 -> 2048 -> ReLU -> 512, seeded) exported to ONNX, `model.yaml`.
* `build/resnet50/`: ResNet-50 from `python -m servewell.examples.build resnet50 --runtime onnx`.
* `images/*.jpg`: seeded synthetic 640x480 photo-like JPEGs (gradients, shapes, noise; quality 90).
* `mlp_input_*.npy`: seeded MLP input rows, from which the OIP bodies are made.

Builds are cached by `BUILD_VERSION`; `bench.run` then writes the served repository from them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

#: Bump when anything built here changes, so cached builds are rebuilt.
BUILD_VERSION = "1"
MLP_IN, MLP_HIDDEN, MLP_OUT = 512, 2048, 512
IMAGE_SIZE = (640, 480)  # width, height
IMAGE_COUNT = 8
MLP_BODY_COUNT = 4
SEED = 20240611


def build_mlp(out_dir: Path) -> None:
    """Export the seeded MLP to `out_dir/mlp.onnx` and write its `model.yaml` (onnx, max batch 32, 1 thread)."""
    import torch

    from bench.workspace import write_model_yaml

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(MLP_IN, MLP_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(MLP_HIDDEN, MLP_OUT)
    ).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    example = torch.zeros((2, MLP_IN), dtype=torch.float32)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            model, (example,), str(out_dir / "mlp.onnx"), dynamo=False,
            input_names=["input"], output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, opset_version=17,
        )
    write_model_yaml(out_dir, {
        "name": "mlp",
        "runtime": "onnx",
        "artifact": "mlp.onnx",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [MLP_IN]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [MLP_OUT]}],
        "max_batch_size": 32,
        "threads": 1,
        "instances": 1,
    })


def build_resnet50(build_root: Path) -> None:
    """ResNet-50 (random seeded weights, ONNX) from servewell's example builder, into `build_root/resnet50`."""
    command = [sys.executable, "-m", "servewell.examples.build", "resnet50", "--out", str(build_root),
               "--runtime", "onnx"]
    done = subprocess.run(command, check=False)
    if done.returncode != 0 or not (build_root / "resnet50" / "model.yaml").is_file():
        raise SystemExit(f"building resnet50 failed (exit code {done.returncode}): {' '.join(command)}")


def synthetic_photo(rng: np.random.Generator) -> Image.Image:
    """A 640x480 RGB picture with photo-like statistics: smooth light, shapes, blur and sensor noise."""
    width, height = IMAGE_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = []
    for _ in range(3):
        a, b, c = rng.uniform(-0.4, 0.4, size=3)
        base = 128 + 90 * (a * x / width + b * y / height) + 40 * np.sin(c * 8 * x / width + rng.uniform(0, 6))
        channels.append(base)
    image = Image.fromarray(np.clip(np.stack(channels, axis=2), 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(6, 14))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(20, 260)), y0 + int(rng.integers(20, 200))
        colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(radius=1.5))
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, 6, size=(height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def build_images(out_dir: Path) -> list[Path]:
    """The seeded JPEGs (quality 90)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    paths = []
    for i in range(IMAGE_COUNT):
        path = out_dir / f"photo_{i}.jpg"
        synthetic_photo(rng).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


def build_mlp_inputs(out_dir: Path) -> None:
    """Seeded input rows for the MLP bodies."""
    rng = np.random.default_rng(SEED + 1)
    for i in range(MLP_BODY_COUNT):
        np.save(out_dir / f"mlp_input_{i}.npy", rng.standard_normal(MLP_IN).astype(np.float32))


def build_all(work: Path, with_resnet: bool = True) -> dict:
    """Build whatever is missing or stale under `work`; returns what exists."""
    stamp = work / "build" / "VERSION"
    build = work / "build"
    fresh = stamp.is_file() and stamp.read_text().strip() == BUILD_VERSION
    if not fresh:
        for stale in (build / "mlp" / "model.yaml", build / "resnet50" / "model.yaml"):
            stale.unlink(missing_ok=True)
    build.mkdir(parents=True, exist_ok=True)
    if not (build / "mlp" / "model.yaml").is_file():
        build_mlp(build / "mlp")
    if with_resnet and not (build / "resnet50" / "model.yaml").is_file():
        build_resnet50(build)
    if not fresh or not (work / "images").is_dir():
        build_images(work / "images")
        build_mlp_inputs(work)
    stamp.write_text(BUILD_VERSION + "\n")
    return {
        "mlp": (build / "mlp" / "model.yaml").is_file(),
        "resnet50": (build / "resnet50" / "model.yaml").is_file(),
        "images": sorted(str(p) for p in (work / "images").glob("*.jpg")),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--skip-resnet", action="store_true", help="build only the MLP, images and inputs")
    args = parser.parse_args(argv)
    print(json.dumps(build_all(args.work, with_resnet=not args.skip_resnet)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
