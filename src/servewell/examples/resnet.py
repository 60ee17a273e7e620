"""ResNet-50 without torchvision, and the `resnet50` example model (random weights, for load tests).

The module layout and parameter names follow torchvision's `resnet50`, so one of its state
dicts loads with `load_state_dict`. Only the architecture ships: weights are seeded random,
because nothing can be downloaded at build time.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from servewell.config.model import ModelConfig
from servewell.examples.artifacts import ProgressFn

#: ImageNet channel statistics, on the 0..1 scale.
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
#: Runtimes the builder can produce, and the artifact each writes.
ARTIFACTS: dict[str, str] = {"onnx": "model.onnx", "torchscript": "model.pt", "pytorch": "model.safetensors"}
SEED = 0



class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's "ResNet v1.5"), 1x1 expand, plus the shortcut."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One residual block."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A bottleneck ResNet: (N, 3, H, W) images normalised with ImageNet statistics -> (N, classes) logits."""

    def __init__(self, layers: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        # torchvision's initialisation, so random weights give activations of a sane scale.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of normalised images."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (bottleneck blocks [3, 4, 6, 3]) with default random initialisation, in train mode.

    Build on the meta device (`with torch.device("meta"):`) to inspect it without allocating.
    """
    return ResNet((3, 4, 6, 3), num_classes=num_classes)


def build_resnet50(model_dir: Path, progress: ProgressFn, runtime: str = "onnx") -> ModelConfig:
    """Write a seeded random ResNet-50 for `runtime` (onnx, torchscript or pytorch) and its `model.yaml`.

    For load testing only: the weights are NOT trained, so its predictions mean nothing.
    """
    from servewell.examples.artifacts import export_onnx, write_model_yaml

    if runtime not in ARTIFACTS:
        raise ValueError(f"resnet50 builds for {', '.join(ARTIFACTS)}, not {runtime!r}")
    artifact = model_dir / ARTIFACTS[runtime]
    with torch.random.fork_rng(devices=[]):  # seed without disturbing the caller's generator
        torch.manual_seed(SEED)
        model = resnet50().eval()
    progress(f"writing {artifact.name} ({runtime})")
    if runtime == "onnx":
        export_onnx(model, (3, 224, 224), artifact)
    elif runtime == "torchscript":
        with torch.no_grad(), warnings.catch_warnings():
            # TorchScript is deprecated upstream but is a runtime servewell serves, so build it.
            warnings.simplefilter("ignore", DeprecationWarning)
            traced = torch.jit.trace(model, torch.zeros(1, 3, 224, 224))
            torch.jit.save(traced, str(artifact))
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(artifact))
    progress(f"wrote {artifact.name} ({artifact.stat().st_size / 1e6:.0f} MB)")
    return write_model_yaml(model_dir, resnet50_config_dict(runtime))


def resnet50_config_dict(runtime: str) -> dict[str, object]:
    """The `model.yaml` contents of the resnet50 example for `runtime`, as plain data."""
    config: dict[str, object] = {
        "name": "resnet50",
        "runtime": runtime,
        "artifact": ARTIFACTS[runtime],
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 224, 224]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [1000]}],
        "max_batch_size": 32,
        "preprocess": {
            "size": [224, 224],
            "channels": 3,
            "fit": "center_crop",
            "scale": 1.0 / 255.0,
            "mean": IMAGENET_MEAN,
            "std": IMAGENET_STD,
            "layout": "CHW",
        },
        "postprocess": {"top_k": 5},
        "metadata": {
            "description": "ResNet-50 architecture (torchvision layout), 1000 classes.",
            "weights": "random, seeded (seed 0); NOT trained — for load testing only",
        },
    }
    if runtime == "pytorch":
        config["pytorch"] = {"factory": "servewell.examples.resnet:resnet50", "factory_kwargs": {"num_classes": 1000}}
    return config
