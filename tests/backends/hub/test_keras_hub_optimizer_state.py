"""keras-hub tasks fine-tuned, saved, reloaded and trained again.

A keras-hub task compiles itself in its constructor (`compile()` with its
own defaults: Adam for a causal LM and a text classifier), so a task
reloaded from a `.keras` file gets that fresh optimizer, whatever the saved
one was. The saved optimizer state then fits the new optimizer only when
both have the same variables. Where it does not (SGD with momentum,
RMSprop, a learning-rate schedule, LoRA), the package skips it with Keras'
warning and the task trains, as with Keras alone; where it does (Adam or
AdamW saved, Adam reloaded), it is restored exactly, which
Keras alone does not do for a task (it drops it). The expectations are the
same on every backend.

Tiny models built from config: nothing is downloaded. keras-hub is not in
the backends' test environments (it pulls TensorFlow and tensorflow-text):
`tox -e keras-hub` runs this file once per backend. Measured for the six
cases on a 2-core machine: 72 s on JAX when idle; shared with other jobs
(load 6 to 9), 1.5 to 2 minutes on torch, 3.5 to 16 on JAX, 9 on
TensorFlow.
"""

import warnings

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (the `hub` extra)"
)
from hub_models import bert_classifier  # noqa: E402
from hub_models import causal_lm_data  # noqa: E402
from hub_models import classifier_data  # noqa: E402
from hub_models import gpt2_causal_lm  # noqa: E402

SKIPPING = "Skipping variable loading for optimizer"
TASKS = {
    "gpt2_causal_lm": (gpt2_causal_lm, causal_lm_data),
    "bert_classifier": (bert_classifier, classifier_data),
}


def schedule():
    return keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.9)


# (task, optimizer, LoRA rank or None, whether the saved state fits the
# reloaded task's fresh optimizer). It fits when the saved optimizer has
# the variables of the task's default: Adam and AdamW have the same ones,
# SGD and RMSprop other slots. With a learning-rate schedule the optimizer
# has no learning-rate variable: its step count and slots are those of the
# layout tf.keras 2 saved, and are restored (the reloaded optimizer keeps
# its own learning rate). A reloaded LoRA task trains all its weights
# (keras-hub does not bring back what `enable_lora` froze), so the saved
# slots, made for the LoRA weights alone, fit none of its layouts.
CASES = {
    "gpt2_sgd_momentum": (
        "gpt2_causal_lm",
        lambda: keras.optimizers.SGD(momentum=0.9),
        None,
        False,
    ),
    "gpt2_adamw": ("gpt2_causal_lm", keras.optimizers.AdamW, None, True),
    "gpt2_adam_lora": ("gpt2_causal_lm", keras.optimizers.Adam, 2, False),
    "bert_rmsprop": ("bert_classifier", keras.optimizers.RMSprop, None, False),
    "bert_adamw_schedule": (
        "bert_classifier",
        lambda: keras.optimizers.AdamW(schedule()),
        None,
        True,
    ),
    "bert_adam": ("bert_classifier", keras.optimizers.Adam, None, True),
}


def state(optimizer):
    """The step count and slots: all variables but the learning rate."""
    learning_rate = getattr(optimizer, "_learning_rate", None)
    return [
        np.array(v.numpy())
        for v in optimizer.variables
        if v is not learning_rate
    ]


def fit(task, data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task.fit(*data, batch_size=2, epochs=1, verbose=0)
    return [str(w.message) for w in caught if SKIPPING in str(w.message)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_reloaded_task_trains(tmp_path, case):
    task_name, make_optimizer, lora_rank, restored = CASES[case]
    make_task, make_data = TASKS[task_name]
    data = make_data()
    task = make_task()
    if lora_rank is not None:
        task.backbone.enable_lora(lora_rank)
    task.compile(optimizer=make_optimizer())
    fit(task, data)
    path = tmp_path / "task.keras"
    task.save(path)

    reloaded = keras.saving.load_model(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded.optimizer.build(reloaded.trainable_variables)
    messages = [str(w.message) for w in caught if SKIPPING in str(w.message)]
    if restored:
        assert messages == []
        for ours, theirs in zip(
            state(reloaded.optimizer), state(task.optimizer), strict=True
        ):
            np.testing.assert_array_equal(ours, theirs)
    else:
        # Keras' own warning, naming both layouts; fresh state.
        assert len(messages) == 1, messages
        assert "The saved optimizer has" in messages[0]
        assert int(reloaded.optimizer.iterations.numpy()) == 0
    before = [np.array(w) for w in reloaded.get_weights()]
    assert fit(reloaded, data) == []
    after = reloaded.get_weights()
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(
        not np.array_equal(b, a) for b, a in zip(before, after, strict=True)
    )
