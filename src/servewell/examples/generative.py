"""servewell's generative examples, built locally with no download:

- `charlm`: a character-level language model, step-wise (continuous batching), served by OIP
  `generate`/`generate_stream`/`infer_stream`, gRPC `ModelStreamInfer` and the OpenAI-compatible API;
- `charlm_gen`: the same model as a generator (`execute` yields each character of its batch);
- `char_embed`: a text embedding model for `/v1/embeddings`.

`python -m servewell.examples.build generative --out REPO` builds all three. The language model
is trained here, at the first build (a few seconds of numpy on one core), on the text the package
ships (`examples/text/corpus.txt`), with a fixed seed: the same build gives the same weights and
greedy decoding the same text. Each model's code is `examples/steps/charlm.py`, copied into its
directory as a user's own code would be.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from servewell.config.model import ModelConfig
from servewell.examples.artifacts import ProgressFn, write_model_yaml

STEPS = Path(__file__).parent / "steps"
CORPUS = Path(__file__).parent / "text" / "corpus.txt"
#: Characters of context the model reads.
CONTEXT = 8
EMBED, HIDDEN = 16, 128
EPOCHS, BATCH, LEARNING_RATE, SEED = 60, 64, 0.05, 1234

_TEXT_IO = {
    "inputs": [{"name": "text_input", "datatype": "UINT8", "shape": [-1]}],
    "text": {"input": "text_input", "output": "text_output"},
}


def train_charlm(progress: ProgressFn) -> dict[str, np.ndarray]:
    """Weights of the character model, trained on the shipped corpus (deterministic)."""
    text = CORPUS.read_text(encoding="utf-8")
    paragraphs = [p.strip().replace("\n", " ") for p in text.split("\n\n") if p.strip()]
    alphabet = [""] + sorted({c for p in paragraphs for c in p})  # index 0: end of text
    index = {c: i for i, c in enumerate(alphabet)}
    space = index[" "]
    xs, ys = [], []
    for paragraph in paragraphs:
        ids = [space] * CONTEXT + [index[c] for c in paragraph] + [0]
        for t in range(CONTEXT, len(ids)):
            xs.append(ids[t - CONTEXT:t])
            ys.append(ids[t])
    x, y = np.asarray(xs, dtype=np.int64), np.asarray(ys, dtype=np.int64)
    rng = np.random.default_rng(SEED)
    vocab = len(alphabet)
    embed = rng.normal(0, 0.3, (vocab, EMBED))
    w1 = rng.normal(0, 1 / np.sqrt(CONTEXT * EMBED), (CONTEXT * EMBED, HIDDEN))
    b1 = np.zeros(HIDDEN)
    w2 = rng.normal(0, 1 / np.sqrt(HIDDEN), (HIDDEN, vocab))
    b2 = np.zeros(vocab)
    for epoch in range(EPOCHS):
        order = rng.permutation(len(x))
        loss_sum = 0.0
        for start in range(0, len(x), BATCH):
            batch = order[start:start + BATCH]
            ctx, target = x[batch], y[batch]
            inputs = embed[ctx].reshape(len(batch), -1)
            hidden = np.tanh(inputs @ w1 + b1)
            logits = hidden @ w2 + b2
            logits -= logits.max(axis=1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            loss_sum += float(-np.log(probs[np.arange(len(batch)), target] + 1e-12).sum())
            grad = probs
            grad[np.arange(len(batch)), target] -= 1
            grad /= len(batch)
            g_w2, g_b2 = hidden.T @ grad, grad.sum(axis=0)
            g_hidden = grad @ w2.T * (1 - hidden ** 2)
            g_w1, g_b1 = inputs.T @ g_hidden, g_hidden.sum(axis=0)
            g_inputs = (g_hidden @ w1.T).reshape(len(batch), CONTEXT, EMBED)
            np.add.at(embed, ctx, -LEARNING_RATE * 4 * g_inputs)
            w1 -= LEARNING_RATE * 4 * g_w1
            b1 -= LEARNING_RATE * 4 * g_b1
            w2 -= LEARNING_RATE * 4 * g_w2
            b2 -= LEARNING_RATE * 4 * g_b2
        if epoch % 10 == 9 or epoch == EPOCHS - 1:
            progress(f"training epoch {epoch + 1}/{EPOCHS}: loss {loss_sum / len(x):.3f}")
    return {"alphabet": np.asarray(alphabet), "context": np.asarray(CONTEXT), "embed": embed.astype(np.float32),
            "w1": w1.astype(np.float32), "b1": b1.astype(np.float32), "w2": w2.astype(np.float32),
            "b2": b2.astype(np.float32)}


def _model(model_dir: Path, name: str, entry: str, description: str, **fields: Any) -> ModelConfig:
    shutil.copyfile(STEPS / "charlm.py", model_dir / "charlm.py")
    settings = fields.pop("settings", {})
    return write_model_yaml(model_dir, {
        "name": name, "runtime": "python", "artifact": "charlm.py",
        "python": {"entry": f"charlm:{entry}", "settings": settings}, "max_batch_size": 64,
        "deterministic": True, "metadata": {"description": description}, **fields,
    })


def build_charlm(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`charlm`: the step-wise character model (continuous batching)."""
    np.savez(model_dir / "charlm.npz", **train_charlm(progress))  # type: ignore[arg-type]
    return _model(model_dir, "charlm", "CharLM", "A character-level language model trained at the first build on "
                  "text servewell ships; step-wise: sequences join and leave the running batch at every step.",
                  outputs=[{"name": "text_output", "datatype": "UINT8", "shape": [-1]}],
                  generate={"max_sequences": 64, "max_outputs": 512}, warmup=False, extra_files=["charlm.npz"],
                  **_TEXT_IO)


def build_charlm_gen(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`charlm_gen`: the same model as a generator (`execute` yields the characters of its batch)."""
    np.savez(model_dir / "charlm.npz", **train_charlm(progress))  # type: ignore[arg-type]
    return _model(model_dir, "charlm_gen", "CharLMGenerator", "The character model as a generator: each batch "
                  "yields one character per row per step.",
                  outputs=[{"name": "text_output", "datatype": "UINT8", "shape": [-1]}],
                  generate={"max_sequences": 64, "max_outputs": 512}, warmup=False, extra_files=["charlm.npz"],
                  **_TEXT_IO)


def build_char_embed(model_dir: Path, progress: ProgressFn) -> ModelConfig:
    """`char_embed`: a 64-float embedding of a text (for /v1/embeddings)."""
    progress("no training: hashed character trigrams")
    return _model(model_dir, "char_embed", "CharEmbed", "A text embedding: hashed character trigrams, "
                  "L2-normalised (64 floats).",
                  inputs=[{"name": "text_input", "datatype": "UINT8", "shape": [-1]}],
                  outputs=[{"name": "embedding", "datatype": "FP32", "shape": [64]}],
                  text={"input": "text_input"}, warmup=False)
