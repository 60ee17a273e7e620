"""The naive baseline: a plain FastAPI endpoint that runs the model once per request, in-process.

    python -m bench.naive_server --model bench/results/work/build/mlp/mlp.onnx --port 8100

What a first version of a model service usually looks like: a pydantic body, onnxruntime in
the server process, one `session.run` per request, uvicorn with one worker. It accepts the
same Open Inference Protocol JSON body as servewell's `/v2/models/{name}/infer`, so both
servers get byte-identical load. The handler is `async def` and runs the model inline:
for a model this small that beats a threadpool hop (measured: the sync variant was slower),
so the baseline is the stronger of the two plain variants.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


class InferInput(BaseModel):
    """One input tensor of an OIP request."""

    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class InferRequest(BaseModel):
    """An OIP inference request (the fields the baseline uses)."""

    inputs: list[InferInput]
    parameters: dict[str, Any] | None = None


def create_app(model_path: str, threads: int) -> FastAPI:
    """The baseline app serving the ONNX model at `model_path`."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model_path, sess_options=options, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    output_name = session.get_outputs()[0].name
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, request: InferRequest) -> dict[str, Any]:
        tensor = request.inputs[0]
        x = np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
        (y,) = session.run([output_name], {input_name: x})
        return {
            "model_name": name,
            "outputs": [{"name": output_name, "shape": list(y.shape), "datatype": "FP32", "data": y.ravel().tolist()}],
        }

    return app


def main(argv: list[str] | None = None) -> int:
    """Entry point: serve until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m bench.naive_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="ONNX file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.model, args.threads), host=args.host, port=args.port, workers=1,
                log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
