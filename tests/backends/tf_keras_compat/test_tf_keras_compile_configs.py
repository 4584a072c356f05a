"""Compile configs of tf.keras 2 files: loss, metric and schedule objects.

tests/fixtures/tf_keras2/layers/compiled_* (layer_fixtures.py) were
compiled by tf-keras 2.21 with loss objects (`fn`, `reduction="auto"` in
their configs), metric objects and metric names, and learning-rate
schedules inside the optimizer, trained two steps and saved as .h5 and
.keras. Each loads compiled equivalently: the same loss, schedule and
metrics, the schedule's step (the iterations) restored, and it trains on.
"""

import pathlib

import keras
import numpy as np
import pytest

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2]
    / "fixtures"
    / "tf_keras2"
    / "layers"
)
# name: (optimizer, inner optimizer, loss, schedule and its config keys,
#        metrics)
EXPECTED = {
    "compiled_exponential_decay_mixed_bfloat16": (
        "Adam",
        "Adam",
        ("CategoricalCrossentropy", {"label_smoothing": 0.1}),
        (
            "ExponentialDecay",
            {"initial_learning_rate": 0.01, "decay_steps": 10},
        ),
        {"categorical_accuracy", "auc"},
    ),
    "compiled_piecewise_decay_mixed_float16": (
        "LossScaleOptimizer",
        "SGD",
        ("CategoricalCrossentropy", {"label_smoothing": 0.0}),
        ("PiecewiseConstantDecay", {"boundaries": [5, 10]}),
        {"precision"},
    ),
    "compiled_cosine_decay_mixed_bfloat16": (
        "RMSprop",
        "RMSprop",
        ("KLDivergence", {}),
        ("CosineDecay", {"alpha": 0.1, "decay_steps": 20}),
        # "accuracy": the .keras file keeps the name; the .h5 file saved a
        # wrapper of the function, which comes back named after it.
        {
            ".h5": {"categorical_accuracy", "top_k_categorical_accuracy"},
            ".keras": {"accuracy", "top_k_categorical_accuracy"},
        },
    ),
}
CASES = [
    (name, suffix) for name in sorted(EXPECTED) for suffix in (".h5", ".keras")
]


@pytest.mark.parametrize(("name", "suffix"), CASES)
def test_compiles_as_saved_and_trains_on(name, suffix):
    outer, inner, (loss, loss_config), schedule, metrics = EXPECTED[name]
    if isinstance(metrics, dict):
        metrics = metrics[suffix]
    model = keras.saving.load_model(FIXTURES / f"{name}{suffix}")
    optimizer = model.optimizer
    assert type(optimizer).__name__ == outer
    inner_optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    assert type(inner_optimizer).__name__ == inner
    assert type(model.loss).__name__ == loss
    config = model.loss.get_config()
    assert config["reduction"] == "sum_over_batch_size"
    assert loss_config.items() <= config.items()
    learning_rate = inner_optimizer._learning_rate
    assert type(learning_rate).__name__ == schedule[0]
    assert schedule[1].items() <= learning_rate.get_config().items()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 4)).astype("float32")
    y = np.eye(3, dtype="float32")[[0, 1, 2, 0]]
    logs = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    # tf-keras trained two steps; this is the third.
    assert int(inner_optimizer.iterations) == 3
    assert np.isfinite(logs["loss"][0])
    assert metrics <= set(logs), sorted(logs)
    for weight in model.weights:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(weight)))
