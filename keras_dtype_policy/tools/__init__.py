"""The user's tools: the command line, the demo, doctor, reports, the audit."""
