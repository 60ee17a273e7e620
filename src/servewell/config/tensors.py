"""Tensor declarations of model.yaml: names, Open Inference Protocol datatypes, item shapes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from servewell.config.problems import config_error
from servewell.config.strict import StrictModel

#: Open Inference Protocol datatypes that numpy can hold, mapped to numpy dtype names.
#: BF16 is part of the protocol but numpy has no native bfloat16, so it is not offered.
OIP_TO_NUMPY: dict[str, str] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": "object",
}
NUMPY_TO_OIP: dict[str, str] = {v: k for k, v in OIP_TO_NUMPY.items()}

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]


class TensorSpec(StrictModel):
    """One named input or output tensor of a model."""

    name: str = Field(min_length=1, description="Tensor name as the model and the API know it.")
    datatype: Datatype = Field(description="Open Inference Protocol datatype, e.g. FP32.")
    shape: list[int] = Field(
        description="Shape of one item, without the batch dimension; -1 marks a variable size."
    )

    @field_validator("shape")
    @classmethod
    def _dims_valid(cls, shape: list[int]) -> list[int]:
        for dim in shape:
            if dim == 0 or dim < -1:
                raise config_error(f"dimension {dim} is invalid; use a positive size or -1")
        return shape

    @property
    def numpy_dtype(self) -> str:
        """The numpy dtype name that holds this tensor."""
        return OIP_TO_NUMPY[self.datatype]

    @property
    def fixed_size(self) -> int | None:
        """Number of values in one item, or None when a dimension is variable (-1)."""
        size = 1
        for dim in self.shape:
            if dim == -1:
                return None
            size *= dim
        return size
