"""Test helpers shared by every backend's run of the suite."""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time
import warnings
import zipfile

import keras
import numpy as np

BACKEND = keras.backend.backend()

MIXED_POLICIES = ("mixed_float16", "mixed_bfloat16")

# Kinds of training step, for fault injection.
FINITE, NAN, INF = "finite", "nan", "inf"


@dataclasses.dataclass(frozen=True)
class InnerOptimizer:
    """One row of the table of Keras optimizers the wrappers are tested on.

    Attributes:
        name: The row's id in parametrized tests.
        class_name: Its class in `keras.optimizers`.
        learning_rate: A rate at which the tests' small problems train in
            a few steps.
        options: Its other arguments, such as `momentum`.
    """

    name: str
    class_name: str
    learning_rate: float
    options: dict = dataclasses.field(default_factory=dict, hash=False)

    def make(self, learning_rate=None):
        """Returns a new optimizer of this row (at `learning_rate`, if
        given)."""
        rate = self.learning_rate if learning_rate is None else learning_rate
        return getattr(keras.optimizers, self.class_name)(rate, **self.options)


# Every Keras optimizer (and the variants whose state differs) that the
# wrappers take, in the style of optax's alias_test.py.
_ALL_ROWS = (
    InnerOptimizer("sgd", "SGD", 0.05),
    InnerOptimizer("sgd_momentum", "SGD", 0.05, {"momentum": 0.9}),
    InnerOptimizer(
        "sgd_nesterov", "SGD", 0.05, {"momentum": 0.9, "nesterov": True}
    ),
    InnerOptimizer("adam", "Adam", 0.01),
    InnerOptimizer("adam_amsgrad", "Adam", 0.01, {"amsgrad": True}),
    InnerOptimizer("adamw", "AdamW", 0.01, {"weight_decay": 0.1}),
    InnerOptimizer("adamax", "Adamax", 0.02),
    InnerOptimizer("adagrad", "Adagrad", 0.1),
    InnerOptimizer("rmsprop", "RMSprop", 0.01),
    InnerOptimizer("rmsprop_momentum", "RMSprop", 1e-3, {"momentum": 0.5}),
    InnerOptimizer("adadelta", "Adadelta", 1.0),
    InnerOptimizer("nadam", "Nadam", 0.01),
    InnerOptimizer("lion", "Lion", 0.02),
    InnerOptimizer("ftrl", "Ftrl", 0.2),
    InnerOptimizer("adafactor", "Adafactor", 0.05),
    InnerOptimizer("lamb", "Lamb", 0.01),
    InnerOptimizer("muon", "Muon", 0.02),
)
# The rows whose class the installed Keras has.
INNER_OPTIMIZERS = tuple(
    row for row in _ALL_ROWS if hasattr(keras.optimizers, row.class_name)
)


def inner_optimizers(*names, learning_rates=None):
    """Returns `{name: a function making that optimizer}` for rows of
    `INNER_OPTIMIZERS`.

    Args:
        *names: The rows wanted, in this order; every row if none. A name
            the installed Keras lacks is left out.
        learning_rates: `{name: rate}` where a test needs other rates than
            the rows' own (rates its measured bounds were taken at).
    """
    rows = {row.name: row for row in INNER_OPTIMIZERS}
    rates = learning_rates or {}
    unknown = set(names) - {row.name for row in _ALL_ROWS}
    if unknown:
        raise KeyError(f"INNER_OPTIMIZERS has no rows {sorted(unknown)}")
    return {
        name: (lambda row=rows[name]: row.make(rates.get(row.name)))
        for name in (names or rows)
        if name in rows
    }


def to_numpy(x):
    """Returns `x` as a NumPy array, whatever backend made it."""
    return keras.ops.convert_to_numpy(x)


def dtype_of(x):
    """Returns the Keras name of the dtype of a tensor or array."""
    return keras.backend.standardize_dtype(x.dtype)


def assert_serialization_round_trip(obj):
    """Serializes `obj` through JSON and back; returns the revived object.

    The revived object must be of the same class and have the same config.
    """
    config = keras.saving.serialize_keras_object(obj)
    revived = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(config))
    )
    assert type(revived) is type(obj)
    assert revived.get_config() == obj.get_config()
    return revived


def assert_layer_precision(layer, inputs, policy):
    """Checks a built layer's outputs and weights against `policy`."""
    outputs = layer(inputs)
    for output in keras.tree.flatten(outputs):
        assert dtype_of(output) == policy.compute_dtype
    for weight in layer.weights:
        if keras.backend.is_float_dtype(weight.dtype):
            assert dtype_of(weight) == policy.variable_dtype


def small_mlp(policy=None, name="mlp"):
    """A Sequential MLP with a float32 softmax head."""
    dtype = {} if policy is None else {"dtype": policy}
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", **dtype),
            keras.layers.Dense(3, **dtype),
            keras.layers.Activation("softmax", dtype="float32"),
        ],
        name=name,
    )


def classification_data(num_samples=64, seed=0):
    """A small learnable classification task with 6 features, 3 classes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y


def rewrite_keras_archive(path, change):
    """Rewrites the .keras file at `path`; `change` edits its members.

    `change` gets a dict of member name to bytes and changes it in place.
    """
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    change(members)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    path.write_bytes(buffer.getvalue())


def keras_file_with_dtype(dtype, path):
    """Saves a .keras file whose Dense layer's dtype config is `dtype`.

    Returns the model that was saved (before the rewrite).
    """
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(3, name="dense")]
    )
    model.save(path)

    def set_dtype(members):
        config = json.loads(members["config.json"])
        config["config"]["layers"][1]["config"]["dtype"] = dtype
        members["config.json"] = json.dumps(config).encode()

    rewrite_keras_archive(path, set_dtype)
    return model


ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The pages whose Python examples the tests run: the README, then docs/.
DOC_PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))


def readme_example(tag, kind="custom-loop"):
    """Returns the Python block that follows `<!-- kind: tag -->`.

    The marker is looked for in README.md and docs/*.md, and must be on
    exactly one of them, once.
    """
    marker = f"<!-- {kind}: {tag} -->"
    found = [page for page in DOC_PAGES if marker in page.read_text()]
    if len(found) != 1 or found[0].read_text().count(marker) != 1:
        names = [page.name for page in found]
        raise AssertionError(f"{marker} must occur once; found in {names}")
    text = found[0].read_text()
    start = text.index("```python\n", text.index(marker)) + len("```python\n")
    return text[start : text.index("```", start)]


def run_readme_example(tag, kind="custom-loop"):
    """Runs a docs example; returns its namespace and printed output."""
    namespace = {"__name__": f"readme_{tag}"}
    output = io.StringIO()
    source = readme_example(tag, kind)
    with contextlib.redirect_stdout(output):
        exec(compile(source, f"docs:{kind}:{tag}", "exec"), namespace)
    return namespace, output.getvalue()


def check_custom_loop_result(namespace, printed):
    """What every README custom loop must achieve."""
    model, optimizer = namespace["model"], namespace["optimizer"]
    x, y = namespace["x"], namespace["y"]
    final_loss, scale, skipped = printed.split()
    baseline = float(np.mean(y**2))
    assert float(final_loss) < 0.2 * baseline
    assert float(scale) == optimizer.loss_scale
    assert int(skipped) == optimizer.skipped_steps
    assert int(to_numpy(optimizer.iterations)) + optimizer.skipped_steps == 50
    predictions = to_numpy(model(x))
    assert np.all(np.isfinite(predictions))
    assert float(np.mean((predictions - y) ** 2)) < 0.2 * baseline


def reference_trajectory(
    kinds,
    initial_scale,
    dynamic=True,
    growth_steps=2000,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=1.0,
    max_scale=2.0**24,
    counter=0,
    skipped=0,
):
    """The documented rule, step by step: [(scale, counter, skipped)].

    `counter` and `skipped` are the state before the first step (a restored
    optimizer's, say).
    """
    scale, states = initial_scale, []
    for kind in kinds:
        if kind == FINITE:
            counter += 1
            if dynamic and counter >= growth_steps:
                scale, counter = min(scale * growth_factor, max_scale), 0
        else:
            skipped, counter = skipped + 1, 0
            if dynamic:
                scale = max(scale * backoff_factor, min_scale)
        states.append((scale, counter, skipped))
    return states


CLI_ERROR = "keras-dtype-policy: error: "


def run_cli(*args, cwd=None, env=None, timeout=240):
    """Runs the command line in a subprocess; returns the completed run."""
    environment = dict(os.environ, KERAS_BACKEND=BACKEND)
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "keras_dtype_policy", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment,
        timeout=timeout,
    )


def call_cli(*args, cwd=None, env=None):
    """Runs the command line in this process, as `run_cli` runs it in a
    subprocess; returns a `subprocess.CompletedProcess` of what it printed.

    What a run may change is put back afterwards: the working directory,
    the environment, `sys.argv` and `sys.path`, the modules `--import`
    loaded, Keras' registered custom objects and global policy, warnings
    filters and the random generators' states.
    """
    from keras_dtype_policy.tools import cli

    argv = [str(arg) for arg in args]
    imported = [
        pathlib.Path(name).stem if name.endswith(".py") else name
        for flag, name in zip(argv, argv[1:], strict=False)
        if flag == "--import"
    ]
    out, err = io.StringIO(), io.StringIO()
    saved_environment, saved_cwd = dict(os.environ), os.getcwd()
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    saved_modules = set(sys.modules)
    custom_objects = keras.saving.get_custom_objects()
    saved_custom_objects = dict(custom_objects)
    saved_policy = keras.config.dtype_policy()
    saved_random = random.getstate(), np.random.get_state()
    os.environ.update(env or {})
    try:
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["keras-dtype-policy", *argv]
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                status = cli.main(argv)
            except SystemExit as exit_:  # --help, --version
                status = exit_.code or 0
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environment)
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name in set(sys.modules) - saved_modules:
            if name.split(".")[0] in imported:
                del sys.modules[name]
        custom_objects.clear()
        custom_objects.update(saved_custom_objects)
        keras.config.set_dtype_policy(saved_policy)
        random.setstate(saved_random[0])
        np.random.set_state(saved_random[1])
    return subprocess.CompletedProcess(
        ["keras-dtype-policy", *argv], status, out.getvalue(), err.getvalue()
    )


def cli_error_line(result, status=1):
    """Returns the one error line a failed command printed, no traceback.

    Args:
        result: A `subprocess.CompletedProcess` with text stderr (of
            `run_cli` or `call_cli`).
        status: The exit status the command must have ended with.
    """
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    ours = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("keras-dtype-policy")
    ]
    assert len(ours) == 1, result.stderr
    assert ours[0].startswith(CLI_ERROR)
    return ours[0]


def train_on_fixture_data(model, states, name):
    """Trains one in-order epoch (batch 4) on a fixture's saved training
    data; returns the steps the optimizer took, applied or skipped, after
    checking that every weight and optimizer value stayed finite."""
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    model.fit(
        states[f"{name}.x_train"],
        states[f"{name}.y_train"],
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    for variable in [*model.weights, *inner.variables]:
        assert np.all(np.isfinite(to_numpy(variable))), variable.name
    skipped = getattr(optimizer, "skipped_steps", 0)
    return int(to_numpy(inner.iterations)) + skipped


def assert_fixture_predictions(model, states, name, policy, ulps=8):
    """Checks `model`'s predictions on a fixture's saved batch against
    those saved, within `ulps` units in the last place of `policy`'s
    compute dtype."""
    epsilon = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
    tolerance = ulps * epsilon[keras.DTypePolicy(policy).compute_dtype]
    np.testing.assert_allclose(
        to_numpy(model.predict(states[f"{name}.x"], verbose=0)),
        states[f"{name}.y"],
        rtol=tolerance,
        atol=tolerance,
    )


def run_json_worker(worker, *args, backend=BACKEND, timeout=300):
    """Runs `python worker *args` in a process of its own (the repository
    importable, `KERAS_BACKEND=backend`) and returns the JSON object of the
    last stdout line that starts with `{`; fails the test, showing the end
    of stderr, if the worker exits with an error."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(worker), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("{")][-1]
    return json.loads(line)


def selected_params(request, *names):
    """The values of the parameters `names` among the tests of the
    requesting module that this run selected (sorted; a tuple of values
    each for several names), so that a fixture making files for them all
    makes only those (the default runs leave out the cases marked slow).

    Args:
        request: pytest's `request` fixture.
        *names: The parameters' names.
    """
    found = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and all(n in params for n in names):
            values = tuple(params[n] for n in names)
            found.add(values[0] if len(names) == 1 else values)
    return sorted(found)


def made_once(tmp_path_factory, name, make):
    """Returns the folder that `make(folder)` filled, once per test run.

    A module-scoped fixture runs again on each pytest-xdist worker that
    takes one of its module's tests. Made here, its files are written once,
    by the first worker, in a folder all the run's workers share (the one
    above their own base folders), while the others wait for a lock; a
    `make` that fails leaves nothing, and the next worker tries again.

    Args:
        tmp_path_factory: pytest's fixture of that name.
        name: The folder's name, one per kind of files.
        make: Writes the files into the (empty) folder it is given.
    """
    import fcntl  # POSIX: so is every machine these tests run on

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def free_port():
    """Returns a loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(worker, commands, work_dir, timeout):
    """Runs `python worker *args` for each `(name, args)` of `commands`
    at once (`KERAS_BACKEND=torch`, logs in `work_dir/name.log`); returns
    what failed.

    Once one process fails, or after `timeout` seconds, the others
    are killed: the ranks and the loader wait for one another.
    """
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    processes = {}
    for name, args in commands:
        with open(work_dir / f"{name}.log", "w") as log:
            processes[name] = subprocess.Popen(
                [sys.executable, str(worker), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    deadline = time.monotonic() + timeout
    failed = set()
    while not failed and time.monotonic() < deadline:
        codes = [p.poll() for p in processes.values()]
        failed = {n for n, p in processes.items() if p.returncode}
        if all(code is not None for code in codes):
            break
        time.sleep(0.2)
    killed = []
    for name, process in processes.items():
        if process.poll() is None:
            process.kill()
            killed.append(name)
        process.wait()
    return [
        f"{name} exited {process.returncode}:\n"
        + (work_dir / f"{name}.log").read_text()[-3000:]
        for name, process in processes.items()
        if process.returncode and name not in killed
    ] + [f"killed: {name}" for name in killed]
