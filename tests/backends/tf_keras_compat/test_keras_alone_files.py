"""Files Keras alone opens (issue #45, point 3), on every backend.

`save_for_keras` writes a model trained under the package's policies as a
file that Keras alone, in a process that never imports the package
(`keras_alone_worker.py`), loads with the same predictions bit for bit,
the optimizer state dequantized, and trains on. The reverse: a file Keras
alone trained, loaded by `kdp.load_model(path, policy=...)` into the
package's configurations with its state quantized, not restarted.
"""

import json
import pathlib

import keras
import ml_dtypes
import numpy as np
import pytest
from testing import call_cli
from testing import run_json_worker
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import compensated_updates

# One xdist worker takes the whole module (`--dist loadgroup`), so its
# module fixture, which trains and saves for a while, runs once a run.
pytestmark = pytest.mark.xdist_group("keras_alone_files")

WORKER = pathlib.Path(__file__).with_name("keras_alone_worker.py")
# The three policies, a 4-bit one, and a float16 one (loss scaled).
POLICIES = {
    "kahan_bfloat16": ("bfloat16", "Adam"),
    "stochastic_bfloat16_8bit": ("bfloat16", "Adam"),
    "kahan_bfloat16_8bit": ("bfloat16", "Adam"),
    "kahan_bfloat16_4bit": ("bfloat16", "Adam"),
    "kahan_float16": ("float16", "LossScaleOptimizer"),
}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return x, y


def package_model(policy, optimizer=None):
    """A model whose first Dense (8192 weights: coded state) trains under
    `policy`, its head in float32, with Adam (or `optimizer`)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu", dtype=policy),
            keras.layers.Dense(4, dtype="float32", name="head"),
        ],
        name="model",
    )
    model.compile(optimizer or keras.optimizers.Adam(0.01), "mse")
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return model


def optimizer_values(model):
    return [to_numpy(v).copy() for v in model.optimizer.variables]


def source_slots(model):
    """`{slot name: float32 value}` of a trained package model's state: the
    inner optimizer's slots, coded ones dequantized."""
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    inner = optimizer.inner_optimizer
    slots = {
        v.name: to_numpy(keras.ops.cast(v, "float32"))
        for v in inner.variables
        if v.name not in ("iteration", "learning_rate")
    }
    for slot in optimizer.quantized_slots:
        slots[slot.name] = to_numpy(slot.value)
    return slots, optimizer


def multi_optimizer_model():
    """A `kahan_bfloat16_8bit` model whose head trains on a Keras Adam of
    its own (Keras' `MultiOptimizer`; the compile hook wraps each
    sub-optimizer), or None before Keras 3.15."""
    if not hasattr(keras.optimizers, "MultiOptimizer"):
        return None
    keras.utils.clear_session()
    return package_model(
        "kahan_bfloat16_8bit",
        keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(
                keras.optimizers.Adam(0.01),
                {".*head/.*": keras.optimizers.Adam(0.02)},
            )
        ),
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The package's models, their files for Keras alone, what Keras alone
    read from them, and the files Keras alone trained."""
    work_dir = tmp_path_factory.mktemp("keras_alone")
    x, y = data()
    np.save(work_dir / "x.npy", x)
    np.save(work_dir / "y.npy", y)
    models = {}
    for policy in POLICIES:
        keras.utils.clear_session()
        model = package_model(policy)
        weights = [to_numpy(w).copy() for w in model.weights]
        state = optimizer_values(model)
        compile_config = model.get_compile_config()
        path = work_dir / f"exported_{policy}.keras"
        assert kdp.save_for_keras(model, path) == path
        assert model.get_compile_config() == compile_config
        assert isinstance(model.optimizer, keras.optimizers.Optimizer)
        assert type(model.layers[0].dtype_policy) is kdp.DTypePolicy
        # The model itself is as it was.
        for before, after in zip(weights, model.weights, strict=True):
            np.testing.assert_array_equal(before, to_numpy(after))
        for before, after in zip(state, optimizer_values(model), strict=True):
            np.testing.assert_array_equal(before, after)
        models[policy] = (model, to_numpy(model.predict(x, verbose=0)))
    keras.utils.clear_session()
    mixed = package_model("kahan_bfloat16")
    kdp.save_for_keras(
        mixed, work_dir / "exported_as_mixed.keras", policy="mixed_bfloat16"
    )
    models["as_mixed"] = (mixed, None)
    keras.utils.clear_session()
    fixed = package_model(
        "kahan_float16",
        kdp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), dynamic=False, initial_scale=128.0
        ),
    )
    kdp.save_for_keras(fixed, work_dir / "exported_fixed_scale.keras")
    models["fixed_scale"] = (fixed, to_numpy(fixed.predict(x, verbose=0)))
    multi = multi_optimizer_model()
    if multi is not None:
        kdp.save_for_keras(multi, work_dir / "exported_multi.keras")
        models["multi"] = (multi, to_numpy(multi.predict(x, verbose=0)))
    result = run_json_worker(WORKER, work_dir)
    assert result["package_imported"] is False
    assert sorted(result["read"]) == sorted(models)
    return work_dir, models


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_keras_alone_predicts_bit_for_bit_what_the_model_predicts(
    exported, policy
):
    work_dir, models = exported
    read = np.load(work_dir / f"read_{policy}.npz")
    weight_dtype, optimizer_class = POLICIES[policy]
    assert json.loads(str(read["policies"])) == {
        "dense": weight_dtype,
        "head": "float32",
    }
    assert str(read["optimizer"]) == optimizer_class
    _, predictions = models[policy]
    np.testing.assert_array_equal(read["predictions"], predictions)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_keras_alone_gets_the_dequantized_state_and_trains_on(exported, policy):
    work_dir, models = exported
    read = np.load(work_dir / f"read_{policy}.npz")
    model, _ = models[policy]
    slots, low_precision = source_slots(model)
    iterations = int(to_numpy(low_precision.iterations))
    assert int(read["iterations"]) == iterations > 0
    found = {
        key.split("/")[-1]: read[key]
        for key in read.files
        if key.startswith("slot:adam/")
        and not key.endswith("iteration")
        and not key.endswith("learning_rate")
    }
    # Keras alone names a slot after its weight's path, which a loaded
    # model gives without the model's name: matched by their ends.
    pairs = {
        name: [ours for ours in slots if ours.endswith("_" + name)]
        for name in found
    }
    assert all(len(ours) == 1 for ours in pairs.values()), pairs
    assert len(found) == len(slots)
    for name, (ours,) in pairs.items():
        dtype = str(read[f"dtype:adam/{name}"])
        # Keras keeps a slot in its weight's dtype: the dequantized value
        # rounded to nearest there.
        expected = slots[ours].astype(_numpy_dtype(dtype)).astype("float32")
        np.testing.assert_array_equal(found[name], expected, err_msg=name)
    if POLICIES[policy][1] == "LossScaleOptimizer":
        scale = model.optimizer.dynamic_scale
        assert float(read["slot:loss_scale_optimizer/dynamic_scale"]) == (
            float(to_numpy(scale))
        )
    assert np.isfinite(float(read["loss"]))
    trained = int(read["trained_iterations"])
    if POLICIES[policy][1] == "LossScaleOptimizer":
        # A step whose float16 gradients overflow is skipped, not counted.
        assert iterations < trained <= iterations + 4
    else:
        assert trained == iterations + 4


def test_a_multi_optimizer_becomes_keras_own_with_each_state(exported):
    work_dir, models = exported
    if "multi" not in models:
        pytest.skip("keras.optimizers.MultiOptimizer arrived in Keras 3.15")
    model, predictions = models["multi"]
    read = np.load(work_dir / "read_multi.npz")
    assert str(read["optimizer"]) == "MultiOptimizer"
    np.testing.assert_array_equal(read["predictions"], predictions)
    # Each sub-optimizer's slots, dequantized, under Keras' Adam names.
    slots = {}
    subs = model.optimizer.optimizers
    # The compile hook wrapped both under the model's policy.
    assert len(subs) == 2
    assert all(isinstance(sub, kdp.LowPrecisionOptimizer) for sub in subs)
    for sub in subs:
        coded = {
            slot.name: to_numpy(slot.value) for slot in sub.quantized_slots
        }
        for variable in sub.inner_optimizer.variables:
            if variable.name not in ("iteration", "learning_rate"):
                slots[variable.name] = to_numpy(
                    keras.ops.cast(variable, "float32")
                )
        slots.update(coded)
    found = {
        key[len("slot:") :]: read[key]
        for key in read.files
        if key.startswith("slot:")
        and not key.endswith(("iteration", "learning_rate"))
    }
    assert len(found) == len(slots)
    for path, value in found.items():
        (ours,) = [n for n in slots if n.endswith("_" + path.split("/")[-1])]
        expected = slots[ours].astype(_numpy_dtype(str(read[f"dtype:{path}"])))
        np.testing.assert_array_equal(value, expected.astype("float32"))
    iterations = int(to_numpy(model.optimizer.iterations))
    assert int(read["iterations"]) == iterations > 0
    assert int(read["trained_iterations"]) == iterations + 4
    assert np.isfinite(float(read["loss"]))


def test_a_multi_optimizer_with_a_callable_is_refused(tmp_path):
    if not hasattr(keras.optimizers, "MultiOptimizer"):
        pytest.skip("keras.optimizers.MultiOptimizer arrived in Keras 3.15")
    plain = keras.optimizers.Adam(0.01)
    model = package_model(
        "kahan_bfloat16", keras.optimizers.MultiOptimizer(lambda v: plain)
    )
    with pytest.raises(ValueError, match="OptimizerMap"):
        kdp.save_for_keras(model, tmp_path / "model.keras")
    assert not (tmp_path / "model.keras").exists()


def test_a_fixed_loss_scale_becomes_the_optimizers_loss_scale_factor(
    exported,
):
    work_dir, models = exported
    read = np.load(work_dir / "read_fixed_scale.npz")
    model, predictions = models["fixed_scale"]
    assert str(read["optimizer"]) == "Adam"
    assert float(read["loss_scale_factor"]) == 128.0
    assert int(read["iterations"]) == int(to_numpy(model.optimizer.iterations))
    np.testing.assert_array_equal(read["predictions"], predictions)
    assert np.isfinite(float(read["loss"]))


def test_a_mixed_policy_file_holds_weight_plus_compensation_exactly(
    exported,
):
    work_dir, models = exported
    read = np.load(work_dir / "read_as_mixed.npz")
    assert json.loads(str(read["policies"])) == {
        "dense": "mixed_bfloat16",
        "head": "float32",
    }
    model, _ = models["as_mixed"]
    alone = keras.saving.load_model(work_dir / "exported_as_mixed.keras")
    for weight, saved in zip(model.weights, alone.weights, strict=True):
        compensation = model.optimizer.compensation_of(weight)
        expected = to_numpy(keras.ops.cast(weight, "float32"))
        if compensation is not None:
            expected = to_numpy(
                compensated_updates.kahan_read(weight.value, compensation)
            )
            assert np.any(to_numpy(compensation) != 0)
        assert str(saved.dtype) == "float32"
        np.testing.assert_array_equal(to_numpy(saved), expected)


def test_folding_keeps_the_weight_at_a_tie_and_rounds_otherwise():
    weight = keras.ops.convert_to_tensor(
        np.array([1.0, 1.0, 1.0], dtype=ml_dtypes.bfloat16)
    )
    ulp = 2.0**-7
    compensation = keras.ops.convert_to_tensor(
        np.array([ulp / 2, ulp * 0.75, ulp / 4], dtype=ml_dtypes.bfloat16)
    )
    folded = to_numpy(compensated_updates.kahan_fold(weight, compensation))
    np.testing.assert_array_equal(
        folded.astype("float32"), [1.0, 1.0 + ulp, 1.0]
    )


@pytest.mark.parametrize(
    "policy", ["kahan_bfloat16_8bit", "stochastic_bfloat16_4bit"]
)
def test_a_keras_alone_file_comes_into_the_package_with_its_state(
    exported, policy
):
    work_dir, _ = exported
    path = work_dir / "alone_bfloat16.keras"
    alone = keras.saving.load_model(path)
    model = kdp.load_model(path, policy=policy)
    optimizer = model.optimizer
    assert isinstance(optimizer, kdp.LowPrecisionOptimizer)
    assert optimizer.state_dtype == policy.rsplit("_", 1)[1]
    assert int(to_numpy(optimizer.iterations)) == 8
    saved = {
        v.name: to_numpy(keras.ops.cast(v, "float32"))
        for v in alone.optimizer.variables
        if v.name not in ("iteration", "learning_rate")
    }
    coded = {slot.name: slot for slot in optimizer.quantized_slots}
    # The first kernel's moments are coded; smaller slots stay float32.
    assert sorted(coded) == sorted(n for n in saved if "dense_kernel" in n)
    assert len(coded) == 2
    for name, slot in coded.items():
        # Quantized to the nearer level, not restarted at zero.
        codes, scales = block_codes.quantize(saved[name], slot.code)
        expected = block_codes.dequantize(codes, scales, slot.code)
        np.testing.assert_array_equal(
            to_numpy(slot.value).reshape(-1), to_numpy(expected)
        )
    inner = {
        v.name: to_numpy(v)
        for v in optimizer.inner_optimizer.variables
        if v.name not in ("iteration", "learning_rate")
    }
    assert sorted(inner) == sorted(set(saved) - set(coded))
    for name, value in inner.items():
        np.testing.assert_array_equal(value, saved[name])
    for ours, theirs in zip(model.weights, alone.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(ours), to_numpy(theirs))
    x, y = data()
    np.testing.assert_array_equal(
        to_numpy(model.predict(x, verbose=0)),
        np.load(work_dir / "alone_bfloat16.npz")["predictions"],
    )
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert int(to_numpy(optimizer.iterations)) == 12


def test_float32_weights_come_in_as_bfloat16_weights_and_compensation(
    exported,
):
    work_dir, _ = exported
    path = work_dir / "alone_mixed_bfloat16.keras"
    alone = keras.saving.load_model(path)
    model = kdp.load_model(path, policy="kahan_bfloat16")
    optimizer = model.optimizer
    assert int(to_numpy(optimizer.iterations)) == 8
    dense = model.get_layer("dense")
    for weight, saved in zip(
        dense.weights, alone.get_layer("dense").weights, strict=True
    ):
        value = to_numpy(saved)
        assert str(weight.dtype) == "bfloat16"
        rounded = value.astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(to_numpy(weight), rounded)
        residual = value - rounded.astype("float32")
        np.testing.assert_array_equal(
            to_numpy(optimizer.compensation_of(weight)),
            residual.astype(ml_dtypes.bfloat16),
        )


def test_save_for_keras_refuses_bad_arguments(tmp_path):
    model = package_model("kahan_bfloat16")
    path = tmp_path / "model.keras"
    with pytest.raises(TypeError, match="Received: model='model'"):
        kdp.save_for_keras("model", path)
    with pytest.raises(TypeError, match="Received: path=3"):
        kdp.save_for_keras(model, 3)
    with pytest.raises(ValueError, match="must end in .keras"):
        kdp.save_for_keras(model, tmp_path / "model.h5")
    with pytest.raises(ValueError, match="policy='kahan_bfloat16'"):
        kdp.save_for_keras(model, path, policy="kahan_bfloat16")
    with pytest.raises(TypeError, match="Received: policy=16"):
        kdp.save_for_keras(model, path, policy=16)
    with pytest.raises(TypeError, match="Received: overwrite='yes'"):
        kdp.save_for_keras(model, path, overwrite="yes")
    path.write_text("keep me")
    with pytest.raises(ValueError, match="exists already"):
        kdp.save_for_keras(model, path, overwrite=False)
    assert path.read_text() == "keep me"
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built"):
        kdp.save_for_keras(unbuilt, tmp_path / "unbuilt.keras")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]


def test_an_uncompiled_model_is_saved_for_keras_without_optimizer(tmp_path):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, dtype="kahan_bfloat16")]
    )
    path = kdp.save_for_keras(model, tmp_path / "model.keras")
    loaded = keras.saving.load_model(path)
    assert type(loaded.layers[0].dtype_policy) is keras.DTypePolicy
    assert loaded.layers[0].dtype_policy.name == "bfloat16"
    assert not loaded.compiled


def test_migrate_to_keras_writes_a_file_keras_alone_loads(exported, tmp_path):
    work_dir, models = exported
    model, predictions = models["kahan_bfloat16_8bit"]
    source = tmp_path / "package.keras"
    model.save(source)
    target = tmp_path / "alone.keras"
    result = call_cli("migrate", source, target, "--to-keras")
    assert result.returncode == 0, result.stderr
    assert (
        'dense: policy keras_dtype_policy.DTypePolicy "kahan_bfloat16_8bit"'
        ' -> keras.DTypePolicy "bfloat16" (--to-keras)'
    ) in result.stdout
    assert "the optimizer is Keras' Adam" in result.stdout
    loaded = keras.saving.load_model(target)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert int(to_numpy(loaded.optimizer.iterations)) == 8
    x, _ = data()
    np.testing.assert_array_equal(
        to_numpy(loaded.predict(x, verbose=0)), predictions
    )


def _numpy_dtype(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
