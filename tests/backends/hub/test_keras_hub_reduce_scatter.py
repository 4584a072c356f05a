"""A keras-hub model trained with the reduce-scatter ZeRO-1 step (JAX).

`reduce_scatter_hub_worker.py` runs on four forced host devices: GPT-2's
backbone from config (dropout 0.1, layer normalization, attention) under
`stochastic_bfloat16_8bit`, trained with Keras' `DataParallel` step and
with `shard_optimizer_state(model, reduce_scatter=True)`, saved, reloaded
on one device and trained on. Run by `tox -e keras-hub` (JAX's pass;
~40 s here).
"""

import pathlib

import pytest
from testing import BACKEND
from testing import run_json_worker

pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (the `hub` extra)"
)

WORKER = pathlib.Path(__file__).with_name("reduce_scatter_hub_worker.py")


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="keras.distribution's DataParallel step, which the switch "
    "replaces, is JAX's",
)
def test_gpt2_backbone_trains_saves_and_resumes(tmp_path):
    found = run_json_worker(WORKER, tmp_path, backend="jax", timeout=900)
    losses, keras_losses = found["losses"], found["keras_losses"]
    # It learns, as Keras' step does: the dropout masks differ (each
    # device draws its own), so the losses agree within a few percent.
    assert losses[-1] < losses[0] - 0.3
    for ours, theirs in zip(losses, keras_losses, strict=True):
        assert ours == pytest.approx(theirs, rel=0.03)
    assert "int8" in found["state_dtypes"]
    assert found["state_equal"]
    assert found["resumed_loss"] < losses[-1]
