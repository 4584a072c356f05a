"""Trains under tf.distribute in a process of its own; see
test_distribution_tensorflow.py.

Usage:
    python tf_distribution_worker.py mirrored OUT_DIR [CASES]
    python tf_distribution_worker.py multiworker OUT_DIR [CASES]
        (TF_CONFIG set; CASES: `policy-mode` cases, comma-separated)

`mirrored` splits this process' CPU into two logical devices (before
TensorFlow initialises) and trains each case with `model.fit`: on one device,
with `MirroredStrategy` over both (with and without `jit_compile=True`), and,
as a control, with Keras' own `LossScaleOptimizer` under the same strategy;
then once more in a custom loop under the strategy. `multiworker` trains
each case in the same custom loop with `MultiWorkerMirroredStrategy`, one
replica in each of two processes (Keras 3's `fit` fails under that strategy
before the first step, with or without this package: keras-team/keras#20585).
Either way it writes OUT_DIR/<engine>[-<worker>].npz and stops by itself.
"""

import faulthandler
import json
import os
import sys
import warnings

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# A stuck collective must not hang the test run: dump and exit instead.
faulthandler.dump_traceback_later(240, exit=True)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

ENGINE, OUT_DIR = sys.argv[1], sys.argv[2]
# The `policy-mode` cases to run (all, or those named in a third argument,
# comma-separated).
CASES = sys.argv[3].split(",") if len(sys.argv) > 3 else None
if ENGINE == "mirrored":
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    TAG = "mirrored"
else:
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=120
        )
    )
    TAG = f"multiworker-{json.loads(os.environ['TF_CONFIG'])['task']['index']}"

import keras  # noqa: E402

import keras_dtype_policy  # noqa: E402

warnings.simplefilter("ignore", keras_dtype_policy.SlowFloat16Warning)

GLOBAL_BATCH = 8
STEPS = 8
# The NaN sits at step 3, in the second half of the global batch: the second
# replica's share, never the first one's.
NAN_STEP, NAN_ROW = 3, 6
POLICIES = ("mixed_float16", "mixed_bfloat16")
MODES = ("dynamic", "fixed")


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 4)).astype("float32")
    y = rng.normal(size=(GLOBAL_BATCH * STEPS, 1)).astype("float32")
    x[GLOBAL_BATCH * NAN_STEP + NAN_ROW, 0] = np.nan
    return x, y


def make_dataset():
    x, y = make_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


def make_optimizer(mode, keras_own=False):
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    if keras_own:
        return keras.optimizers.LossScaleOptimizer(
            inner, initial_scale=64.0, dynamic_growth_steps=3
        )
    return keras_dtype_policy.LossScaleOptimizer(
        inner,
        dynamic=mode == "dynamic",
        initial_scale=64.0,
        # tf.keras' rule: a fixed scale takes no growth steps.
        dynamic_growth_steps=3 if mode == "dynamic" else None,
    )


def make_model(policy, mode, jit_compile=False, keras_own=False):
    keras.utils.set_random_seed(1)
    keras_dtype_policy.set_dtype_policy(policy)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(
            make_optimizer(mode, keras_own), "mse", jit_compile=jit_compile
        )
    model.compile_warnings = [str(w.message) for w in caught]
    return model


def replica_values(variable):
    """The value of `variable` on each replica of this process."""
    value = getattr(variable, "value", variable)
    return np.stack(
        [
            np.asarray(part)
            for part in STRATEGY.experimental_local_results(value)
        ]
    )


class RecordScale(keras.callbacks.Callback):
    """Records the scale on every local replica after each step."""

    def __init__(self):
        super().__init__()
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(replica_values(self.model.optimizer.dynamic_scale))


def train(model, record):
    callbacks = [RecordScale()] if record else []
    model.fit(
        make_dataset(), epochs=1, verbose=0, shuffle=False, callbacks=callbacks
    )
    return callbacks[0].scales if record else None


def train_in_loop(model):
    """Trains `model` in a custom loop under the strategy (`strategy.run`)."""
    optimizer = model.optimizer
    loss_fn = keras.losses.MeanSquaredError(reduction=None)
    if not optimizer.built:
        with STRATEGY.scope():
            optimizer.build(model.trainable_variables)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_sample = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(
                per_sample, global_batch_size=GLOBAL_BATCH
            )
            scaled_loss = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    @tf.function
    def train_step(x, y):
        STRATEGY.run(replica_step, args=(x, y))

    scales = []
    for x, y in STRATEGY.experimental_distribute_dataset(make_dataset()):
        train_step(x, y)
        scales.append(replica_values(optimizer.dynamic_scale))
    return scales


def results_of(model, prefix, results, scales=None):
    """Adds weights and loss-scale state, per local replica, to `results`."""
    optimizer = model.optimizer
    for i, weight in enumerate(model.trainable_weights):
        results[f"{prefix}/weight{i}"] = replica_values(weight)
    for name in ("dynamic_scale", "step_counter", "_skipped_step_counter"):
        if hasattr(optimizer, name):
            results[f"{prefix}/{name}"] = replica_values(
                getattr(optimizer, name)
            )
    results[f"{prefix}/iterations"] = replica_values(optimizer.iterations)
    if scales is not None:
        results[f"{prefix}/scales"] = np.stack(scales)


def reload_under_strategy(model, case, results):
    """Saves and reloads `model` in the strategy, then trains once more."""
    path = os.path.join(OUT_DIR, f"{TAG}-{case}.keras")
    model.save(path)
    with STRATEGY.scope():
        loaded = keras.saving.load_model(path)
    results[f"{case}/loaded/policies"] = np.array(
        [layer.dtype_policy.name for layer in loaded.layers]
    )
    results[f"{case}/loaded/optimizer"] = np.array(
        type(loaded.optimizer).__name__
    )
    results_of(loaded, f"{case}/loaded", results)
    if ENGINE == "mirrored":
        scales = train(loaded, record=True)
    else:
        scales = train_in_loop(loaded)
    results_of(loaded, f"{case}/loaded-trained", results, scales)


def main():
    results = {}
    for policy in POLICIES:
        for mode in MODES:
            case = f"{policy}-{mode}"
            if CASES is not None and case not in CASES:
                continue
            if ENGINE == "mirrored":
                single = make_model(policy, mode)
                scales = train(single, record=True)
                results_of(single, f"{case}/single", results, scales)
                with STRATEGY.scope():
                    control = make_model(policy, mode, keras_own=True)
                train(control, record=False)
                results_of(control, f"{case}/keras_own", results)
                with STRATEGY.scope():
                    xla = make_model(policy, mode, jit_compile=True)
                results[f"{case}/xla/jit_compile"] = np.array(xla.jit_compile)
                results[f"{case}/xla/warnings"] = np.array(
                    xla.compile_warnings or [""]
                )
                scales = train(xla, record=True)
                results_of(xla, f"{case}/xla", results, scales)
                with STRATEGY.scope():
                    model = make_model(policy, mode)
                scales = train(model, record=True)
                results_of(model, f"{case}/mirrored", results, scales)
                reload_under_strategy(model, case, results)
            with STRATEGY.scope():
                looped = make_model(policy, mode)
            scales = train_in_loop(looped)
            results_of(looped, f"{case}/{ENGINE}-loop", results, scales)
            if ENGINE == "multiworker":
                reload_under_strategy(looped, case, results)
    np.savez(os.path.join(OUT_DIR, f"{TAG}.npz"), **results)


if __name__ == "__main__":
    main()
    faulthandler.cancel_dump_traceback_later()
