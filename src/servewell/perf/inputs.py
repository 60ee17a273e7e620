"""Request inputs for a benchmark: generated from a model's OIP metadata, or read from files.

Generated data is seeded random values of each input's datatype, in its shape with every
variable dimension (-1) made concrete: the batch dimension becomes `batch_size`, the others
`dynamic_size`, unless `--shape NAME:d1,d2,...` gives the whole shape. Files are `.npy` arrays
(one per input) or encoded images, sent as a BYTES tensor to the model's image input (a
servewell model with `preprocess` decodes them; other servers need a model that takes BYTES).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from servewell.config.model import OIP_TO_NUMPY

#: Largest tensor a generated request may hold: a benchmark of a typo'd shape must not eat the memory.
MAX_TENSOR_ELEMENTS = 64 * 1024 * 1024
#: Generated integers lie in [0, INT_HIGH): valid as class or token indices for most models.
INT_HIGH = 100


class InputError(ValueError):
    """The inputs asked for do not fit the model (names, datatypes, shapes, files)."""


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One input or output as the server's metadata describes it (full shape, -1 where variable)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelMeta:
    """The parts of `GET /v2/models/{name}` (or gRPC ModelMetadata) a benchmark needs."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    #: servewell names it in the metadata parameters; None where the server does not say.
    max_batch_size: int | None = None
    #: The input that accepts encoded images as BYTES (servewell's `parameters.image_input`).
    image_input: str | None = None

    @classmethod
    def from_metadata(cls, doc: Mapping[str, Any]) -> ModelMeta:
        """Parse OIP model metadata JSON; gRPC's JSON form (int64 dims as strings) works too."""
        try:
            def tensors(key: str) -> tuple[TensorMeta, ...]:
                return tuple(TensorMeta(str(t["name"]), str(t["datatype"]), tuple(int(d) for d in t.get("shape", [])))
                             for t in doc.get(key) or [])

            params = doc.get("parameters") or {}
            raw_max = params.get("max_batch_size") if isinstance(params, dict) else None
            image = params.get("image_input") if isinstance(params, dict) else None
            if isinstance(image, dict):  # gRPC parameters: {"string_param": "..."}
                image = image.get("string_param")
            if isinstance(raw_max, dict):
                raw_max = raw_max.get("int64_param")
            return cls(
                name=str(doc["name"]), versions=tuple(str(v) for v in doc.get("versions") or []),
                platform=str(doc.get("platform", "")), inputs=tensors("inputs"), outputs=tensors("outputs"),
                max_batch_size=int(raw_max) if raw_max is not None else None,
                image_input=str(image).split()[0] if image else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"the server's model metadata is not OIP metadata: {exc!r}") from None

    def input(self, name: str) -> TensorMeta:
        """The input called `name`."""
        for tensor in self.inputs:
            if tensor.name == name:
                return tensor
        raise InputError(f"model '{self.name}' has no input '{name}'; it takes {[t.name for t in self.inputs]}")

    @property
    def batches(self) -> bool:
        """Whether the first dimension of every input is a batch dimension."""
        if self.max_batch_size is not None:
            return self.max_batch_size > 0
        return all(t.shape and t.shape[0] == -1 for t in self.inputs)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One input of one request: numeric data in a numpy array, or BYTES elements."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray  # numeric: the data; BYTES: a flat object array of `bytes`
    images: bool = False  # BYTES elements are encoded images (sent base64 in JSON)


def concrete_shape(model: ModelMeta, meta: TensorMeta, batch_size: int, dynamic_size: int,
                   overrides: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    """The shape one request sends for `meta`: the override, else -1 made concrete."""
    if meta.name in overrides:
        shape = tuple(int(d) for d in overrides[meta.name])
        if len(shape) != len(meta.shape) or any(m not in (-1, d) for m, d in zip(meta.shape, shape, strict=True)):
            raise InputError(f"--shape for input '{meta.name}' is {list(shape)}; the model declares "
                             f"{list(meta.shape)} (-1: any size)")
    else:
        batched = model.batches and meta.shape and meta.shape[0] == -1
        shape = tuple(
            (batch_size if index == 0 and batched else dynamic_size) if dim == -1 else dim
            for index, dim in enumerate(meta.shape)
        )
    if any(d < 1 for d in shape):
        raise InputError(f"input '{meta.name}': every dimension must be at least 1, got {list(shape)}")
    if int(np.prod(shape, dtype=np.int64)) > MAX_TENSOR_ELEMENTS:
        raise InputError(f"input '{meta.name}' of shape {list(shape)} is over {MAX_TENSOR_ELEMENTS} elements")
    return shape


def random_tensor(meta: TensorMeta, shape: tuple[int, ...], rng: np.random.Generator) -> Tensor:
    """Seeded random data of the tensor's datatype."""
    if meta.datatype == "BYTES":
        count = int(np.prod(shape, dtype=np.int64))
        letters = rng.integers(ord("a"), ord("z") + 1, size=(count, 8), dtype=np.uint8)
        elements = np.empty(count, dtype=object)
        elements[:] = [row.tobytes() for row in letters]
        return Tensor(meta.name, meta.datatype, shape, elements)
    if meta.datatype not in OIP_TO_NUMPY:
        raise InputError(f"input '{meta.name}' has datatype {meta.datatype}, which numpy cannot hold; "
                         "give it as a file")
    dtype = np.dtype(OIP_TO_NUMPY[meta.datatype])
    if dtype.kind == "f":
        array = rng.standard_normal(shape).astype(dtype)
    elif dtype.kind == "b":
        array = rng.random(shape) < 0.5
    else:
        high = min(INT_HIGH, int(np.iinfo(dtype).max))
        array = rng.integers(0, high, size=shape).astype(dtype)
    return Tensor(meta.name, meta.datatype, shape, array)


def generate_inputs(model: ModelMeta, *, variants: int = 4, batch_size: int = 1, dynamic_size: int = 8,
                    shapes: Mapping[str, Sequence[int]] | None = None, seed: int = 1) -> list[list[Tensor]]:
    """`variants` requests of seeded random data for every input of `model`."""
    if batch_size < 1 or dynamic_size < 1 or variants < 1:
        raise InputError("batch size, dynamic size and variants must be at least 1")
    if batch_size > 1 and not model.batches:
        raise InputError(f"model '{model.name}' takes no batch dimension; use --batch-size 1")
    overrides = dict(shapes or {})
    unknown = set(overrides) - {t.name for t in model.inputs}
    if unknown:
        raise InputError(f"--shape names {sorted(unknown)}, which model '{model.name}' does not take")
    rng = np.random.default_rng(seed)
    resolved = {t.name: concrete_shape(model, t, batch_size, dynamic_size, overrides) for t in model.inputs}
    return [[random_tensor(t, resolved[t.name], rng) for t in model.inputs] for _ in range(variants)]


def npy_inputs(model: ModelMeta, files: Mapping[str, Path]) -> list[list[Tensor]]:
    """One request from `.npy` files, one per input (a missing batch dimension is added)."""
    names = {t.name for t in model.inputs}
    if set(files) != names:
        raise InputError(f"give one .npy file per input: model '{model.name}' takes {sorted(names)}, "
                         f"files were given for {sorted(files)}")
    tensors = []
    for meta in model.inputs:
        path = files[meta.name]
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot read {path} as a .npy array: {exc}") from None
        if array.dtype.kind in "OSU":
            elements = np.empty(array.size, dtype=object)
            elements[:] = [v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
            if meta.datatype != "BYTES":
                raise InputError(f"{path} holds strings; input '{meta.name}' is {meta.datatype}")
            array_shape = array.shape
            tensors.append(Tensor(meta.name, "BYTES", _with_batch(model, meta, array_shape, path), elements))
            continue
        want = OIP_TO_NUMPY.get(meta.datatype)
        if want is None or want == "object" or not np.can_cast(array.dtype, want, "same_kind"):
            raise InputError(f"{path} holds {array.dtype}; input '{meta.name}' is {meta.datatype}")
        shape = _with_batch(model, meta, array.shape, path)
        tensors.append(Tensor(meta.name, meta.datatype, shape, np.ascontiguousarray(array.astype(want).reshape(shape))))
    return [tensors]


def _with_batch(model: ModelMeta, meta: TensorMeta, shape: tuple[int, ...], path: Path) -> tuple[int, ...]:
    if model.batches and len(shape) == len(meta.shape) - 1:
        shape = (1, *shape)
    if len(shape) != len(meta.shape) or any(m not in (-1, d) for m, d in zip(meta.shape, shape, strict=True)):
        raise InputError(f"{path} has shape {list(shape)}; input '{meta.name}' is {list(meta.shape)} (-1: any size)")
    return shape


def image_inputs(model: ModelMeta, paths: Sequence[Path], input_name: str | None = None,
                 batch_size: int = 1) -> list[list[Tensor]]:
    """One request per image file: its encoded bytes as a BYTES tensor for the model's image input.

    The input is `input_name`, else the one the server's metadata names, else the model's
    only input. Each request carries `batch_size` copies of its image.
    """
    name = input_name or model.image_input or (model.inputs[0].name if len(model.inputs) == 1 else None)
    if name is None:
        raise InputError(f"model '{model.name}' has several inputs; name the image input with --image-input")
    meta = model.input(name)
    if len(model.inputs) != 1:
        raise InputError(f"images feed one input, but model '{model.name}' takes {[t.name for t in model.inputs]}")
    if batch_size > 1 and not model.batches:
        raise InputError(f"model '{model.name}' takes no batch dimension; use --batch-size 1")
    requests = []
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read image {path}: {exc}") from None
        elements = np.empty(batch_size, dtype=object)
        elements[:] = [data] * batch_size
        requests.append([Tensor(meta.name, "BYTES", (batch_size,), elements, images=True)])
    if not requests:
        raise InputError("no image files given")
    return requests


def parse_shape_overrides(texts: Sequence[str]) -> dict[str, list[int]]:
    """`NAME:d1,d2,...` options (perf_analyzer's --shape form) as {name: dims}."""
    shapes: dict[str, list[int]] = {}
    for text in texts:
        name, colon, dims = text.rpartition(":")
        try:
            values = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            values = []
        if not colon or not name or not values:
            raise InputError(f"--shape {text!r} must look like NAME:1,3,224,224")
        shapes[name] = values
    return shapes


def parse_input_files(texts: Sequence[str], model: ModelMeta) -> dict[str, Path]:
    """`NAME=file.npy` options (or a bare file for a model with one input) as {name: path}."""
    files: dict[str, Path] = {}
    for text in texts:
        name, eq, path = text.partition("=")
        if not eq:
            if len(model.inputs) != 1:
                raise InputError(f"--input {text!r}: model '{model.name}' has several inputs; use NAME=FILE.npy")
            name, path = model.inputs[0].name, text
        files[name] = Path(path)
    return files
