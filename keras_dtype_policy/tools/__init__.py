"""The user's tools: the command line, the demo, doctor and reports."""
