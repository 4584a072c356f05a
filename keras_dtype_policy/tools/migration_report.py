"""The lines that `keras-dtype-policy migrate` prints."""

import keras

from keras_dtype_policy.tools.tables import wrap


def format_migration(migration):
    """Returns the lines that `migrate` prints."""
    source = migration.source
    lines = [
        f"migrated {source.path} ({source.writer}) -> {migration.target} "
        f"(Keras {keras.__version__})",
        "",
        "changes:",
    ]
    lines += [f"  {change}" for change in migration.changes] or ["  none"]
    lines += ["", "loss scales dropped:"]
    lines += [f"  {line}" for line in migration.dropped_loss_scales] or [
        "  none"
    ]
    if migration.notes:
        lines += ["", "notes:"]
        for note in migration.notes:
            lines += wrap(note, bullet="  - ")
    optimizer = (
        f" and {migration.optimizer_values} optimizer values"
        if migration.optimizer_values
        else ""
    )
    lines += [
        "",
        f"checked: {migration.target} loads with the same "
        f"{migration.weights} weights{optimizer}",
    ]
    return lines
