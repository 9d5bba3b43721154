"""A tiny attention model trained in seconds on a task that needs two relations at once.

Every position carries a *letter* and a *digit*. The first half of a sequence holds distinct
letters; the second half repeats them in a shuffled order. At each position t of the second
half the model must name two digits:

* the digit of the **previous** position, t - 1 (a positional relation), and
* the digit of the earlier position whose letter **matches** the letter at t (a content relation).

The model is embeddings, one ``MultiHeadAttention`` layer (causal) and two linear readouts,
trained with Adam through the layer's hand-written backward. With two heads each relation gets
its own head; one head of the same width has to split one attention distribution between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mha_lab.cpu import MultiHeadAttention, create_causal_mask, softmax

__all__ = ["ToyTask", "ToyBatch", "ToyModel", "ToyRun", "make_batch", "train_toy", "head_relation_mass"]


@dataclass(frozen=True)
class ToyTask:
    """Sizes of the synthetic task: ``half`` distinct letters, then the same letters shuffled."""

    n_letters: int = 8
    n_digits: int = 8
    half: int = 6

    def __post_init__(self) -> None:
        if self.half < 2 or self.half > self.n_letters:
            raise ValueError(f"half={self.half} must be between 2 and n_letters={self.n_letters}")
        if self.n_digits < 2:
            raise ValueError(f"n_digits={self.n_digits} must be at least 2")

    @property
    def seq_len(self) -> int:
        """L = 2 * half."""
        return 2 * self.half


@dataclass
class ToyBatch:
    """One batch. Shapes: letters, digits: (B, L); prev, match: (B, half), the targets at t >= half;
    match_pos: (B, half), the position whose letter matches."""

    letters: np.ndarray
    digits: np.ndarray
    prev: np.ndarray
    match: np.ndarray
    match_pos: np.ndarray


def make_batch(task: ToyTask, batch_size: int, rng: np.random.Generator) -> ToyBatch:
    """Draw ``batch_size`` sequences of the task with the generator ``rng``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n = task.half
    first = np.argsort(rng.random((batch_size, task.n_letters)), axis=1)[:, :n]  # (B, n) distinct letters
    order = np.argsort(rng.random((batch_size, n)), axis=1)  # (B, n) where each second-half letter came from
    letters = np.concatenate([first, np.take_along_axis(first, order, axis=1)], axis=1)  # (B, L)
    digits = rng.integers(0, task.n_digits, size=(batch_size, 2 * n))  # (B, L)
    prev = digits[:, n - 1:2 * n - 1]  # (B, n): digit at t - 1 for t = n .. 2n-1
    match = np.take_along_axis(digits, order, axis=1)  # (B, n): digit at the matching position
    return ToyBatch(letters, digits, prev, match, order)


def _cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    r"""Mean cross-entropy :math:`-\log p_{target}`; returns (loss, dloss/dlogits, predictions)."""
    p = softmax(logits)  # (B, n, V)
    picked = np.take_along_axis(p, targets[..., None], axis=-1)[..., 0]  # (B, n)
    grad = p.copy()
    np.put_along_axis(grad, targets[..., None], np.take_along_axis(grad, targets[..., None], -1) - 1.0, axis=-1)
    return float(-np.log(picked).mean()), grad / targets.size, p.argmax(axis=-1)


def _rows_by_index(index: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """The gradient of an embedding table of ``n`` rows: out[i] = sum of rows[b, t] over index[b, t] = i.

    index (B, L), rows (B, L, d) -> (n, d). One ``np.bincount`` over (row, column) cells adds in the same
    order as ``np.add.at(out, index, rows)``, so the sums are the same to the last bit, at half the cost.
    """
    d = rows.shape[-1]
    cells = (index[..., None] * d + np.arange(d)).ravel()  # (B * L * d,): out's flat cell of each entry
    return np.bincount(cells, weights=rows.ravel(), minlength=n * d).reshape(n, d)


class ToyModel:
    r"""Letter, digit and position embeddings, one causal MHA layer, two linear readouts.

    .. math:: X_t = E^{a}[a_t] + E^{b}[b_t] + P_t, \quad H = \mathrm{MHA}(X), \quad
              \mathrm{logits}^{prev}_t = H_t R^{prev}, \quad \mathrm{logits}^{match}_t = H_t R^{match}

    Shapes: E^a: (n_letters, d), E^b: (n_digits, d), P: (L, d), R^prev, R^match: (d, n_digits).
    """

    def __init__(self, task: ToyTask, d_model: int = 32, num_heads: int = 2, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.task, self.d_model, self.num_heads = task, d_model, num_heads
        self.mha = MultiHeadAttention(d_model, num_heads, seed=seed + 1)
        s = 1.0 / np.sqrt(d_model)
        self.params: dict[str, np.ndarray] = {
            "E_letter": rng.normal(0, 1, (task.n_letters, d_model)),
            "E_digit": rng.normal(0, 1, (task.n_digits, d_model)),
            "P": rng.normal(0, 1, (task.seq_len, d_model)),
            "R_prev": rng.normal(0, s, (d_model, task.n_digits)),
            "R_match": rng.normal(0, s, (d_model, task.n_digits)),
        }
        self.params.update(self.mha.parameters())  # the layer's arrays, updated in place
        self.mask = create_causal_mask(task.seq_len)  # (1, 1, L, L)

    def forward(self, batch: ToyBatch) -> tuple[np.ndarray, np.ndarray]:
        """Logits for the two targets at the second-half positions: two arrays (B, half, n_digits)."""
        p = self.params
        X = p["E_letter"][batch.letters] + p["E_digit"][batch.digits] + p["P"]  # (B, L, d)
        H = self.mha.forward(X, self.mask)[:, self.task.half:]  # (B, L, d) -> (B, half, d)
        self._H = H
        return H @ p["R_prev"], H @ p["R_match"]

    def loss_and_grads(self, batch: ToyBatch) -> tuple[float, dict[str, np.ndarray]]:
        """Sum of the two cross-entropies and the gradient of every parameter (hand-written backward)."""
        p, n = self.params, self.task.half
        logits_prev, logits_match = self.forward(batch)
        loss_p, g_prev, _ = _cross_entropy(logits_prev, batch.prev)
        loss_m, g_match, _ = _cross_entropy(logits_match, batch.match)
        H = self._H
        grads = {
            "R_prev": H.reshape(-1, self.d_model).T @ g_prev.reshape(-1, g_prev.shape[-1]),
            "R_match": H.reshape(-1, self.d_model).T @ g_match.reshape(-1, g_match.shape[-1]),
        }
        grad_out = np.zeros((H.shape[0], self.task.seq_len, self.d_model))  # (B, L, d); zero before t = half
        grad_out[:, n:] = g_prev @ p["R_prev"].T + g_match @ p["R_match"].T
        grad_X = self.mha.backward(grad_out)  # (B, L, d)
        grads.update(self.mha.gradients())
        grads["P"] = grad_X.sum(axis=0)
        grads["E_letter"] = _rows_by_index(batch.letters, grad_X, len(p["E_letter"]))
        grads["E_digit"] = _rows_by_index(batch.digits, grad_X, len(p["E_digit"]))
        return loss_p + loss_m, grads

    def accuracy(self, batch: ToyBatch) -> dict[str, float]:
        """Fraction of correct digits for each relation and for both together."""
        logits_prev, logits_match = self.forward(batch)
        ok_prev = logits_prev.argmax(-1) == batch.prev
        ok_match = logits_match.argmax(-1) == batch.match
        return {"prev": float(ok_prev.mean()), "match": float(ok_match.mean()),
                "both": float((ok_prev & ok_match).mean())}


class Adam:
    r"""Adam on a dict of arrays, updated in place.

    .. math:: m \leftarrow \beta_1 m + (1-\beta_1) g,\; v \leftarrow \beta_2 v + (1-\beta_2) g^2,\;
              \theta \leftarrow \theta - \eta\, \hat m / (\sqrt{\hat v} + \epsilon)
    """

    def __init__(self, params: dict[str, np.ndarray], lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.betas, self.eps, self.t = params, lr, betas, eps, 0
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        """One update of every parameter from its gradient."""
        b1, b2 = self.betas
        self.t += 1
        for k, theta in self.params.items():
            self.m[k] = b1 * self.m[k] + (1 - b1) * grads[k]
            self.v[k] = b2 * self.v[k] + (1 - b2) * grads[k] ** 2
            m_hat, v_hat = self.m[k] / (1 - b1**self.t), self.v[k] / (1 - b2**self.t)
            theta -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


@dataclass
class ToyRun:
    """A finished training run: the model, its loss curve and accuracy on a held-out batch."""

    model: ToyModel
    losses: list[float] = field(default_factory=list)
    accuracy: dict[str, float] = field(default_factory=dict)
    eval_batch: ToyBatch | None = None


def train_toy(num_heads: int = 2, d_model: int = 32, steps: int = 400, batch_size: int = 64, lr: float = 1e-2,
              task: ToyTask | None = None, seed: int = 0) -> ToyRun:
    """Train a ToyModel with Adam on fresh batches; deterministic for a given seed."""
    task = task or ToyTask()
    rng = np.random.default_rng(seed)
    model = ToyModel(task, d_model=d_model, num_heads=num_heads, seed=seed)
    opt = Adam(model.params, lr=lr)
    run = ToyRun(model)
    for _ in range(steps):
        loss, grads = model.loss_and_grads(make_batch(task, batch_size, rng))
        opt.step(grads)
        run.losses.append(loss)
    run.eval_batch = make_batch(task, 512, np.random.default_rng(seed + 10_000))
    run.accuracy = model.accuracy(run.eval_batch)
    return run


def head_relation_mass(model: ToyModel, batch: ToyBatch) -> np.ndarray:
    """Mean attention mass each head puts on the previous position and on the matching position.

    Averaged over the second-half query positions whose match is not the previous position
    (there the two relations point at different tokens). Shape: (num_heads, 2), columns (prev, match).
    """
    model.forward(batch)
    A = model.mha.attention_weights[:, :, model.task.half:]  # (B, h, L, L) -> (B, h, half, L)
    t = np.arange(model.task.half, model.task.seq_len)  # query positions
    on_prev = A[:, :, np.arange(len(t)), t - 1]  # (B, h, half)
    on_match = np.take_along_axis(A, batch.match_pos[:, None, :, None], axis=-1)[..., 0]  # (B, h, half)
    distinct = (batch.match_pos != t - 1)[:, None, :]  # (B, 1, half)
    count = distinct.sum()
    return np.stack([(on_prev * distinct).sum((0, 2)) / count, (on_match * distinct).sum((0, 2)) / count], axis=1)
