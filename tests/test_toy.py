"""The toy model of the intuition chapter: it learns the task, and its two heads specialise."""

import numpy as np
import pytest

from mha_lab.gradcheck import numerical_gradient, relative_error
from mha_lab.testing import GRADCHECK_MAX_REL_ERROR
from mha_lab.toy import ToyModel, ToyTask, head_relation_mass, make_batch, train_toy

# Measured with seeds 0-4 and 400 steps: the 2-head model reaches >= 0.999 on both digits and
# each head puts >= 0.988 of its mass on its relation; one head gets the prev digit at chance (~1/8).
MIN_ACCURACY = 0.95
MIN_HEAD_MASS = 0.8


@pytest.fixture(scope="module")
def two_heads():
    return train_toy(num_heads=2, seed=0)


def test_batch_targets_follow_the_task():
    task = ToyTask(n_letters=7, n_digits=5, half=4)
    b = make_batch(task, 9, np.random.default_rng(3))
    n = task.half
    assert b.letters.shape == b.digits.shape == (9, 2 * n)
    assert all(len(set(row[:n])) == n for row in b.letters)  # distinct letters in the first half
    for i in range(9):
        for k, t in enumerate(range(n, 2 * n)):
            j = b.match_pos[i, k]
            assert j < n and b.letters[i, j] == b.letters[i, t]
            assert b.match[i, k] == b.digits[i, j]
            assert b.prev[i, k] == b.digits[i, t - 1]


def test_two_head_model_solves_the_task(two_heads):
    assert two_heads.accuracy["both"] > MIN_ACCURACY, two_heads.accuracy
    assert two_heads.losses[-1] < 0.1 * two_heads.losses[0]


def test_heads_specialise(two_heads):
    mass = head_relation_mass(two_heads.model, two_heads.eval_batch)  # (h, 2): prev, match
    prev_head = int(np.argmax(mass[:, 0]))
    assert mass[prev_head, 0] > MIN_HEAD_MASS, mass
    assert mass[1 - prev_head, 1] > MIN_HEAD_MASS, mass


def test_one_head_of_the_same_width_does_worse(two_heads):
    one = train_toy(num_heads=1, seed=0)
    assert one.accuracy["both"] < 0.5, one.accuracy
    assert one.accuracy["both"] < two_heads.accuracy["both"] - 0.4


def test_training_is_deterministic():
    a, b = train_toy(steps=5, seed=1), train_toy(steps=5, seed=1)
    assert a.losses == b.losses


@pytest.mark.parametrize("name", ["E_letter", "E_digit", "P", "R_match", "W_Q", "W_O"])
def test_hand_written_gradients(name):
    task = ToyTask(n_letters=4, n_digits=3, half=3)
    model = ToyModel(task, d_model=4, num_heads=2, seed=2)
    batch = make_batch(task, 2, np.random.default_rng(0))
    _, grads = model.loss_and_grads(batch)
    numeric = numerical_gradient(lambda: model.loss_and_grads(batch)[0], model.params[name])
    assert relative_error(grads[name], numeric) < GRADCHECK_MAX_REL_ERROR


def test_bad_task_is_rejected():
    with pytest.raises(ValueError, match="half"):
        ToyTask(n_letters=3, half=5)
