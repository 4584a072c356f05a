"""The low-precision optimizer saved and resumed with TensorFlow's formats.

For every configuration of `tf_checkpoint_worker.CONFIGS` (Kahan and
stochastic rounding, bfloat16 or 8-/4-bit state, float32 weights with 8-bit
state, a loss-scale optimizer around a float16 one): `STEPS` steps of
`fit`, `tf.train.Checkpoint(model=, optimizer=).write`, then a fresh model
and optimizer (built, then `read`) trained `STEPS` more steps ends with
the weights and every optimizer variable of the run that went on, bit for
bit. The fresh objects are made in this process (each from its own
seeds, sharing nothing with the first run's); one configuration is also
resumed in a process of its own, as a user resumes. Also covered:
`tf.train.CheckpointManager`, a checkpoint of the model alone after `fit`,
and `model.export` served by `tf.saved_model.load`.

TensorFlow only: the other backends have neither `tf.train.Checkpoint`
nor `model.export`'s SavedModel.
"""

import dataclasses
import pathlib

import numpy as np
import pytest
import tf_checkpoint_worker as runs
from testing import BACKEND
from testing import run_json_worker

pytestmark = [
    # One xdist worker takes the module (`--dist loadgroup`): its module
    # fixture runs once a run.
    pytest.mark.xdist_group("tf_checkpoints"),
    pytest.mark.skipif(
        BACKEND != "tensorflow",
        reason="tf.train.Checkpoint and SavedModel export are TensorFlow's; "
        f"this run is on {BACKEND}",
    ),
    # The loss-scaled configuration trains float16 weights on a CPU.
    pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning"),
]

WORKER = pathlib.Path(runs.__file__)
EXPORTED = ("kahan_bfloat16", "stochastic_bfloat16_8bit")


@dataclasses.dataclass
class Run:
    """What a run of one configuration left.

    Attributes:
        state: Its weights and optimizer variables after 2 x `STEPS` steps.
        folder: Where it saved after `STEPS` steps: `checkpoint` (a
            `Checkpoint.write` of model and optimizer), `managed/` (a
            `CheckpointManager`'s), `model` (the model alone); `exported/`
            (`model.export`) after 2 x `STEPS` steps.
        weights: Its weights after `STEPS` steps.
        predictions: Its predictions of `runs.data()` at the end.
    """

    state: dict
    folder: pathlib.Path
    weights: list
    predictions: np.ndarray


def save_all(model, folder):
    import tensorflow as tf

    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.write(str(folder / "checkpoint"))
    tf.train.CheckpointManager(checkpoint, folder / "managed", 1).save()
    tf.train.Checkpoint(model=model).write(str(folder / "model"))


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """Per configuration, a `Run` of `STEPS` steps, saved, then `STEPS`
    more.

    Saving reads the state and changes nothing, so the run that saved
    stands for the uninterrupted one (`test_saving_changes_no_state`).
    """
    straight = {}
    for name, config in runs.CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        model = runs.new_model(config)
        runs.fit(model)
        save_all(model, folder)
        weights = [runs.bits(w) for w in model.weights]
        runs.fit(model)
        if name in EXPORTED:
            model.export(str(folder / "exported"), verbose=False)
            tf_saved_model_save(model, folder / "saved_model")
        predictions = model.predict(runs.data()[0], verbose=0)
        straight[name] = Run(runs.state(model), folder, weights, predictions)
    return straight


def tf_saved_model_save(model, folder):
    """`tf.saved_model.save` called directly, as tf.keras 2 code does."""
    import tensorflow as tf

    tf.saved_model.save(model, str(folder))


def assert_same_state(resumed, straight):
    assert sorted(resumed) == sorted(straight)
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


@pytest.mark.parametrize("name", sorted(runs.CONFIGS))
def test_resumed_run_equals_the_straight_run(straight_runs, name):
    run = straight_runs[name]
    model = runs.resumed_model(
        runs.CONFIGS[name], str(run.folder / "checkpoint")
    )
    runs.fit(model)
    assert_same_state(runs.state(model), run.state)


def test_resumed_in_a_fresh_process(straight_runs):
    name = "stochastic_bfloat16_8bit"
    run = straight_runs[name]
    result = run_json_worker(WORKER, name, run.folder)
    with np.load(result["state"]) as resumed:
        assert_same_state(dict(resumed), run.state)


def test_saving_changes_no_state(straight_runs):
    name = "stochastic_bfloat16"
    model = runs.new_model(runs.CONFIGS[name])
    runs.fit(model)
    runs.fit(model)
    assert_same_state(runs.state(model), straight_runs[name].state)


def test_checkpoint_manager_resumes(straight_runs):
    import tensorflow as tf

    name = "kahan_bfloat16_8bit"
    run = straight_runs[name]
    model = runs.new_model(runs.CONFIGS[name])
    model.optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(checkpoint, run.folder / "managed", 1)
    checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    runs.fit(model)
    assert_same_state(runs.state(model), run.state)


def test_checkpoint_of_the_model_alone_after_fit(straight_runs):
    # After `fit` the model reaches its built optimizer (`model.optimizer`)
    # and the float32 views the inner optimizer was built on.
    import tensorflow as tf

    name = "stochastic_bfloat16"
    run = straight_runs[name]
    model = runs.new_model(runs.CONFIGS[name])
    # The fresh optimizer is not built: its saved state is left unread.
    status = tf.train.Checkpoint(model=model).read(str(run.folder / "model"))
    status.expect_partial()
    for read, saved in zip(model.weights, run.weights, strict=True):
        np.testing.assert_array_equal(runs.bits(read), saved)


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_model_serves_its_predictions(straight_runs, name):
    import tensorflow as tf

    run = straight_runs[name]
    served = tf.saved_model.load(str(run.folder / "exported"))
    outputs = served.serve(runs.data()[0])
    assert outputs.dtype == tf.bfloat16
    # Both compute in bfloat16, whose precision is 2**-8.
    np.testing.assert_allclose(
        np.asarray(outputs, "float32"),
        np.asarray(run.predictions, "float32"),
        rtol=2**-6,
        atol=2**-6,
    )


@pytest.mark.parametrize("name", EXPORTED)
def test_tf_saved_model_save_serves_its_predictions(straight_runs, name):
    # The stand-ins export their own scalar storage, not their computed
    # value (which a SavedModel cannot capture).
    import tensorflow as tf

    run = straight_runs[name]
    loaded = tf.saved_model.load(str(run.folder / "saved_model"))
    serve = loaded.signatures["serving_default"]
    (outputs,) = serve(tf.constant(runs.data()[0])).values()
    np.testing.assert_array_equal(
        np.asarray(outputs, "float32"), np.asarray(run.predictions, "float32")
    )
