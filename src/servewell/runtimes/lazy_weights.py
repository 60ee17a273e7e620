"""Submodules whose weights stay on the meta device until their first forward call.

For parts of a model that many requests never reach (a rarely used head, a second decoder),
`pytorch.lazy_submodules` in model.yaml keeps their weights in the memory-mapped file until a forward
call needs them. Warm-up runs the whole model, so it loads them too; set `warmup: false` for a
model whose lazy parts should wait for the first real request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from servewell.runtimes.base import ModelLoadError

StateDict = dict[str, torch.Tensor]


class LazySubmoduleWeights:
    """Assigns one submodule's weights on the first forward call that reaches it, exactly once.

    The hook sits on the submodule and on every module inside it, so a container that is never
    called itself (a ModuleList iterated by its parent) still loads when one of its layers runs.
    A parent that reads the submodule's parameters without calling it would see meta tensors:
    such a submodule cannot be lazy. `tensors` are the submodule's entries of the weights file
    (keys relative to the submodule), still memory-mapped; `prepare` converts one to the
    serving dtype and device.
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        tensors: StateDict,
        prepare: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._tensors = tensors
        self._prepare = prepare
        self._lock = threading.Lock()
        self._loaded = False
        self._submodule = submodule
        self._hooks = [inner.register_forward_pre_hook(self._before_forward) for inner in submodule.modules()]

    @property
    def loaded(self) -> bool:
        """True once the weights are assigned."""
        return self._loaded

    def _before_forward(self, called: torch.nn.Module, args: tuple[object, ...]) -> None:
        if self._loaded:  # the lock is only taken until the first load finished
            return
        with self._lock:
            if self._loaded:
                return
            # The forward call runs under inference_mode; weights made there would be inference
            # tensors, which cannot be used outside it. They are weights, not activations.
            with torch.inference_mode(False):
                prepared = {key: self._prepare(tensor) for key, tensor in self._tensors.items()}
                self._submodule.load_state_dict(prepared, strict=True, assign=True)
            self._tensors = {}  # let go of the mapped file's pages
            self._loaded = True
            for hook in self._hooks:
                hook.remove()


def split_lazy(
    module: torch.nn.Module, names: list[str], state: Mapping[str, torch.Tensor], artifact: str
) -> tuple[StateDict, dict[str, StateDict]]:
    """Split `state` into the eagerly assigned part and one part per lazy submodule.

    Checks what needs the module: that each name is a submodule, and that the file has exactly
    the submodule's keys and shapes. The names themselves (well-formed, unique, not nested) were
    checked when model.yaml loaded.
    """
    problem = unknown_submodules_problem(module, names)
    if problem is not None:
        raise ModelLoadError(problem)
    eager = dict(state)
    lazy: dict[str, StateDict] = {}
    for name in names:
        prefix = name + "."
        part = {key.removeprefix(prefix): eager.pop(key) for key in list(eager) if key.startswith(prefix)}
        _check_part(module.get_submodule(name), name, part, artifact)
        lazy[name] = part
    return eager, lazy


def unknown_submodules_problem(module: torch.nn.Module, names: list[str]) -> str | None:
    """Why some of `names` cannot be lazy (they are not submodules of `module`), or None."""
    unknown = [name for name in names if not _is_submodule(module, name)]
    if not unknown:
        return None
    children = ", ".join(name for name, _ in module.named_children())
    return f"lazy_submodules {unknown} are not submodules of the model; its top-level submodules are: {children}"


def is_lazy(name: str, lazy_names: list[str]) -> bool:
    """True when the parameter or buffer `name` belongs to one of the lazy submodules."""
    return any(name.startswith(lazy + ".") for lazy in lazy_names)


def _is_submodule(module: torch.nn.Module, name: str) -> bool:
    if not name:
        return False
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _check_part(submodule: torch.nn.Module, name: str, part: StateDict, artifact: str) -> None:
    expected = submodule.state_dict()  # meta tensors: names and shapes only
    missing = sorted(set(expected) - set(part))
    unexpected = sorted(set(part) - set(expected))
    wrong_shape = [
        f"{key} {list(part[key].shape)} (module: {list(tensor.shape)})"
        for key, tensor in expected.items()
        if key in part and part[key].shape != tensor.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing from the file: {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"not in the submodule: {', '.join(unexpected[:5])}")
    if wrong_shape:
        problems.append(f"wrong shapes: {', '.join(wrong_shape[:5])}")
    if problems:
        raise ModelLoadError(f"weights of lazy submodule {name!r} in {artifact} do not match; " + "; ".join(problems))
