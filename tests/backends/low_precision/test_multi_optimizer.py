"""Keras' `MultiOptimizer` under every package policy (issue #46).

The compile hook wraps each sub-optimizer of a MultiOptimizer as a lone
optimizer would be wrapped under the model's policy (a
`LowPrecisionOptimizer` for the low-precision update policies), keeps
those already wrapped, and puts a `LossScaleOptimizer` around the whole
for float16. The issue's model (an Embedding and two Dense layers, the
embeddings on a plain Adam and the rest on an 8-bit stochastic-rounding
one) trains, saves and resumes exactly under each policy.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND

import keras_dtype_policy as kdp
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy import LowPrecisionOptimizer
from keras_dtype_policy.low_precision import state_sharding
from keras_dtype_policy.policies import names

pytestmark = pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason="keras.optimizers.MultiOptimizer arrived in Keras 3.15; "
    f"Keras {keras.__version__} is installed",
)

POLICIES = (
    "stochastic_bfloat16",
    "kahan_bfloat16",
    "mixed_bfloat16",
    "mixed_float16",
    "stochastic_float16",
    "kahan_bfloat16_8bit",
)
# Keras alone, on PyTorch, continues a mixed-precision Adam's embeddings
# from a `.keras` file 2.4e-6 away from the uninterrupted run (a plain
# `Adam`, no MultiOptimizer, measured on Keras 3.15.1): its float32
# weights and state load bit for bit, the next step does not.
KERAS_TORCH_EMBEDDING_RESUME = 1e-5


def make_model(policy):
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        inputs = keras.Input((4,), dtype="int32")
        x = keras.layers.Embedding(1000, 16, name="embedding")(inputs)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(128, name="dense_a")(x)
        outputs = keras.layers.Dense(1, name="dense_b")(x)
    return keras.Model(inputs, outputs)


def issue_optimizer():
    """The issue's MultiOptimizer: the embeddings on a plain Adam, the
    rest on an 8-bit stochastic-rounding one."""
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            LowPrecisionOptimizer(
                keras.optimizers.Adam(1e-2),
                update="stochastic_rounding",
                state_dtype="8bit",
                seed=1,
            ),
            {"embedding.*": keras.optimizers.Adam(1e-2)},
        )
    )


def data(samples=32):
    rng = np.random.RandomState(0)
    x = rng.randint(0, 1000, (samples, 4)).astype("int32")
    return x, rng.randn(samples, 1).astype("float32")


def as_numpy(values):
    return [
        keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")) for v in values
    ]


def multi_of(optimizer):
    """The MultiOptimizer inside a model's optimizer."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


@pytest.mark.parametrize("policy", POLICIES)
def test_compile_wraps_each_sub_optimizer_as_the_policy_asks(policy):
    model = make_model(policy)
    given = issue_optimizer()
    plain, wrapped_by_user = given.optimizers
    model.compile(given, "mse")
    multi = multi_of(model.optimizer)
    assert isinstance(multi, keras.optimizers.MultiOptimizer)
    assert isinstance(model.optimizer, LossScaleOptimizer) == (
        kdp.DTypePolicy(policy).compute_dtype == "float16"
    )
    second, first = multi.optimizers
    # The user's LowPrecisionOptimizer stays as it is.
    assert first is wrapped_by_user
    entry = names.LOW_PRECISION_UPDATE_POLICIES.get(policy)
    if entry is None:
        assert multi is given and second is plain
    else:
        weight_dtype, update, state_dtype = entry
        assert isinstance(second, LowPrecisionOptimizer)
        assert second.inner_optimizer is plain
        assert second.update_rule == update
        expected_state = state_dtype
        if state_dtype is None and weight_dtype == "float16":
            expected_state = "float32"
        assert second.state_dtype == expected_state
    # The compile config names the user's optimizer; loading wraps again.
    recorded = model._compile_config.config["optimizer"]
    assert recorded is given


# Half the policies in the default runs (the issue's failing
# stochastic_bfloat16, a loss scale around the MultiOptimizer, 8-bit
# state), for CI time; `tox -e full-<backend>` runs all six.
RESUMED_IN_FULL_RUNS = (
    "kahan_bfloat16",
    "mixed_bfloat16",
    "stochastic_float16",
)


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(p, marks=pytest.mark.slow)
        if p in RESUMED_IN_FULL_RUNS
        else p
        for p in POLICIES
    ],
)
def test_issue_model_trains_saves_and_resumes_exactly(policy, tmp_path):
    x, y = data()
    model = make_model(policy)
    model.compile(issue_optimizer(), "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    structure = [type(o) for o in multi_of(loaded.optimizer).optimizers]
    assert structure == [type(o) for o in multi_of(model.optimizer).optimizers]
    saved_state = as_numpy(model.optimizer.variables)
    loaded_state = as_numpy(loaded.optimizer.variables)
    assert len(saved_state) == len(loaded_state)
    for a, b in zip(saved_state, loaded_state, strict=True):
        np.testing.assert_array_equal(a, b)
    for each in (model, loaded):
        each.fit(x[:16], y[:16], batch_size=16, verbose=0, shuffle=False)
    continued, resumed = as_numpy(model.weights), as_numpy(loaded.weights)
    tolerance = 0.0
    if BACKEND == "torch" and policy.startswith("mixed_"):
        tolerance = KERAS_TORCH_EMBEDDING_RESUME
    for a, b in zip(continued, resumed, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=tolerance)
    # The step after loading trained (the loss is finite and moved).
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(
            as_numpy(model.weights), saved_weights(path), strict=True
        )
    )


def saved_weights(path):
    return as_numpy(keras.saving.load_model(path).weights)


def test_embedding_state_in_float32_beside_8bit_state():
    # The recipe of docs/low-precision-training.md.
    recipe = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            LowPrecisionOptimizer(
                keras.optimizers.Adam(), "stochastic_rounding", "8bit"
            ),
            {
                "embedding/.*": LowPrecisionOptimizer(
                    keras.optimizers.Adam(),
                    "stochastic_rounding",
                    state_dtype="float32",
                )
            },
        )
    )
    model = make_model("stochastic_bfloat16")
    model.compile(recipe, "mse")
    assert model.optimizer is recipe
    model.optimizer.build(model.trainable_variables)
    embeddings, rest = model.optimizer.optimizers
    slots = [
        v for v in embeddings.inner_optimizer.variables if len(v.shape) == 2
    ]
    assert [tuple(v.shape) for v in slots] == [(1000, 16)] * 2
    assert all(v.dtype == "float32" for v in slots)
    assert embeddings.quantized_slots == []
    # Adam's two slots of the (64, 128) kernel; smaller weights keep
    # float32 state (`MIN_QUANTIZED_SIZE`).
    assert len(rest.quantized_slots) == 2


def test_the_policy_gives_a_plain_sub_optimizer_its_state_dtype():
    # Under "stochastic_bfloat16" a plain Adam gets bfloat16 state, as a
    # lone Adam would.
    model = make_model("stochastic_bfloat16")
    model.compile(issue_optimizer(), "mse")
    model.optimizer.build(model.trainable_variables)
    embeddings = model.optimizer.optimizers[0]
    slots = [
        v for v in embeddings.inner_optimizer.variables if len(v.shape) == 2
    ]
    assert slots and all(v.dtype == "bfloat16" for v in slots)


def test_a_callable_selector_is_wrapped_too():
    shared = keras.optimizers.Adam(1e-2)
    embeddings = keras.optimizers.SGD(1e-2)

    def select(variable):
        return embeddings if "embedding" in variable.path else shared

    model = make_model("kahan_bfloat16")
    model.compile(keras.optimizers.MultiOptimizer(select), "mse")
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0)
    subs = model.optimizer.optimizers
    assert {type(o) for o in subs} == {LowPrecisionOptimizer}
    assert {id(o.inner_optimizer) for o in subs} == {
        id(shared),
        id(embeddings),
    }


def test_a_callable_making_new_optimizers_is_wrapped_once_a_variable():
    # Keras' docstring's callable: a new optimizer at every call.
    def select(variable):
        if "embedding" in variable.path:
            return keras.optimizers.Adam(1e-2)
        return keras.optimizers.SGD(1e-2)

    model = make_model("stochastic_bfloat16")
    model.compile(keras.optimizers.MultiOptimizer(select), "mse")
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0)
    subs = model.optimizer.optimizers
    assert len(subs) == len(model.trainable_variables)
    assert {type(o) for o in subs} == {LowPrecisionOptimizer}


def test_an_already_wrapped_multi_optimizer_is_kept():
    given = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            LowPrecisionOptimizer(keras.optimizers.Adam()),
            {"embedding.*": LowPrecisionOptimizer(keras.optimizers.SGD())},
        )
    )
    model = make_model("stochastic_bfloat16")
    model.compile(given, "mse")
    assert model.optimizer is given


def test_a_loss_scale_optimizer_inside_is_refused_at_compile():
    given = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.Adam(),
            {"embedding.*": LossScaleOptimizer(keras.optimizers.Adam())},
        )
    )
    model = make_model("mixed_float16")
    with pytest.raises(ValueError, match="goes around a MultiOptimizer"):
        model.compile(given, "mse")


def test_a_loss_scale_optimizer_no_variable_reaches_is_left_to_keras():
    # Keras alone checks only the sub-optimizers its variables get.
    given = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.Adam(),
            {"no_such_layer/.*": LossScaleOptimizer(keras.optimizers.Adam())},
        )
    )
    model = make_model("float32")
    model.compile(given, "mse")
    x, y = data()
    model.fit(x, y, batch_size=16, verbose=0)
    assert model.optimizer is given


def test_a_low_precision_optimizer_around_one_is_refused():
    multi = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(keras.optimizers.Adam())
    )
    with pytest.raises(TypeError, match="goes inside a MultiOptimizer"):
        LowPrecisionOptimizer(multi)


def test_a_trained_multi_optimizer_cannot_be_wrapped_again():
    x, y = data()
    model = make_model("float32")
    given = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(keras.optimizers.Adam())
    )
    model.compile(given, "mse")
    model.fit(x, y, verbose=0)
    again = make_model("kahan_bfloat16")
    with pytest.raises(ValueError, match="already trained"):
        again.compile(given, "mse")


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution is JAX's")
def test_shard_optimizer_state_reaches_the_sub_optimizers():
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        given = kdp.shard_optimizer_state(issue_optimizer())
        model = make_model("stochastic_bfloat16")
        model.compile(given, "mse")
        model.optimizer.build(model.trainable_variables)
    finally:
        keras.distribution.set_distribution(None)
    routed = model.optimizer
    assert routed is not given
    for optimizer in (routed, *routed.optimizers):
        assert state_sharding.shards_state(optimizer), optimizer.name
    for sub in routed.optimizers:
        assert state_sharding.shards_state(sub.inner_optimizer)


# The package's short form: one LowPrecisionOptimizer whose `state_dtype`
# maps variable paths to dtypes. It needs no MultiOptimizer (nor Keras
# 3.15); the tests below run on every Keras the package supports.
SHORT_FORM = {"embedding/.*": "float32", ".*": "8bit"}


def short_form_optimizer(state_dtype=None):
    return LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2),
        "stochastic_rounding",
        state_dtype=SHORT_FORM if state_dtype is None else state_dtype,
        seed=1,
    )


def test_short_form_decides_per_variable_path():
    model = make_model("stochastic_bfloat16")
    model.compile(short_form_optimizer(), "mse")
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    embedding_slots = [
        v
        for v in optimizer.inner_optimizer.variables
        if tuple(v.shape) == (1000, 16)
    ]
    assert len(embedding_slots) == 2
    assert all(v.dtype == "float32" for v in embedding_slots)
    # The (64, 128) kernel's two slots are 8-bit; the rest is too small.
    assert len(optimizer.quantized_slots) == 2
    assert optimizer.state_dtype == SHORT_FORM


def test_short_form_state_dtype_for():
    from keras_dtype_policy.low_precision import arguments

    mapping = arguments.check_state_dtype(
        {"dense_a/kernel": "bfloat16", "dense.*": "8bit", "emb.*": None}
    )
    assert arguments.state_dtype_for(mapping, "dense_a/kernel") == "bfloat16"
    assert arguments.state_dtype_for(mapping, "dense_a/bias") == "8bit"
    assert arguments.state_dtype_for(mapping, "embedding/embeddings") is None
    # A regex matches the whole path, as OptimizerMap's keys do.
    assert arguments.state_dtype_for(mapping, "x/dense_a/bias") is None
    assert arguments.state_dtype_for("8bit", "anything") == "8bit"


@pytest.mark.parametrize(
    "state_dtype, error, fragment",
    [
        ({"emb.*": "int8"}, ValueError, "Received: state_dtype['emb.*']="),
        ({"emb.*": 8}, TypeError, "state_dtype['emb.*']=8 (of type int)"),
        ({"emb[": "8bit"}, ValueError, "state_dtype key 'emb['"),
        ({3: "8bit"}, TypeError, "state_dtype key 3 (of type int)"),
        (["8bit"], TypeError, "or a dict from variable-path regexes"),
    ],
)
def test_short_form_errors_name_the_argument(state_dtype, error, fragment):
    with pytest.raises(error) as raised:
        short_form_optimizer(state_dtype)
    assert fragment in str(raised.value)


def test_short_form_config_round_trip_and_resume(tmp_path):
    from testing import assert_serialization_round_trip

    revived = assert_serialization_round_trip(short_form_optimizer())
    assert revived.state_dtype == SHORT_FORM
    assert list(revived.state_dtype) == list(SHORT_FORM)
    x, y = data()
    model = make_model("stochastic_bfloat16")
    model.compile(short_form_optimizer(), "mse")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.state_dtype == SHORT_FORM
    for each in (model, loaded):
        each.fit(x[:16], y[:16], batch_size=16, verbose=0, shuffle=False)
    for a, b in zip(
        as_numpy(model.weights), as_numpy(loaded.weights), strict=True
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["kahan_bfloat16_8bit", "mixed_float16"])
def test_weights_file_resumes_exactly(policy, tmp_path):
    x, y = data()
    model = make_model(policy)
    model.compile(issue_optimizer(), "mse")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.save_weights(tmp_path / "run.weights.h5")
    # Built and compiled like the first, then loaded before any step.
    resumed = make_model(policy)
    resumed.compile(issue_optimizer(), "mse")
    resumed.load_weights(tmp_path / "run.weights.h5")
    for each in (model, resumed):
        each.fit(x[:16], y[:16], batch_size=16, verbose=0, shuffle=False)
    for a, b in zip(
        as_numpy(model.weights), as_numpy(resumed.weights), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def sub_optimizers(model):
    return {
        f"sub_optimizer_{index}": optimizer
        for index, optimizer in enumerate(multi_of(model.optimizer).optimizers)
    }


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.train.Checkpoint is TensorFlow's"
)
@pytest.mark.parametrize("policy", ["stochastic_bfloat16", "mixed_float16"])
def test_tf_checkpoint_resumes_exactly_with_the_sub_optimizers_named(
    policy, tmp_path
):
    import tensorflow as tf

    x, y = data()
    model = make_model(policy)
    model.compile(issue_optimizer(), "mse")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    # Keras' MultiOptimizer does not track its sub-optimizers for
    # TensorFlow (Keras 3.15.1, with or without the package): a checkpoint
    # of `optimizer=` alone holds none of their state. Named beside it,
    # they are written and read.
    path = tf.train.Checkpoint(
        model=model, optimizer=model.optimizer, **sub_optimizers(model)
    ).write(str(tmp_path / "run"))
    resumed = make_model(policy)
    resumed.compile(issue_optimizer(), "mse")
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(
        model=resumed, optimizer=resumed.optimizer, **sub_optimizers(resumed)
    ).read(path).assert_consumed()
    for each in (model, resumed):
        each.fit(x[:16], y[:16], batch_size=16, verbose=0, shuffle=False)
    for a, b in zip(
        as_numpy(model.weights), as_numpy(resumed.weights), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # Keras' limit, kept in view: without the names, the sub-optimizers'
    # step counts are not restored.
    path = tf.train.Checkpoint(optimizer=model.optimizer).write(
        str(tmp_path / "optimizer_alone")
    )
    again = make_model(policy)
    again.compile(issue_optimizer(), "mse")
    again.optimizer.build(again.trainable_variables)
    tf.train.Checkpoint(optimizer=again.optimizer).read(path)
    counts = [
        int(o.iterations.numpy()) for o in multi_of(again.optimizer).optimizers
    ]
    assert counts == [0, 0]


def test_exported_for_serving_computes_what_the_model_does(tmp_path):
    x, y = data()
    model = make_model("kahan_bfloat16_8bit")
    model.compile(issue_optimizer(), "mse")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    if BACKEND == "torch":
        import torch

        kdp.export_for_serving(
            model,
            tmp_path / "served.pt2",
            format="torch",
            policy="float32",
            input_signature=[keras.InputSpec(shape=x.shape, dtype="int32")],
        )
        program = torch.export.load(str(tmp_path / "served.pt2")).module()
        with torch.no_grad():
            served = program(torch.from_numpy(x)).numpy()
    else:
        tf = pytest.importorskip(
            "tensorflow",
            reason="Keras exports a SavedModel from JAX through jax2tf, which "
            "needs TensorFlow; this environment has none",
        )
        kdp.export_for_serving(model, tmp_path / "served", policy="float32")
        loaded = tf.saved_model.load(str(tmp_path / "served"))
        served = loaded.serve(tf.constant(x)).numpy()
    # Served in float32 from the bfloat16 weights (Kahan compensation
    # added): within bfloat16's rounding of the bfloat16 model.
    predicted = as_numpy([model.predict(x, verbose=0)])[0]
    np.testing.assert_allclose(served, predicted, rtol=3e-2, atol=3e-2)
