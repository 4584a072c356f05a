"""`shard_optimizer_state` on Keras' torch distribution API, one process.

    KERAS_BACKEND=torch python torch_state_sharding_worker.py \
        rank RANK WORLD PORT OUT_DIR
    KERAS_BACKEND=torch python torch_state_sharding_worker.py load OUT_DIR

A rank joins `keras.distribution.initialize` (gloo on the CPU, a local
coordinator) and trains each case of `CASES` under `DataParallel`, each
process feeding its own part of every global batch, once without and once
with `shard_optimizer_state`. It writes `OUT_DIR/rank{RANK}-{case}.npz`
(the weights and the whole optimizer state of both runs, the elements of
each state variable this process holds) and saves the sharded run to
`OUT_DIR/rank{RANK}-{case}.keras` (every process saves: gathering split
state is a collective). `load`, in a process without a distribution, loads
each rank's file and writes its weights and state, trained one more step.
"""

import os
import pathlib
import sys

import numpy as np

STEPS, PER_PROCESS_BATCH, WIDTH = 4, 8, 64
# case: (global policy, batch made NaN on rank 0 or None, distribution).
CASES = {
    "adam": ("float32", None, "data"),
    # The compile hook's LossScaleOptimizer around the sharded Adam; a NaN
    # in one process' part of step 2 must skip that step everywhere.
    "mixed_float16": ("mixed_float16", 2, "data"),
    # ModelParallel on a (batch 2, model 1) mesh, the hidden kernel laid
    # out along "model": its slots split along "batch" on top of it.
    "model_parallel": ("float32", None, "model"),
}


def data(rank, world, nan_step):
    """This process' part of every global batch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, world, PER_PROCESS_BATCH, WIDTH))
    y = np.tanh(x @ rng.normal(size=(WIDTH, 8)))
    x, y = x[:, rank].astype("float32"), y[:, rank].astype("float32")
    if nan_step is not None and rank == 0:
        x[nan_step, 0, 0] = np.nan
    return x.reshape(-1, WIDTH), y.reshape(-1, 8)


def build(keras, kdp, policy):
    kdp.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((WIDTH,)),
            keras.layers.Dense(128, activation="relu", name="hidden"),
            keras.layers.Dense(8, name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), "mean_squared_error")
    return model


def distribution(keras, parallel, world):
    if parallel == "data":
        return keras.distribution.DataParallel(auto_shard_dataset=False)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (world, 1), ["batch", "model"], devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, auto_shard_dataset=False
    )


def state(model):
    """Weights and whole optimizer state (`numpy()` gathers split state)."""
    values = {f"w{i}": v.numpy() for i, v in enumerate(model.weights)}
    for i, v in enumerate(model.optimizer.variables):
        values[f"o{i}"] = v.numpy()
    return values


def train(keras, kdp, case, rank, world, sharded):
    from keras_dtype_policy.low_precision import torch_sharding

    policy, nan_step, parallel = CASES[case]
    keras.distribution.set_distribution(distribution(keras, parallel, world))
    model = build(keras, kdp, policy)
    if sharded:
        kdp.shard_optimizer_state(model.optimizer)
    x, y = data(rank, world, nan_step)
    model.fit(x, y, batch_size=PER_PROCESS_BATCH, shuffle=False, verbose=0)
    values = state(model)
    prefix = "sharded" if sharded else "plain"
    out = {f"{prefix}:{k}": v for k, v in values.items()}
    if sharded:
        for i, v in enumerate(model.optimizer.variables):
            local = torch_sharding.local_elements(v)
            whole = int(np.prod(v.shape))
            out[f"local:o{i}"] = np.array([local, whole])
    return model, out


def set_methods(members, names):
    """The `names` set on the instances `members` (not their classes)."""
    return [name for m in members for name in names if name in vars(m)]


def rank_main(rank, world, port, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    import keras

    import keras_dtype_policy as kdp
    from keras_dtype_policy.low_precision.state_sharding import SHARDING_METHODS

    keras.distribution.initialize()
    for case in CASES:
        _, plain = train(keras, kdp, case, rank, world, sharded=False)
        model, sharded = train(keras, kdp, case, rank, world, sharded=True)
        model.save(out_dir / f"rank{rank}-{case}.keras")
        members = [model.optimizer]
        inner = getattr(model.optimizer, "inner_optimizer", None)
        members += [inner] if inner is not None else []
        patched = set_methods(members, SHARDING_METHODS)
        kdp.uninstall()
        left = set_methods(members, SHARDING_METHODS)
        kdp.install()
        np.savez(
            out_dir / f"rank{rank}-{case}.npz",
            **plain,
            **sharded,
            patched=np.array(patched),
            left_after_uninstall=np.array(left, dtype=str),
            names=np.array([v.name for v in model.optimizer.variables]),
        )


def load_main(out_dir, world):
    import keras

    import keras_dtype_policy as kdp  # noqa: F401  (the policies' classes)

    for case in CASES:
        for rank in range(world):
            path = out_dir / f"rank{rank}-{case}.keras"
            model = keras.saving.load_model(path)
            loaded = state(model)
            x, y = data(0, world, None)
            model.fit(x[:PER_PROCESS_BATCH], y[:PER_PROCESS_BATCH], verbose=0)
            trained = np.array(
                [np.isfinite(v.numpy()).all() for v in model.weights]
            )
            np.savez(
                out_dir / f"load{rank}-{case}.npz",
                **{f"loaded:{k}": v for k, v in loaded.items()},
                trained_finite=trained,
            )


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(
            int(sys.argv[2]),
            int(sys.argv[3]),
            int(sys.argv[4]),
            pathlib.Path(sys.argv[5]),
        )
    else:
        load_main(pathlib.Path(sys.argv[2]), int(sys.argv[3]))
