"""`python -m keras_dtype_policy`: the command-line tool."""

from keras_dtype_policy.tools.cli import main

raise SystemExit(main())
