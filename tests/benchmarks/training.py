"""Step times of `fit`, several compiled models side by side.

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import time

import keras

from tests.benchmarks import measure

# Steps at the start of a `fit` epoch that are not timed: the first step of
# an epoch also starts the data pipeline (and, in the very first epoch,
# compiles). Models slower than the budget time their first step instead.
SKIP = 1


class StepClock(keras.callbacks.Callback):
    """Times the steps of one `fit` epoch but the first `skip`.

    Overriding `on_train_batch_end` makes Keras call it in the training
    thread with the step's logs already converted to Python floats, which
    waits for the device: each timestamp is taken after its step finished.

    Args:
        skip: Steps at the start of the epoch that are not timed. With 0 the
            clock starts as the first step begins.
    """

    def __init__(self, skip):
        super().__init__()
        self.skip = skip
        self.start = None
        self.end = None
        self.timed_steps = 0

    def on_train_begin(self, logs=None):
        self.start = self.end = None
        self.timed_steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.skip == 0 and batch == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if batch == self.skip - 1:
            self.start = now
        elif batch >= self.skip:
            self.end = now
            self.timed_steps = batch - self.skip + 1

    def seconds_per_step(self):
        """Returns the mean seconds of the timed steps of the last epoch."""
        if not self.timed_steps:
            raise RuntimeError(
                f"No step was timed: the epoch had no more than {self.skip} "
                "steps."
            )
        return (self.end - self.start) / self.timed_steps


def fit_measurement(model, x, y, batch_size, steps, skip=SKIP):
    """Returns a measurement: seconds per step of one `fit` epoch.

    Args:
        model: A compiled Keras model.
        x: The inputs, a NumPy array of at least `skip + steps` batches.
        y: The labels, a NumPy array.
        batch_size: The batch size.
        steps: The timed steps of each epoch.
        skip: The untimed steps before them.

    Returns:
        A callable taking no arguments and returning a float.
    """
    clock = StepClock(skip)
    samples = (skip + steps) * batch_size
    if len(x) < samples:
        raise ValueError(
            f"{skip} + {steps} steps of batch {batch_size} need {samples} "
            f"samples. Received: {len(x)}"
        )
    x, y = x[:samples], y[:samples]

    def measurement():
        with measure.collector_paused():
            model.fit(
                x,
                y,
                batch_size=batch_size,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[clock],
            )
        return clock.seconds_per_step()

    return measurement


def samples_needed(max_steps, batch_size):
    """Returns how many samples the longest epoch of `step_times` needs."""
    return (SKIP + max_steps) * batch_size


def plan(estimate, budget, max_steps):
    """Returns `(skip, steps)` for a model whose step takes `estimate` s.

    As many timed steps as fit in `budget` seconds, 1 to `max_steps`, after
    `SKIP` untimed ones; a model slower than the budget times one step and
    skips none, as its first step's extra cost is lost in its length.
    """
    if estimate >= budget:
        return 0, 1
    return SKIP, max(1, min(max_steps, int(budget / estimate)))


def step_times(models, x, y, batch_size, sizes, group=None, repeats=None):
    """Times training steps of several models, interleaved.

    Each model first trains one short untimed epoch (compilation), whose
    last step estimates its step time. Models of one group (those whose
    times are compared) then all time the steps that `plan` gives for the
    group's fastest estimate (noise only ever slows a step), and the models
    take turns, `sizes.repeats` epochs each.

    Args:
        models: A dict `{key: compiled model}`.
        x: The inputs, a NumPy array of `samples_needed(sizes.max_steps,
            batch_size)`.
        y: The labels, a NumPy array.
        batch_size: The batch size.
        sizes: A `sizes.Sizes`: `repeats`, `step_budget` and `max_steps`.
        group: A function from a key to its group; by default every key is
            a group of its own.
        repeats: Timed epochs per model; defaults to `sizes.repeats`.

    Returns:
        A tuple: `{key: [seconds per step, one per repetition]}` and
        `{key: timed steps per repetition}`.
    """
    group = group or (lambda key: key)
    estimates = {}
    for key, model in models.items():
        estimates[key] = fit_measurement(model, x, y, batch_size, 1)()
    fastest = {}
    for key, estimate in estimates.items():
        fastest[group(key)] = min(estimate, fastest.get(group(key), estimate))
    plans = {
        key: plan(fastest[group(key)], sizes.step_budget, sizes.max_steps)
        for key in models
    }
    measurements = {
        key: fit_measurement(
            model, x, y, batch_size, plans[key][1], plans[key][0]
        )
        for key, model in models.items()
    }
    samples = measure.interleaved(
        measurements, repeats or sizes.repeats, warmup=0
    )
    return samples, {key: steps for key, (_, steps) in plans.items()}
