"""Layer arguments tf.keras 2 saved that Keras 3's layers do not take.

The table is derived, not collected: tests/fixtures/tf_keras2/
layer_arguments.py asks each Keras 3 layer class which keys of the configs
tf-keras 2.21 wrote (one model per layer class both libraries have) it
refuses, and tests/backends/tf_keras_compat/test_tf_keras_every_layer.py checks
that every key it finds is here. A key is dropped only with a value that changes
nothing; any other value cannot be loaded faithfully, and says so.
"""

_ANY = object()
_RNN_LAYERS = (
    "RNN",
    "SimpleRNN",
    "LSTM",
    "GRU",
    "ConvLSTM1D",
    "ConvLSTM2D",
    "ConvLSTM3D",
)
_GROUPED_CONVOLUTIONS = (
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
)
_RANDOM_LAYERS = (
    "RandomBrightness",
    "RandomContrast",
    "RandomCrop",
    "RandomFlip",
    "RandomRotation",
    "RandomTranslation",
    "RandomZoom",
)
_SPATIAL_DROPOUTS = ("SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D")

# key: (classes, values that change nothing, why those are harmless).
UNUSED_ARGUMENTS = {
    "time_major": (
        _RNN_LAYERS,
        (False,),
        "Keras 3's recurrent layers take batch-major inputs only",
    ),
    "groups": (
        _GROUPED_CONVOLUTIONS,
        (1,),
        "tf.keras saved its convolution base class' `groups` (always 1)",
    ),
    "kernel_initializer": (
        ("SeparableConv1D", "SeparableConv2D"),
        _ANY,
        "tf.keras' separable convolutions saved, and never used, their "
        "base class' kernel arguments",
    ),
    "kernel_regularizer": (("SeparableConv1D", "SeparableConv2D"), _ANY, ""),
    "kernel_constraint": (("SeparableConv1D", "SeparableConv2D"), _ANY, ""),
    "rng_type": (
        _RANDOM_LAYERS,
        _ANY,
        "random augmentation is the identity at inference; Keras 3 draws "
        "from its own seed generator",
    ),
    "trainable": (
        ("Discretization", *_SPATIAL_DROPOUTS),
        _ANY,
        "layers without weights: nothing to train",
    ),
    "noise_shape": (
        _SPATIAL_DROPOUTS,
        (None,),
        "Keras 3 derives the spatial noise shape, as tf.keras did for None",
    ),
    "query_shape": (
        ("MultiHeadAttention",),
        _ANY,
        "the input shapes; Keras 3 builds from the shapes of the call",
    ),
    "key_shape": (("MultiHeadAttention",), _ANY, ""),
    "value_shape": (("MultiHeadAttention",), _ANY, ""),
    "softmax_robust_masking": (
        ("MultiHeadAttention",),
        (False,),
        "the default masked softmax, as Keras 3 computes it",
    ),
}


# (class, key): a default value that Keras 3's legacy .h5 loader misreads.
# It swaps any string naming a function of `keras.layers` for the function
# (Attention's score_mode "dot" becomes `keras.layers.dot`); left out, the
# value is the default again.
MISREAD_DEFAULTS = {("Attention", "score_mode"): "dot"}


class UnsupportedLayerArgument(ValueError):
    """A tf.keras 2 layer argument Keras 3 cannot reproduce."""


def drop_unused(class_name, config):
    """Removes from a layer config the tf.keras keys Keras 3 refuses.

    Args:
        class_name: The layer's class name, as saved.
        config: The layer's config dict, changed in place.

    Raises:
        UnsupportedLayerArgument: if a refused key holds a value that
            changes what the layer computes.
    """
    for key, (classes, harmless, _) in UNUSED_ARGUMENTS.items():
        if class_name not in classes or key not in config:
            continue
        value = config[key]
        if harmless is not _ANY and value not in harmless:
            raise UnsupportedLayerArgument(
                f"Layer '{config.get('name')}' ({class_name}) was saved by "
                f"tf.keras 2 with {key}={value!r}, which Keras 3's "
                f"{class_name} does not support (it takes no `{key}`): "
                "the model cannot be loaded with the same computation. "
                f"Only {key}={harmless[0]!r} loads."
            )
        del config[key]
    for (misread_class, key), default in MISREAD_DEFAULTS.items():
        if class_name == misread_class and config.get(key) == default:
            del config[key]
