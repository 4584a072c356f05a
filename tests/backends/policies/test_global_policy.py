"""The global policy: set_dtype_policy, dtype_policy and policy_scope."""

import threading

import keras
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy import DTypePolicy


def test_seed_example_word_for_word():
    kdp.set_dtype_policy("mixed_float16")
    layer1 = keras.layers.Dense(10)
    assert repr(layer1.dtype_policy) == '<DTypePolicy "mixed_float16">'
    layer2 = keras.layers.Dense(10, dtype="float32")
    assert repr(layer2.dtype_policy) == '<DTypePolicy "float32">'
    kdp.set_dtype_policy("float32")
    assert keras.layers.Dense(10).dtype_policy.name == "float32"
    assert keras.layers.Dense(10).compute_dtype == "float32"


def test_names_set_this_packages_policy_as_keras_global():
    kdp.set_dtype_policy("mixed_bfloat16")
    assert type(keras.config.dtype_policy()) is DTypePolicy
    assert kdp.dtype_policy() == DTypePolicy("mixed_bfloat16")
    assert keras.layers.Dense(2).dtype_policy is kdp.dtype_policy()


def test_accepts_any_keras_policy_object():
    policy = keras.DTypePolicy("mixed_float16")
    kdp.set_dtype_policy(policy)
    assert kdp.dtype_policy() is policy


def test_reads_what_keras_set():
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert kdp.dtype_policy().name == "mixed_bfloat16"


def test_none_restores_the_default_float_policy():
    # set_dtype_policy refuses None, as Keras' does; set_global_policy, the
    # tf.keras spelling, takes it, as tf.keras' did.
    kdp.set_dtype_policy("mixed_bfloat16")
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        kdp.set_dtype_policy(None)
    assert kdp.dtype_policy().name == "mixed_bfloat16"
    kdp.set_global_policy(None)
    assert kdp.dtype_policy().name == keras.config.floatx()
    assert type(kdp.dtype_policy()) is kdp.DTypePolicy
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        keras.config.set_dtype_policy(None)
    with pytest.raises(ValueError, match="Received: policy=None"):
        with kdp.policy_scope(None):
            pass


@pytest.mark.parametrize("bad", [16, ["float32"]])
def test_bad_policy_is_keras_value_error_and_changes_nothing(bad):
    kdp.set_dtype_policy("mixed_bfloat16")
    # The error type and the start of the message are Keras' own.
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        keras.config.set_dtype_policy(bad)
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        kdp.set_dtype_policy(bad)
    with pytest.raises(ValueError, match="Received: policy="):
        with kdp.policy_scope(bad):
            pass
    assert kdp.dtype_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "name",
    ["int8_from_float32", "int8_from_mixed_bfloat16", "int4_from_float32"],
)
def test_quantized_names_give_keras_own_quantized_policies(name):
    # Keras 3.12 to 3.15 take a quantized global policy; 3.16 refuses one
    # (call a layer's quantize() instead): the package does as Keras does.
    release = tuple(int(part) for part in keras.__version__.split(".")[:2])
    if release >= (3, 16):
        for set_policy in (keras.config.set_dtype_policy, kdp.set_dtype_policy):
            with pytest.raises(ValueError, match="cannot be quantized"):
                set_policy(name)
        with pytest.raises(ValueError, match="cannot be quantized"):
            with kdp.policy_scope(name):
                pass
        assert kdp.dtype_policy().name == "float32"
        return
    kdp.set_dtype_policy(name)
    ours = kdp.dtype_policy()
    keras.config.set_dtype_policy(name)
    theirs = keras.config.dtype_policy()
    assert type(ours) is type(theirs)
    assert ours.name == theirs.name
    assert ours.quantization_mode == theirs.quantization_mode
    with kdp.policy_scope(name) as scoped:
        assert type(scoped) is type(theirs)


def test_unknown_name_is_a_value_error_and_changes_nothing():
    with pytest.raises(ValueError, match="Received: name='mixed_float32'"):
        kdp.set_dtype_policy("mixed_float32")
    assert kdp.dtype_policy().name == "float32"


def test_policy_scope_restores_on_exit_and_on_error():
    with kdp.policy_scope("mixed_float16") as policy:
        assert policy == DTypePolicy("mixed_float16")
        assert keras.layers.Dense(2).compute_dtype == "float16"
        with kdp.policy_scope("mixed_bfloat16"):
            assert keras.layers.Dense(2).compute_dtype == "bfloat16"
        assert kdp.dtype_policy().name == "mixed_float16"
    assert kdp.dtype_policy().name == "float32"
    with pytest.raises(RuntimeError, match="boom"):
        with kdp.policy_scope("mixed_float16"):
            raise RuntimeError("boom")
    assert kdp.dtype_policy().name == "float32"


def test_global_policy_is_per_thread():
    kdp.set_dtype_policy("mixed_bfloat16")
    seen = {}

    def worker():
        seen["before"] = kdp.dtype_policy().name
        kdp.set_dtype_policy("mixed_float16")
        seen["after"] = keras.layers.Dense(2).compute_dtype

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"before": "float32", "after": "float16"}
    assert kdp.dtype_policy().name == "mixed_bfloat16"


def test_policy_scopes_in_many_threads_leak_nothing():
    kdp.set_dtype_policy("float32")
    names = ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16"] * 2
    barrier = threading.Barrier(len(names))
    seen, errors = {}, []

    def worker(index, name):
        try:
            with kdp.policy_scope(name):
                barrier.wait(timeout=30)  # every thread inside its scope
                for _ in range(20):
                    layer = keras.layers.Dense(2)
                    assert layer.dtype_policy.name == name
                barrier.wait(timeout=30)
            seen[index] = kdp.dtype_policy().name
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [
        threading.Thread(target=worker, args=(i, n))
        for i, n in enumerate(names)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # Each thread is back at its own default; this thread never moved.
    assert set(seen.values()) == {"float32"}
    assert kdp.dtype_policy().name == "float32"
