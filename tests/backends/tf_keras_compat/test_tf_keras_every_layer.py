"""Every layer class of tf.keras 2 and Keras 3, as tf-keras saved it.

tests/fixtures/tf_keras2/every_layer holds, for mixed_float16 and
mixed_bfloat16, one small model per layer class that tf-keras 2.21's
`tf_keras.layers` and Keras 3's `keras.layers` both export, saved by
tf-keras with `model.save("x.h5")`, and its predictions at save time
(every_layer_fixtures.py). Each loads here through Keras' own .h5 loader,
keeps the policy of every layer as saved, and predicts what tf-keras
predicted within the noise of the compute dtype.

Classes of both libraries not built on their own are in the manifest's
`not_built`, with the reason; classes tf-keras has and Keras 3 does not
(`tf_keras_only`: LocallyConnected1D/2D, RandomHeight, RandomWidth,
ThresholdedReLU, DenseFeatures, AbstractRNNCell) cannot load anywhere.
"""

import gzip
import importlib.util
import io
import json
import pathlib

import h5py
import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy
from keras_dtype_policy import DTypePolicy
from keras_dtype_policy.tf_keras_compat import layer_arguments

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tf_keras2"
)
EVERY_LAYER = FIXTURES / "every_layer"
MANIFEST = json.loads((EVERY_LAYER / "manifest.json").read_text())
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# Every class under both policies in the full runs (`tox -e full-jax`).
# The default runs load each class once, the policies taking turns along
# the sorted class list, and Normalization (whose statistics tf.keras wrote
# to HDF5 as bfloat16) under both; the other half is marked slow. Those
# cases rotate across the backends in the default runs (each on one
# backend; `rotated` in conftest.py): what they check, the translation of
# tf.keras 2's config and weights, is the same code on every backend.
CLASSES = sorted(MANIFEST["classes"])


def runs_by_default(name, policy):
    if name == "Normalization":
        return True
    turn = MANIFEST["policies"][CLASSES.index(name) % 2]
    return policy == turn


CASES = [
    pytest.param(
        name,
        policy,
        marks=(pytest.mark.rotated,)
        if runs_by_default(name, policy)
        else (pytest.mark.slow,),
    )
    for policy in MANIFEST["policies"]
    for name in MANIFEST["classes"]
]
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None

# Keras 3 runs these on TensorFlow's ops whatever the backend (they say
# "requires TensorFlow" when it is not installed: the jax and torch test
# environments); they take strings or hash, which no other backend does.
NEEDS_TENSORFLOW = {
    "HashedCrossing",
    "Hashing",
    "IntegerLookup",
    "StringLookup",
    "TextVectorization",
}
# Layers whose Keras 3 computation differs from tf-keras' by more than
# rounding, and why; compared with a looser tolerance (ulps of the
# compute dtype).
LOOSER = {
    # A recurrence of convolutions: float16 rounding compounds over the time
    # steps, and Keras 3 orders the gate arithmetic differently.
    "ConvLSTM2D": 32,
}
# Keras 3 treats a batch of scalars (shape (None,)) as one sample here:
# the model tf-keras built on scalar inputs does not rebuild.
SCALAR_INPUTS = {"Hashing"}
# (backend, class, policy): what the backend says when it has no CPU kernel
# for the layer in that dtype (tf-keras' own float16 3D pooling predictions
# were computed through XLA). The layer loads; calling it raises.
NO_CPU_KERNEL = {
    ("tensorflow", "AveragePooling3D", "mixed_float16"): "AvgPool3D",
    ("tensorflow", "MaxPooling3D", "mixed_float16"): "MaxPool3D",
    (
        "torch",
        "AveragePooling3D",
        "mixed_float16",
    ): "not implemented for 'Half'",
    ("torch", "AveragePooling3D", "mixed_bfloat16"): (
        "not implemented for 'BFloat16'"
    ),
}


@pytest.fixture(scope="module")
def saved():
    """{policy: (h5py.File of every class' model, predictions npz)}."""
    files = {}
    for policy in MANIFEST["policies"]:
        data = gzip.decompress((EVERY_LAYER / f"{policy}.h5.gz").read_bytes())
        files[policy] = (
            h5py.File(io.BytesIO(data), "r"),
            dict(np.load(EVERY_LAYER / f"{policy}.npz")),
        )
    yield files
    for h5, _ in files.values():
        h5.close()


def write_model_file(h5, name, path):
    """Writes one class' group back as the .h5 file tf-keras saved."""
    group = h5[name]
    with h5py.File(path, "w") as out:
        for key, value in group.attrs.items():
            out.attrs[key] = value
        for key in group:
            group.copy(group[key], out, name=key)


def saved_policies(model_config):
    """{layer name: policy name} as the saved model config gives them."""
    policies = {}
    for layer in model_config["config"]["layers"]:
        dtype = layer["config"].get("dtype")
        if isinstance(dtype, dict):
            dtype = dtype["config"]["name"]
        policies[layer["config"]["name"]] = dtype
    return policies


def inputs_of(arrays, name):
    xs = []
    while f"{name}.x{len(xs)}" in arrays:
        xs.append(arrays[f"{name}.x{len(xs)}"])
    return xs if len(xs) > 1 else xs[0]


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_loads_with_policies_and_predictions(saved, tmp_path, name, policy):
    h5, arrays = saved[policy]
    path = tmp_path / f"{name}.h5"
    write_model_file(h5, name, path)
    if name in NEEDS_TENSORFLOW and not HAS_TENSORFLOW:
        # Keras' loader wraps the ImportError in a TypeError.
        with pytest.raises((ImportError, TypeError), match="requires TensorF"):
            keras.saving.load_model(path)
        return
    if name in SCALAR_INPUTS:
        with pytest.raises(ValueError, match="expected min_ndim=2"):
            keras.saving.load_model(path)
        return
    model = keras.saving.load_model(path)
    missing_kernel = NO_CPU_KERNEL.get((keras.backend.backend(), name, policy))
    if missing_kernel:
        with pytest.raises(Exception, match=missing_kernel):
            model(inputs_of(arrays, name), training=False)
        return
    expected = saved_policies(json.loads(h5[name].attrs["model_config"]))
    for layer in model.layers:
        # An InputLayer's dtype is its input's, not a policy.
        if not isinstance(layer, keras.layers.InputLayer):
            assert layer.dtype_policy.name == expected[layer.name], layer.name
    ulps = LOOSER.get(name, 8)
    tolerance = ulps * EPSILON[DTypePolicy(policy).compute_dtype]
    y = arrays[f"{name}.y"]
    np.testing.assert_allclose(
        to_numpy(model(inputs_of(arrays, name), training=False)),
        y,
        rtol=tolerance,
        atol=tolerance * max(1.0, float(np.abs(y).max())),
    )


def test_covers_every_class_both_libraries_export():
    names = set((FIXTURES / "keras3_layer_names.txt").read_text().split())
    built = set(MANIFEST["classes"]) | set(MANIFEST["not_built"])
    assert built <= names
    # Every class Keras 3 exports under its own name that tf-keras has too
    # is built or has a reason; the rest are Keras 3 only.
    assert not set(MANIFEST["tf_keras_only"]) & names
    assert len(MANIFEST["classes"]) >= 100


def test_every_refused_key_is_in_the_table(saved):
    """The derivation script's findings, against the package's table."""
    spec = importlib.util.spec_from_file_location(
        "layer_arguments_script", FIXTURES / "layer_arguments.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    found = {}
    for h5, _ in saved.values():
        for group in h5.values():
            config = json.loads(group.attrs["model_config"])
            for class_name, inner in script.layer_configs(config):
                if class_name in NEEDS_TENSORFLOW and not HAS_TENSORFLOW:
                    continue
                cls = getattr(keras.layers, class_name, None)
                if cls is None:  # a tf.keras Policy, an initializer...
                    continue
                refused, _ = script.rejected_by_keras3(cls, inner)
                for key in refused:
                    found.setdefault(key, set()).add(class_name)
    # Handled outside the table: InputLayer's and the first layer's shape.
    found.pop("batch_input_shape", None)
    table = layer_arguments.UNUSED_ARGUMENTS
    for key, classes in found.items():
        assert key in table, key
        assert classes <= set(table[key][0]), key
    assert {"groups", "time_major", "rng_type"} <= set(found)


@pytest.mark.parametrize(
    ("class_name", "key", "value"),
    [
        ("LSTM", "time_major", True),
        ("DepthwiseConv2D", "groups", 2),
        ("SpatialDropout2D", "noise_shape", [None, 1, 1, 4]),
    ],
)
def test_an_argument_keras3_cannot_reproduce_fails_naming_it(
    class_name, key, value
):
    config = {
        "class_name": "Sequential",
        "config": {
            "name": "model",
            "layers": [
                {
                    "class_name": class_name,
                    "config": {"name": "odd", key: value},
                }
            ],
        },
        "keras_version": "2.21.0",
    }
    with pytest.raises(
        layer_arguments.UnsupportedLayerArgument,
        match=rf"'odd' \({class_name}\) was saved by tf.keras 2 with "
        rf"{key}=.*does not support",
    ):
        keras_dtype_policy.model_from_json(json.dumps(config))
