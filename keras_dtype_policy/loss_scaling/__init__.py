"""Loss scaling: loss-scale values, the optimizer, its hook, telemetry."""
