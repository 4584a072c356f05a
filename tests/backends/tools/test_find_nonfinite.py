"""`find_nonfinite`: the first layer, and the gradients, that overflow.

A `Dense` layer with large weights under mixed_float16 truly overflows
float16 (its products pass 65504) on every backend; the same model on
small inputs is finite. Gradients: a float32 `Dense` whose kernel is
1e-36 passes a batch of 1e36 forward finitely, but the gradient of that
kernel at a loss scale of 2**15 is beyond float32.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp

# float16 is slow on a CPU, and the package says so once per process;
# here float16 is the subject, not a choice.
pytestmark = pytest.mark.filterwarnings(
    "ignore::keras_dtype_policy.SlowFloat16Warning"
)


def overflowing_model():
    with kdp.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, name="small")(inputs)
        hidden = keras.layers.Dense(
            8,
            name="huge",
            kernel_initializer=keras.initializers.Constant(300.0),
        )(hidden)
        # A fixed head: with a random one, the loss-scaled float16
        # gradients of the finite case overflowed for some draws.
        outputs = keras.layers.Dense(
            1,
            name="head",
            dtype="float32",
            kernel_initializer=keras.initializers.Constant(1e-3),
        )(hidden)
        model = keras.Model(inputs, outputs)
    model.get_layer("small").kernel.assign(np.ones((4, 8)))
    return model


def test_names_the_layer_that_overflows_float16():
    model = overflowing_model()
    # "small" outputs 40 (finite); "huge" 8 * 40 * 300 = 96000 > 65504.
    report = kdp.find_nonfinite(model, np.full((2, 4), 10.0, "float32"))
    assert report
    assert not report.all_finite
    assert report.inputs_finite
    assert report.layer.path == "huge"
    assert report.layer.dtype == "float16"
    assert report.layer.inf_count == 16
    assert report.layer.size == 16
    assert report.layer.max_abs is None  # no finite value left
    assert report.gradients == []
    assert not report.checked_gradients
    text = str(report)
    assert "First non-finite layer output: huge (float16)" in text
    assert "16 Inf of 16 values" in text
    assert repr(report).startswith("NonfiniteReport(layer='huge'")


def test_finite_model_reports_all_finite():
    model = overflowing_model()
    x = np.full((2, 4), 1e-3, "float32")
    report = kdp.find_nonfinite(model, x, np.zeros((2, 1), "float32"), "mse")
    assert not report
    assert report.all_finite
    assert report.layer is None
    assert report.gradients == []
    assert report.checked_gradients
    assert str(report) == (
        "All finite: no NaN, Inf or overflow in the inputs, layer outputs "
        "or gradients."
    )
    assert repr(report) == "NonfiniteReport(all finite)"


def test_nested_model_names_the_inner_layer_by_its_path():
    with kdp.policy_scope("mixed_float16"):
        inner = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(
                    4,
                    name="huge",
                    kernel_initializer=keras.initializers.Constant(1e4),
                ),
            ],
            name="block",
        )
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1, name="head")(inner(inputs))
        model = keras.Model(inputs, outputs)
    report = kdp.find_nonfinite(model, np.full((3, 4), 5.0, "float32"))
    # The inner layer is named before the model that holds it.
    assert report.layer.path == "block/huge"
    assert report.layer.inf_count == 12


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(4, name="first")
        self.blowup = keras.layers.Dense(
            4,
            name="blowup",
            kernel_initializer=keras.initializers.Constant(1e3),
        )

    def call(self, x):
        return self.blowup(keras.ops.square(self.first(x)))


def test_subclassed_model_names_its_layer():
    with kdp.policy_scope("mixed_float16"):
        model = Subclassed()
        model(np.zeros((1, 4), "float32"))
    model.first.kernel.assign(np.full((4, 4), 0.25))
    report = kdp.find_nonfinite(model, np.full((2, 4), 8.0, "float32"))
    # first: 4 * 8 * 0.25 = 8, squared 64; blowup: 4 * 64 * 1e3 > 65504.
    assert report.layer.path == "blowup"


def gradient_model():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(
                3,
                name="wide",
                kernel_initializer=keras.initializers.Constant(1e-36),
            ),
            # Fixed weights: the unscaled gradient of "wide"'s kernel is
            # 8 * 1e36 * 2 * (12 - 1) / 8 = 2.2e37, finite; times 2**15 not.
            keras.layers.Dense(1, name="head", kernel_initializer="ones"),
        ]
    )
    model.compile("sgd", "mse")
    return model


def test_with_labels_names_the_variables_whose_gradients_overflow():
    model = gradient_model()
    x = np.full((8, 4), 1e36, "float32")
    y = np.ones((8, 1), "float32")
    # The loss the model was compiled with; at the scale Keras' dynamic
    # loss scaling starts from, one kernel's gradient passes float32.
    report = kdp.find_nonfinite(model, x, y, loss_scale=2.0**15)
    assert report.layer is None
    kernel = model.get_layer("wide").kernel.path
    assert [g.path for g in report.gradients] == [kernel]
    assert report.gradients[0].inf_count == 12
    assert "Non-finite gradients:" in str(report)
    # Unscaled, the same gradient is finite.
    assert not kdp.find_nonfinite(model, x, y)


def test_non_finite_inputs_are_reported_as_such():
    model = gradient_model()
    x = np.ones((2, 4), "float32")
    x[0, 1] = np.nan
    report = kdp.find_nonfinite(model, x)
    assert not report.inputs_finite
    assert report.layer.path == "wide"
    assert report.layer.nan_count == 3  # the first row's three outputs
    assert "The input batch itself holds NaN or Inf." in str(report)


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"model": "model.keras"}, TypeError, "model='model.keras'"),
        ({"loss_scale": 0}, ValueError, "loss_scale=0"),
        ({"loss_scale": "big"}, TypeError, "loss_scale='big'"),
        ({"loss_scale": float("inf")}, ValueError, "loss_scale=inf"),
        ({"y": np.ones((2, 1)), "loss": 3}, TypeError, "loss=3"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs, error, fragment):
    arguments = {"model": gradient_model(), "x": np.ones((2, 4), "float32")}
    arguments.update(kwargs)
    with pytest.raises(error, match=fragment):
        kdp.find_nonfinite(**arguments)


def test_labels_without_a_loss_on_an_uncompiled_model_are_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="loss=None"):
        kdp.find_nonfinite(model, np.ones((2, 4)), np.ones((2, 1)))


def test_command_line_names_the_layer_and_exits_3(tmp_path, capsys):
    from keras_dtype_policy.tools import cli

    model = overflowing_model()
    path = tmp_path / "model.keras"
    model.save(path)
    hot = tmp_path / "hot.npz"
    np.savez(hot, x=np.full((4, 4), 10.0, "float32"))
    status = cli.main(["find-nonfinite", str(path), "--data", str(hot)])
    assert status == 3
    assert "First non-finite layer output: huge (float16)" in (
        capsys.readouterr().out
    )
    cool = tmp_path / "cool.npz"
    np.savez(cool, x=np.full((4, 4), 1e-3, "float32"))
    status = cli.main(["find-nonfinite", str(path), "--data", str(cool)])
    assert status == 0
    assert capsys.readouterr().out.startswith("All finite")
