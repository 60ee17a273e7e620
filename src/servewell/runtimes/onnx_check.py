"""Check an ONNX model against its model.yaml as the server would load it: `servewell models` runs
this in a child process.

The onnx runtime's `check` in its descriptor (config/runtimes.py), which runtimes/check_child.py runs.

Opens the graph with onnxruntime, the package that serves it (the `onnx` extra brings onnxruntime
only, not the `onnx` package), with graph optimizations off: a corrupt or truncated file fails here
as it would at load. Then compares model.yaml's inputs and outputs with the graph's: names, element
types and shapes (the batch dimension, then each fixed dimension). Returns the problems and the notes.

A problem is what makes the load or the warm-up fail; a note is what serves but costs something
(an input of another floating type is cast on every request). It runs in its own process so that
the CLI never imports onnxruntime, and a graph that crashes onnxruntime cannot take the CLI down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig, TensorSpec
from servewell.config.problems import FieldProblem

#: onnxruntime's element types as OIP datatypes (tensor(bfloat16) and the like have no numpy twin).
ORT_TO_OIP = {
    "tensor(float)": "FP32", "tensor(float16)": "FP16", "tensor(double)": "FP64", "tensor(bfloat16)": "BF16",
    "tensor(bool)": "BOOL", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(string)": "BYTES",
}


def check_onnx(config: ModelConfig, model_dir: Path) -> tuple[list[FieldProblem], list[str]]:
    """Problems and notes of `config` against the ONNX graph in `model_dir / config.artifact`."""
    import onnxruntime as ort

    path = model_dir / config.artifact
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        return [FieldProblem("artifact", f"onnxruntime cannot load {config.artifact}: {_first_line(exc)}")], []
    problems: list[FieldProblem] = []
    notes: list[str] = []
    graph_inputs = {i.name: i for i in session.get_inputs()}
    graph_outputs = {o.name: o for o in session.get_outputs()}
    declared_inputs = [spec.name for spec in config.inputs]
    if sorted(declared_inputs) != sorted(graph_inputs):
        problems.append(FieldProblem("inputs", f"names in model.yaml {declared_inputs}, the graph in "
                                     f"{config.artifact} takes {list(graph_inputs)}"))
    for index, spec in enumerate(config.inputs):
        if spec.name in graph_inputs:
            _compare(f"inputs[{index}]", spec, graph_inputs[spec.name], config.max_batch_size, config.artifact,
                     problems, notes)
    for index, spec in enumerate(config.outputs):
        if spec.name not in graph_outputs:
            problems.append(FieldProblem(f"outputs[{index}].name", f"{spec.name!r} is not an output of the graph "
                                         f"in {config.artifact}, which has {list(graph_outputs)}"))
        else:
            _compare(f"outputs[{index}]", spec, graph_outputs[spec.name], config.max_batch_size,
                     config.artifact, problems, notes)
    return problems, notes


def _compare(field: str, spec: TensorSpec, node: Any, max_batch: int, artifact: str,
             problems: list[FieldProblem], notes: list[str]) -> None:
    """Append what differs between one declared tensor and the graph's (an onnxruntime NodeArg)."""
    batched = max_batch > 0
    found = ORT_TO_OIP.get(node.type, node.type)
    if found != spec.datatype:
        how = f"model.yaml says {spec.datatype}, the graph in {artifact} has {found}"
        if "BYTES" in (found, spec.datatype) or found not in ORT_TO_OIP.values():
            problems.append(FieldProblem(f"{field}.datatype", f"{spec.name!r}: {how}"))
        else:
            notes.append(f"{field} {spec.name!r}: {how}; converted on every request")
    if not node.shape and field.startswith("outputs"):
        return  # no shape in the graph (inference gave up): warm-up checks what the model returns
    graph_shape: list[int | str | None] = list(node.shape or [])
    declared: list[int] = ([-1] if batched else []) + list(spec.shape)
    shown = (f"a batch dimension plus {spec.shape}" if batched else f"{spec.shape} (max_batch_size 0: no batch "
             "dimension)")
    if len(graph_shape) != len(declared):
        problems.append(FieldProblem(f"{field}.shape", f"{spec.name!r}: model.yaml declares {shown}, the graph in "
                                     f"{artifact} has shape {graph_shape}; fix shape or max_batch_size"))
        return
    # Batches hold 1..max_batch_size items, so a fixed batch axis only works when it is 1 = max.
    if batched and isinstance(graph_shape[0], int) and graph_shape[0] > 0 and not graph_shape[0] == max_batch == 1:
        problems.append(FieldProblem(f"{field}.shape", f"{spec.name!r}: the graph in {artifact} fixes the batch "
                                     f"dimension to {graph_shape[0]}, batches hold 1 to max_batch_size {max_batch} "
                                     "items; export with a dynamic batch axis, or set max_batch_size: 1 for a graph "
                                     "fixed to 1"))
    for index, (want, got) in enumerate(zip(declared, graph_shape, strict=True)):
        if want != -1 and isinstance(got, int) and got > 0 and want != got:
            problems.append(FieldProblem(f"{field}.shape", f"{spec.name!r}: model.yaml declares {shown}, the graph "
                                         f"in {artifact} has shape {graph_shape} (dimension {index} differs)"))
            return


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
