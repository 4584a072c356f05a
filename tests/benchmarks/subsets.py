"""Subsets of a benchmark's configurations, named in an environment variable.

`KDP_BENCHMARK7_ONLY`, `KDP_BENCHMARK9_ONLY` and `KDP_HUB_QUALITY_ONLY`
each hold a comma-separated list of configurations to run; the references
a benchmark compares with are always kept.
"""

import os


def chosen(variable, configurations, references=()):
    """The configurations the environment variable `variable` keeps.

    Args:
        variable: The environment variable's name.
        configurations: Every configuration, in the order they run.
        references: Configurations kept whatever the variable says.

    Returns:
        A tuple of configurations in their order: all of them when the
        variable is unset or empty.

    Raises:
        ValueError: if the variable names an unknown configuration.
    """
    only = os.environ.get(variable)
    if not only:
        return tuple(configurations)
    names = {name.strip() for name in only.split(",")} | set(references)
    unknown = names - set(configurations)
    if unknown:
        raise ValueError(
            f"{variable} names unknown configurations. "
            f"Received: {sorted(unknown)}; known: {list(configurations)}"
        )
    return tuple(name for name in configurations if name in names)
