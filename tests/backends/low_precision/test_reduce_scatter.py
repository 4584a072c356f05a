"""`shard_optimizer_state(model, reduce_scatter=True)`: ZeRO-1 whose
gradients are reduce-scattered, not all-reduced (JAX).

On JAX, `reduce_scatter_worker.py` runs on four forced host devices: the
same training as Keras' partitioned step, the collectives of both compiled
steps, a float16 overflow, dropout, what the step refuses, a saved run
resumed on one device, and `uninstall()`. The argument checks run on every
backend; TensorFlow and torch refuse the switch itself, as before.
"""

import pathlib

import keras
import pytest
from testing import BACKEND
from testing import run_json_worker

import keras_dtype_policy as kdp
from keras_dtype_policy import patches
from keras_dtype_policy.low_precision import scattered_gradients

pytestmark = pytest.mark.xdist_group("reduce_scatter")

WORKER = pathlib.Path(__file__).with_name("reduce_scatter_worker.py")
FAST_CASES = (
    "adam",
    "kahan_bfloat16_8bit",
    "overflow",
    "dropout",
    "refusals",
    "resume",
    "uninstall",
)
SLOW_CASES = ("lso_adam", "stochastic_bfloat16_4bit")
# Four Adam steps at 1e-2. float32 compute: bit for bit Keras' step (each
# device differentiates its share of the batch's mean, the part Keras'
# step sums, and the parts are summed in the same order). bfloat16
# compute: each device's gradient is rounded to bfloat16 before the four
# are summed (as torch's DistributedDataParallel sums them), where Keras'
# partitioned step may sum the float32 partial products first: one step's
# kernel gradients differ by about 2**-8 relatively, and Adam's
# normalisation turns that into at most a few 1e-2 steps of an element
# whose gradient is near zero (measured 0.0145 here).
WEIGHT_TOLERANCE = {
    "adam": 0.0,
    "lso_adam": 0.0,
    "kahan_bfloat16_8bit": 0.03,
    "stochastic_bfloat16_4bit": 0.03,
}

jax_only = pytest.mark.skipif(
    BACKEND != "jax",
    reason="keras.distribution's DataParallel step, which this replaces, "
    "is JAX's",
)


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    return run_json_worker(
        WORKER, tmp_path_factory.mktemp("reduce_scatter"), *FAST_CASES
    )


def check_against_keras_step(found, case):
    assert found["weight_difference"] <= WEIGHT_TOLERANCE[case]
    for ours, theirs in zip(
        found["losses"], found["keras_losses"], strict=True
    ):
        assert ours == pytest.approx(theirs, rel=1e-3)
    # Keras' step: the gradients' all-reduce (and a weight's all-gather).
    # This one: no all-reduce of anything but scalars (the loss, the
    # metrics, a loss scale's verdict); one reduce-scatter of each of the
    # four gradients, one all-gather of each updated weight.
    keras_step = found["keras_collectives"]
    assert keras_step["all-reduce"][1] >= 1
    assert "reduce-scatter" not in keras_step
    ours = found["collectives"]
    assert ours["all-reduce"][1] == 0
    assert ours["reduce-scatter"] == [4, 4]
    assert ours["all-gather"] == keras_step["all-gather"]


@jax_only
@pytest.mark.parametrize("case", ["adam", "kahan_bfloat16_8bit"])
def test_trains_as_keras_step_with_a_reduce_scatter(findings, case):
    assert findings["devices"] == 4
    check_against_keras_step(findings[case], case)


@jax_only
def test_eight_bit_state_stays_eight_bit(findings):
    assert "int8" in findings["kahan_bfloat16_8bit"]["state_dtypes"]


@jax_only
@pytest.mark.slow
def test_loss_scale_and_four_bit_state(tmp_path):
    found = run_json_worker(WORKER, tmp_path, *SLOW_CASES)
    for case in SLOW_CASES:
        check_against_keras_step(found[case], case)
    assert "int8" in found["stochastic_bfloat16_4bit"]["state_dtypes"]


@jax_only
def test_an_overflow_on_one_device_skips_the_step_everywhere(findings):
    found = findings["overflow"]
    assert found["unchanged"] and found["finite"]
    assert found["scale_ratio"] == 0.5


@jax_only
def test_each_device_draws_its_own_dropout_mask(findings):
    found = findings["dropout"]
    # The four devices see the same eight rows: with one mask for all,
    # their outputs would be equal.
    assert all(gap > 0.1 for gap in found["gap"])
    # The seed advances as Keras advances it: once a step (two steps an
    # epoch, three epochs), its first word, the seed, unchanged.
    seed, initial = found["seed"], found["initial_seed"]
    assert seed == [initial[0], initial[1] + 3]


@jax_only
def test_refuses_what_it_cannot_do_naming_it(findings):
    found = findings["refusals"]
    assert found["batch_norm"].startswith("ValueError")
    assert "moving_mean" in found["batch_norm"]
    assert found["optimizer"].startswith("TypeError")
    assert "pass the compiled model" in found["optimizer"]
    assert found["own_step"].startswith("ValueError")
    assert "OwnStep" in found["own_step"]
    assert not found["own_step_installed"]
    assert found["model_parallel"].startswith("ValueError")
    assert "'model'" in found["model_parallel"]


@jax_only
def test_saved_run_loads_on_one_device_and_trains_on(findings):
    found = findings["resume"]
    assert found["state_equal"]
    # The step is not saved: the loaded model trains with Keras' own.
    assert not found["loaded_has_step"]
    # Summed over one device instead of four: bfloat16 steps apart.
    assert found["weight_difference"] <= 2.0**-8


@jax_only
def test_uninstall_takes_the_step_off(findings):
    found = findings["uninstall"]
    assert found["before"] and not found["after"]
    assert found["keras_step"]


def test_the_step_is_listed_among_the_instance_patches():
    (patch,) = [
        p
        for p in patches.INSTANCE_PATCHES
        if p.attributes == scattered_gradients.SCATTER_METHODS
    ]
    assert patch.undo is scattered_gradients.remove_all


def test_arguments_are_checked_on_every_backend():
    optimizer = keras.optimizers.Adam()
    with pytest.raises(TypeError, match="reduce_scatter='yes'"):
        kdp.shard_optimizer_state(optimizer, reduce_scatter="yes")
    with pytest.raises(TypeError, match="pass the compiled model"):
        kdp.shard_optimizer_state(optimizer, reduce_scatter=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="compile the model first"):
        kdp.shard_optimizer_state(model, reduce_scatter=True)


@pytest.mark.skipif(BACKEND == "jax", reason="the other backends' answer")
def test_other_backends_refuse_the_switch():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(), "mse")
    # TensorFlow and a Keras release's torch refuse sharding itself;
    # keras-nightly's torch refuses the JAX step.
    with pytest.raises((NotImplementedError, ValueError)):
        kdp.shard_optimizer_state(model, reduce_scatter=True)
    assert not scattered_gradients.installed(model)
    assert "train_step" not in vars(model)
