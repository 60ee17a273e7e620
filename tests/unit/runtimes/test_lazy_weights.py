"""Weights assigned on first use: exactly once, whichever layer of the submodule runs first."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from servewell.runtimes import ModelLoadError
from servewell.runtimes.lazy_weights import LazySubmoduleWeights, split_lazy


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 3)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        for block in self.blocks:  # the ModuleList itself is never called
            x = block(x)
        return x


class CountingPrepare:
    """Converts nothing, counts each tensor it is asked for, and yields the GIL while at it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(0.002)  # widens the window in which another thread reaches the hook
        return tensor


def meta_model_with_lazy_blocks() -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor], CountingPrepare]:
    torch.manual_seed(0)
    reference = Model().eval()
    with torch.device("meta"):
        model = Model().eval()
    eager, lazy = split_lazy(model, ["blocks"], reference.state_dict(), "model.safetensors")
    model.load_state_dict(eager, strict=False, assign=True)
    prepare = CountingPrepare()
    LazySubmoduleWeights(model.blocks, lazy["blocks"], prepare)
    return model, reference, lazy["blocks"], prepare


def test_weights_load_once_under_eight_concurrent_first_calls() -> None:
    model, reference, tensors, prepare = meta_model_with_lazy_blocks()
    assert model.get_parameter("blocks.0.weight").is_meta
    x = torch.randn(2, 3)
    start = threading.Barrier(8)
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def first_call() -> None:
        start.wait()
        try:
            with torch.inference_mode():
                results.append(model(x))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert prepare.calls == len(tensors) == 4  # two layers, weight and bias each: loaded once
    expected = reference(x)
    for result in results:
        assert torch.allclose(result, expected)
    assert not model.get_parameter("blocks.1.bias").is_meta


def test_lazy_weights_are_ordinary_tensors_usable_outside_inference_mode() -> None:
    model, reference, _, _ = meta_model_with_lazy_blocks()
    x = torch.randn(1, 3)
    with torch.inference_mode():
        model(x)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x))


def test_unknown_names_are_load_errors() -> None:
    # Nested and malformed names are refused when model.yaml loads (tests/unit/config).
    with torch.device("meta"):
        model = Model()
    state = Model().state_dict()
    with pytest.raises(ModelLoadError, match=r"\['head'\] are not submodules.*body, blocks"):
        split_lazy(model, ["head"], state, "w.safetensors")


def test_a_lazy_part_that_does_not_match_the_file_fails_at_load() -> None:
    with torch.device("meta"):
        model = Model()
    state = Model().state_dict()
    del state["blocks.1.bias"]
    state["blocks.0.weight"] = torch.zeros(2, 3)
    expected = r"lazy submodule 'blocks'.*missing from the file: 1\.bias.*wrong shapes: 0\.weight"
    with pytest.raises(ModelLoadError, match=expected):
        split_lazy(model, ["blocks"], state, "w.safetensors")
