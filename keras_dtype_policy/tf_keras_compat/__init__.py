"""tf.keras 2 compatibility: the legacy API, its configs and its saved files."""
