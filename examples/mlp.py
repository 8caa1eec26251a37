"""A small multi-layer perceptron in plain numpy (or cupy: the same code runs on either
library's arrays): ReLU hidden layers, softmax output, mean cross-entropy loss,
gradients by hand. Used by train_digits.py and the tests."""
from __future__ import annotations

import numpy as np


def array_module(a):
    """numpy or cupy, whichever `a` belongs to."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def init_params(sizes, seed: int = 0, dtype=np.float64) -> list:
    """[W1, b1, W2, b2, ...] for layer sizes like (64, 64, 10), He-initialised."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in))
                      .astype(dtype))
        params.append(np.zeros(fan_out, dtype))
    return params


def forward(params, x):
    """Logits, and what backward needs (each layer's input and pre-activation)."""
    xp = array_module(x)
    layers, h = [], x
    for k in range(0, len(params), 2):
        z = h @ params[k] + params[k + 1]
        layers.append((h, z))
        h = xp.maximum(z, 0) if k + 2 < len(params) else z
    return h, layers


def loss_and_grads(params, x, y, scale: float = 1.0, on_grad=None):
    """Mean cross-entropy over the batch (times `scale`) and its gradient per parameter.

    on_grad(i, g), if given, is called as soon as each gradient is final, last layer
    first, which is the order in which backward produces them.
    """
    xp = array_module(x)
    logits, layers = forward(params, x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    n = len(y)
    rows = xp.arange(n)
    loss = float(-log_probs[rows, y].mean() * scale)
    delta = xp.exp(log_probs)
    delta[rows, y] -= 1.0
    delta *= scale / n
    grads = [None] * len(params)
    for k in range(len(params) - 2, -1, -2):
        h, z = layers[k // 2]
        grads[k + 1] = delta.sum(axis=0)
        grads[k] = h.T @ delta
        for i in (k + 1, k):
            if on_grad is not None:
                on_grad(i, grads[i])
        if k > 0:
            delta = (delta @ params[k].T) * (layers[k // 2 - 1][1] > 0)
    return loss, grads


def accuracy(params, x, y) -> float:
    logits, _ = forward(params, x)
    return float((logits.argmax(axis=1) == y).mean())
