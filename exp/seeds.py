"""Seed spread of the final loss: hyp.py specs over SEEDS (init seeds)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import hyp  # noqa: E402

seeds = [int(s) for s in os.environ.get("SEEDS", "0,1,2,3,4").split(",")]
for spec in sys.argv[1:]:
    losses = []
    for s in seeds:
        os.environ["SEED"] = str(s)
        losses.append(hyp.run(spec)[0])
    a = np.array(losses)
    print(
        f"{spec:44s} mean {a.mean():.4f} sd {a.std(ddof=1):.4f} "
        f"[{' '.join(f'{v:.4f}' for v in a)}]",
        flush=True,
    )
