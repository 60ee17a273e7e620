"""A character-level language model served three ways (servewell's generative examples).

- `CharLM`, step-wise: `start` makes one state per request, `step` advances every running
  sequence by one character at once (one matrix product for the whole running batch, whichever
  step each sequence started at: continuous batching), `end` forgets the states.
- `CharLMGenerator`: `execute` is a generator that yields one character per row of its batch per
  step until every row has finished (each batch runs as one cohort).
- `CharEmbed`: `execute` answers a 64-float embedding of each text (hashed character trigrams).

The model reads the previous CONTEXT characters, looks up their embeddings, and computes
logits = tanh(x @ w1 + b1) @ w2 + b2 over its alphabet; decoding is greedy, so the same prompt
always gives the same text. Its weights (charlm.npz) were trained by servewell's example builder
(examples/generative.py) on text the package ships. Only numpy is needed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

#: The index of "end of text" in the alphabet: a sequence that produces it is done.
EOT = 0


class _Weights:
    def __init__(self, directory: str) -> None:
        data = np.load(Path(directory) / "charlm.npz")
        self.alphabet = [str(c) for c in data["alphabet"]]  # index -> character ("" for EOT)
        self.index = {c: i for i, c in enumerate(self.alphabet) if c}
        self.context = int(data["context"])
        self.embed, self.w1, self.b1, self.w2, self.b2 = (data[k] for k in ("embed", "w1", "b1", "w2", "b2"))
        self.encoded = [c.encode("utf-8") for c in self.alphabet]
        self.space = self.index.get(" ", 1)

    def ids(self, prompt: np.ndarray) -> list[int]:
        text = bytes(np.asarray(prompt, dtype=np.uint8).reshape(-1)).decode("utf-8", "replace")
        ids = [self.index.get(c, self.space) for c in text]
        return ([self.space] * self.context + ids)[-self.context:]

    def next_ids(self, contexts: np.ndarray) -> np.ndarray:
        """The next character of each row of `contexts` [rows, CONTEXT]: one forward pass for all."""
        x = self.embed[contexts].reshape(len(contexts), -1)
        logits = np.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2
        return np.asarray(logits.argmax(axis=1))

    def piece(self, token: int) -> np.ndarray:
        return np.frombuffer(self.encoded[token], dtype=np.uint8)[None, :]


class CharLM:
    """Step-wise: sequences join and leave the running batch at every step."""

    def setup(self, config: dict[str, Any]) -> None:
        self.model = _Weights(config["directory"])
        # A fixed time each step takes besides its compute, to stand in for a larger model whose
        # step costs about the same at any batch size (a GPU's); 0 by default.
        self.step_s = float(config["settings"].get("step_ms", 0.0)) / 1000.0

    def start(self, requests: list[dict[str, np.ndarray]]) -> list[list[int]]:
        return [self.model.ids(request["text_input"]) for request in requests]

    def step(self, states: list[list[int]]) -> list[tuple[dict[str, np.ndarray] | None, bool]]:
        started = time.perf_counter()
        tokens = self.model.next_ids(np.asarray(states, dtype=np.int64))
        results: list[tuple[dict[str, np.ndarray] | None, bool]] = []
        for state, token in zip(states, tokens.tolist(), strict=True):
            if token == EOT:
                results.append((None, True))
                continue
            state.append(token)
            del state[0]
            results.append(({"text_output": self.model.piece(token)}, False))
        if self.step_s:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        return results

    def end(self, states: list[list[int]]) -> None:
        """Nothing to free: a state is a short list."""


class CharLMGenerator:
    """Generator: each batch yields one character per row per step until all its rows finished."""

    def setup(self, config: dict[str, Any]) -> None:
        self.model = _Weights(config["directory"])
        self.max_steps = int(config["settings"].get("max_steps", 512))

    def execute(self, inputs: dict[str, np.ndarray]):  # noqa: ANN201 - a generator of output dicts
        prompts = inputs["text_input"]
        contexts = np.asarray([self.model.ids(row) for row in prompts], dtype=np.int64)
        finished = np.zeros(len(contexts), dtype=bool)
        for _ in range(self.max_steps):
            tokens = self.model.next_ids(contexts)
            finished |= tokens == EOT
            if finished.all():
                return
            pieces = [self.model.encoded[t] if not done else b"" for t, done in zip(tokens.tolist(), finished,
                                                                                    strict=True)]
            width = max(len(p) for p in pieces)
            out = np.zeros((len(pieces), width), dtype=np.uint8)
            for row, piece in enumerate(pieces):
                out[row, :len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            contexts = np.concatenate([contexts[:, 1:], tokens[:, None]], axis=1)
            yield {"text_output": out}


class CharEmbed:
    """An embedding of each text: its character trigrams hashed into 64 buckets, L2-normalised."""

    DIMENSIONS = 64

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = inputs["text_input"]
        out = np.zeros((len(rows), self.DIMENSIONS), dtype=np.float32)
        for i, row in enumerate(rows):
            data = bytes(np.asarray(row, dtype=np.uint8)).lower()
            for j in range(max(1, len(data) - 2)):
                gram = data[j:j + 3]
                bucket = int.from_bytes(gram.ljust(3, b" "), "little") * 2654435761 % self.DIMENSIONS
                out[i, bucket] += 1.0
            norm = float(np.linalg.norm(out[i]))
            if norm:
                out[i] /= norm
        return {"embedding": out}
