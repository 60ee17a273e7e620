"""A real worker answering large outputs behind its handle (issue 45 H1): an answer over the model's
max_output_bytes is refused by the worker with both sizes named and the worker serves on, and a
batch whose outputs are large comes back exactly though it is copied out on the copy thread."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from servewell.engine.repository import read_model_config
from servewell.errors import OutputTooLarge
from servewell.workers.handle import WorkerHandle

WIDE = textwrap.dedent('''
    import numpy as np


    class Wide:
        """y[i] = x[i] * (0, 1, ..., width - 1): `width` floats a row, as a model with a [-1] output."""

        def setup(self, config):
            self.ramp = np.arange(config["settings"]["width"], dtype=np.float32)

        def execute(self, inputs):
            return {"y": inputs["x"] * self.ramp}
''')


def wide_model(root: Path, width: int, **fields: object) -> Path:
    directory = root / "wide"
    directory.mkdir()
    (directory / "wide.py").write_text(WIDE)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "wide.py", "python": {"entry": "wide:Wide", "settings": {"width": width}},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}], "max_batch_size": 4, "warmup": False,
        **fields,
    }))
    return directory


def test_large_outputs_come_back_exactly_and_an_answer_over_the_bound_is_refused_by_the_worker(
        tmp_path: Path) -> None:
    width = 1_000_000  # 4 MB a row: copied out of the worker's arena on the copy thread
    directory = wide_model(tmp_path, width, max_output_bytes=9_000_000)  # two rows fit, three do not

    async def main() -> None:
        handle = WorkerHandle(read_model_config(directory), directory)
        try:
            await handle.start(timeout_s=120)
            rows = np.array([[1.0], [2.0]], np.float32)
            outcome = await handle.run({"x": [rows[:1], rows[1:]]})  # two requests of one row each
            np.testing.assert_array_equal(outcome.outputs["y"], rows * np.arange(width, dtype=np.float32))

            started = time.monotonic()
            with pytest.raises(OutputTooLarge) as refused:
                await handle.run({"x": [np.ones((3, 1), np.float32)]})  # one request of three rows: 12 MB
            message = str(refused.value)
            assert "model 'wide' answered 12,000,000 bytes for one request (3 rows)" in message
            assert "over its max_output_bytes of 9,000,000" in message and "at most 2 rows" in message
            assert time.monotonic() - started < 60
            again = await handle.run({"x": [np.full((1, 1), 3.0, np.float32)]})  # the worker serves on
            assert again.outputs["y"][0, -1] == 3.0 * (width - 1)
        finally:
            await handle.stop()

    asyncio.run(main())
