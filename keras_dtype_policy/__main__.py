"""`python -m keras_dtype_policy`: the command-line tool."""

from keras_dtype_policy.cli import main

raise SystemExit(main())
