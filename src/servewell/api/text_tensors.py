"""Text in and out of a model whose `text:` section names its UTF-8 tensors (config/generate.py):
a prompt becomes the UINT8 input, each part of the output becomes text again, a character split
across two parts held back until it is whole. Used by OIP `generate` and the OpenAI-compatible API."""

from __future__ import annotations

import codecs
from collections.abc import Mapping

import numpy as np

from servewell.config.model import ModelConfig
from servewell.errors import InvalidInput, quote


def text_model(config: ModelConfig, what: str) -> tuple[str, str | None]:
    """The text input and output of `config` (`InvalidInput` naming what the route needs)."""
    text = config.text
    if text is None:
        raise InvalidInput(f"model {quote(config.name)} takes no text ({what} needs a model with a text: section in "
                           "its model.yaml)")
    return text.input, text.output


def text_inputs(config: ModelConfig, prompt: str) -> dict[str, np.ndarray]:
    """The model's inputs for `prompt`: its UTF-8 bytes as the text input, one row."""
    name, _ = text_model(config, "a text request")
    data = np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8)
    return {name: data[None, :] if config.max_batch_size > 0 else data}


class TextPieces:
    """Turns a stream's parts of the text output back into text, piece by piece."""

    __slots__ = ("_name", "_decoder")

    def __init__(self, output: str) -> None:
        self._name = output
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def piece(self, outputs: Mapping[str, np.ndarray], final: bool = False) -> str:
        """The text of one part (all of a whole answer); '' while a character is incomplete."""
        array = outputs.get(self._name)
        # NUL bytes are padding (a batch's rows of different lengths), never text.
        data = b"" if array is None else np.asarray(array, dtype=np.uint8).reshape(-1).tobytes().replace(b"\0", b"")
        return self._decoder.decode(data, final)

    def rest(self) -> str:
        """What an incomplete last character left (replaced)."""
        return self._decoder.decode(b"", True)
