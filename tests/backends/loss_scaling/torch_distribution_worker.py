"""Data-parallel training on PyTorch with the plugin, one process per rank.

    python torch_distribution_worker.py single OUT_DIR
    python torch_distribution_worker.py rank RANK WORLD_SIZE PORT OUT_DIR
    python torch_distribution_worker.py load WORLD_SIZE OUT_DIR

Keras' torch backend has no distribution API, so the ranks use
torch.distributed (gloo, over loopback TCP) as Keras' guide "Multi-GPU
distributed training with PyTorch" does. Every run trains the same small
model on the same global batches, once per configuration (policy, dynamic or
fixed scale, and how gradients are averaged across ranks):

- `single`: one process on the whole global batch, in the same custom loop,
  and with `model.fit` (the single-device reference);
- `rank`: one rank of a data-parallel run; each rank feeds its own slice of
  every global batch and the gradients are averaged across ranks, by
  DistributedDataParallel wrapping the Keras model (`ddp`) or by
  `torch.distributed.all_reduce` in the loop (`all_reduce`); then the
  plugin's LossScaleOptimizer applies them. Each rank saves its model to
  a `.keras` file;
- `load`: waits for the ranks to finish, then loads every saved `.keras`
  file, in a process that trained nothing.

One input sample of one global batch is NaN, in the last rank's slice only.
Every run writes `OUT_DIR/<run>-<config>.npz` (weights after each step, loss
scale state after each step, losses) and, where it saves or loads a model,
`OUT_DIR/<run>-<config>.json` (layer policies and loss-scale state).
Each process stops by itself: collectives and the rendezvous time out, and
a watchdog ends a process that runs past `TIME_LIMIT` seconds.
"""

import datetime
import faulthandler
import itertools
import json
import pathlib
import sys
import time
import warnings

import keras
import numpy as np
import torch

import keras_dtype_policy as kdp

TIME_LIMIT = 240  # seconds, for the whole process
WAIT_FOR_RANKS = 200  # seconds
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
GLOBAL_BATCH, STEPS, FEATURES = 8, 8, 4
NAN_STEP, NAN_SAMPLE = 4, 6  # sample 6 of 8: the second half of the batch
INITIAL_SCALE, GROWTH_STEPS = 2.0**10, 3
# float32 is the control: there the ranks differ from one process only by
# float32 rounding.
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
SCALINGS = ("dynamic", "fixed")
SYNCS = ("ddp", "all_reduce")


def configs():
    """Every (policy, scaling, sync) a run trains with, in order."""
    return itertools.product(POLICIES, SCALINGS, SYNCS)


def config_name(policy, scaling, sync):
    """The part of a file name that names a configuration."""
    return f"{policy}-{scaling}-{sync}"


def data():
    """The global batches, with one NaN sample at `NAN_STEP`."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.25).astype("float32")
    x[NAN_STEP * GLOBAL_BATCH + NAN_SAMPLE, 0] = np.nan
    return x, y


def new_model(policy, scaling):
    """The model and its LossScaleOptimizer, the same in every process."""
    keras.utils.clear_session(free_memory=False)  # gc takes ~0.5 s here
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdp.SlowFloat16Warning)
        kdp.set_dtype_policy(policy)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9),
        dynamic=scaling == "dynamic",
        initial_scale=INITIAL_SCALE,
        # tf.keras' rule: a fixed scale takes no growth steps.
        dynamic_growth_steps=GROWTH_STEPS if scaling == "dynamic" else None,
    )
    optimizer.build(model.trainable_variables)
    kdp.set_dtype_policy("float32")
    return model, optimizer


def flat(variables):
    """All values of `variables`, flattened into one float64 vector."""
    return np.concatenate(
        [
            keras.ops.convert_to_numpy(v).astype("float64").ravel()
            for v in variables
        ]
    )


def scale_state(optimizer):
    """(loss_scale, dynamic_counter, skipped_steps), as Python numbers."""
    return (
        optimizer.loss_scale,
        # The variable: a fixed scale's dynamic_counter is None.
        int(keras.ops.convert_to_numpy(optimizer.step_counter)),
        optimizer.skipped_steps,
    )


def summary(model):
    """What saving must keep: layer policies and loss-scale state."""
    optimizer = model.optimizer
    return {
        "policies": [layer.dtype_policy.name for layer in model.layers],
        "optimizer": type(optimizer).__module__
        + "."
        + type(optimizer).__qualname__,
        "dynamic": optimizer.dynamic,
        "loss_scale": optimizer.loss_scale,
        "dynamic_counter": int(
            keras.ops.convert_to_numpy(optimizer.step_counter)
        ),
        "skipped_steps": optimizer.skipped_steps,
        "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations)),
    }


class Recorder:
    """Collects the weights and scale state after every step."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.weights = [flat(model.trainable_variables)]
        self.states, self.losses = [], []

    def step_done(self, loss):
        self.weights.append(flat(self.model.trainable_variables))
        self.states.append(scale_state(self.optimizer))
        self.losses.append(float(loss))

    def save(self, path):
        np.savez(
            path,
            weights=np.array(self.weights),
            states=np.array(self.states, dtype="float64"),
            losses=np.array(self.losses),
            optimizer_values=flat(self.optimizer.variables),
        )


def train(model, optimizer, batches, sync=None, world_size=1):
    """The README's torch loop, with gradients averaged across ranks.

    The loss is each process's mean over its own samples; it is scaled
    before `backward`, and the scaled gradients are averaged across ranks
    before the optimizer checks them, so every rank sees the same non-finite
    gradients and skips the same steps.
    """
    loss_fn = keras.losses.MeanSquaredError()
    forward = model
    if sync == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
    recorder = Recorder(model, optimizer)
    for x, y in batches:
        loss = loss_fn(y, forward(torch.from_numpy(x), training=True))
        model.zero_grad()
        optimizer.scale_loss(loss).backward()
        grads = [v.value.grad for v in model.trainable_variables]
        if sync == "all_reduce":
            for grad in grads:
                torch.distributed.all_reduce(grad)
                grad.div_(world_size)
        with torch.no_grad():
            optimizer.apply(grads, model.trainable_variables)
        recorder.step_done(loss.detach())
    return recorder


class FitRecorder(keras.callbacks.Callback):
    """Feeds a `Recorder` from `model.fit`, after every batch."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def on_train_batch_end(self, batch, logs=None):
        # The logs hold a running mean, not this batch's loss.
        self.recorder.step_done(np.nan)


def run_single(out_dir):
    x, y = data()
    batches = [
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH])
        for i in range(0, len(x), GLOBAL_BATCH)
    ]
    for policy, scaling, sync in configs():
        if sync != SYNCS[0]:
            continue  # one reference per policy and scaling
        model, optimizer = new_model(policy, scaling)
        recorder = train(model, optimizer, batches)
        recorder.save(out_dir / f"single-{policy}-{scaling}.npz")

        model, optimizer = new_model(policy, scaling)
        model.compile(optimizer, "mse")
        recorder = Recorder(model, optimizer)
        model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[FitRecorder(recorder)],
        )
        recorder.save(out_dir / f"fit-{policy}-{scaling}.npz")


def run_rank(rank, world_size, port, out_dir):
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        x, y = data()
        per_rank = GLOBAL_BATCH // world_size
        batches = [
            (x[i : i + per_rank], y[i : i + per_rank])
            for i in range(rank * per_rank, len(x), GLOBAL_BATCH)
        ]
        for policy, scaling, sync in configs():
            name = config_name(policy, scaling, sync)
            model, optimizer = new_model(policy, scaling)
            # Compiled only so that the saved file holds the optimizer and
            # its loss-scale state; the loop below trains.
            model.compile(optimizer, "mse")
            recorder = train(model, optimizer, batches, sync, world_size)
            recorder.save(out_dir / f"rank{rank}-{name}.npz")
            model.save(out_dir / f"rank{rank}-{name}.keras")
            write_json(out_dir / f"rank{rank}-{name}.json", summary(model))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    (out_dir / f"rank{rank}.done").touch()


def run_load(world_size, out_dir):
    """Loads the ranks' files once every rank has saved all of its own."""
    deadline = time.monotonic() + WAIT_FOR_RANKS
    while not all(
        (out_dir / f"rank{r}.done").exists() for r in range(world_size)
    ):
        if time.monotonic() > deadline:
            raise SystemExit("the ranks did not finish")
        time.sleep(0.2)
    keras.config.set_dtype_policy("float32")
    for path in sorted(out_dir.glob("rank*.keras")):
        model = keras.saving.load_model(path)
        write_json(path.with_name(f"loaded-{path.stem}.json"), summary(model))
        np.savez(
            path.with_name(f"loaded-{path.stem}.npz"),
            weights=flat(model.trainable_variables),
            optimizer_values=flat(model.optimizer.variables),
        )


def write_json(path, value):
    """Writes `value` to `path` as JSON."""
    pathlib.Path(path).write_text(json.dumps(value, indent=1))


def main(argv):
    faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
    torch.set_num_threads(1)
    mode = argv[0]
    if mode == "single":
        run_single(pathlib.Path(argv[1]))
    elif mode == "rank":
        rank, world_size, port = (int(a) for a in argv[1:4])
        run_rank(rank, world_size, port, pathlib.Path(argv[4]))
    elif mode == "load":
        run_load(int(argv[1]), pathlib.Path(argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    if keras.backend.backend() != "torch":
        raise SystemExit("run with KERAS_BACKEND=torch")
    main(sys.argv[1:])
