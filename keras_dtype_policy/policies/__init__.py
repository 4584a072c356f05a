"""The policy core: DTypePolicy, its names, the global policy, registration."""
