"""The demo: a short mixed-precision training run that shows its policies."""

import keras
import numpy as np

from keras_dtype_policy.global_policy import policy_scope


def build_model(num_features, num_classes):
    """Returns a small MLP whose output layer computes in float32."""
    return keras.Sequential(
        [
            keras.Input((num_features,)),
            keras.layers.Dense(64, activation="relu", name="hidden_1"),
            keras.layers.Dense(64, activation="relu", name="hidden_2"),
            keras.layers.Dense(num_classes, name="logits"),
            # Softmax in float32 for numeric stability, as the seeds advise.
            keras.layers.Activation("softmax", dtype="float32", name="probs"),
        ],
        name="demo_mlp",
    )


def make_data(num_samples=2048, num_features=20, num_classes=4, seed=0):
    """Returns a learnable synthetic classification task `(x, y)`."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=2.0, size=(num_classes, num_features))
    y = rng.integers(0, num_classes, size=num_samples)
    x = centers[y] + rng.normal(size=(num_samples, num_features))
    return x.astype("float32"), y.astype("int32")


def layer_table(model):
    """Returns the lines of a table of each layer's policy and dtypes."""
    rows = [("layer", "policy", "compute dtype", "variable dtype")]
    for layer in model.layers:
        policy = layer.dtype_policy
        rows.append(
            (
                layer.name,
                policy.name,
                policy.compute_dtype,
                policy.variable_dtype,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def run_demo(policy="mixed_bfloat16", epochs=3, verbose=1, print_fn=print):
    """Trains the demo model under `policy` and prints what happened.

    Args:
        policy: The global policy to train under.
        epochs: The number of epochs.
        verbose: Keras' verbosity for `fit`.
        print_fn: Where the report lines go.

    Returns:
        The Keras `History` of the run.
    """
    x, y = make_data()
    keras.utils.set_random_seed(0)
    with policy_scope(policy):
        model = build_model(x.shape[1], int(y.max()) + 1)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    print_fn(f"backend: {keras.backend.backend()}    policy: {policy}")
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=verbose)
    print_fn("")
    for line in layer_table(model):
        print_fn(line)
    print_fn("")
    print_fn(f"optimizer: {type(model.optimizer).__name__}")
    if hasattr(model.optimizer, "loss_scale"):
        print_fn(f"loss scale: {model.optimizer.loss_scale}")
    for epoch, loss in enumerate(history.history["loss"], start=1):
        print_fn(f"epoch {epoch}: loss {loss:.4f}")
    return history
