"""Every private name of Keras the package relies on without patching it.

`patches.PATCHES` lists the Keras internals this package replaces;
`KERAS_INTERNALS` lists the others it reads, calls or overrides as they
are: optimizer state and hooks, a variable's storage, a layer's policy,
the `keras.src` modules it imports, and the private kernels of a backend
(PyTorch's `_foreach` calls). Each entry names its owner in the installed
Keras, the package's modules that use it, and why. A test checks every
entry on the installed Keras, failing with its name and owner when a
release moves it, and scans the package for a private name used but
listed nowhere.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class KerasInternal:
    """A private name of Keras (or of a backend) relied on, not patched.

    Attributes:
        owner: The dotted path of the class or module that holds it in
            the installed Keras (`keras.src.optimizers.adam.Adam`), or of
            the backend module (`torch`).
        attribute: Its name; None for a module imported as a whole.
        users: The package's modules that use it.
        why: What the package does with it, in one line.
        on_instances: True for an attribute each instance gets (in its
            `__init__` or `build`), not the class.
        backend: The one Keras backend that has it; None for all.
        releases: `(first, first_without)` Keras releases that have it,
            for a name that moved inside the tested range (the lookups of
            `policies/keras_internals.py` find the other); None for all.
    """

    owner: str
    attribute: str | None
    users: tuple[str, ...]
    why: str
    on_instances: bool = False
    backend: str | None = None
    releases: tuple[tuple[int, int], tuple[int, int]] | None = None

    @property
    def target(self) -> str:
        """The dotted path of the name: `owner.attribute`."""
        if self.attribute is None:
            return self.owner
        return f"{self.owner}.{self.attribute}"


_OPTIMIZER = "keras.src.optimizers.base_optimizer.BaseOptimizer"
_LSO = "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"
_VARIABLE = "keras.src.backend.common.variables.Variable"
_LAYER = "keras.src.layers.layer.Layer"
_POLICY = "keras.src.dtype_policies.dtype_policy.DTypePolicy"
_TORCH_OPTIMIZERS = "keras.src.backend.torch.optimizers"
_LP = "low_precision"
_TF_KERAS_POLICIES = (
    "tf_keras_compat.legacy_policy tf_keras_compat.tf_keras_policy"
)


def _internal(owner, attribute, users, why, **kwargs):
    """A `KerasInternal` whose `users` are given as one string."""
    users = tuple(users.split()) if isinstance(users, str) else users
    return KerasInternal(owner, attribute, users, why, **kwargs)


# Every private name of Keras (and of a backend) that the package uses
# without patching it. A test checks each on the installed Keras, and
# scans the package for private names not listed here or in the patches.
KERAS_INTERNALS = (
    # The optimizer's own state and steps.
    _internal(
        _OPTIMIZER,
        "_variables",
        "loss_scaling.optimizer loss_scaling.optimizer_state "
        f"{_LP}.optimizer {_LP}.state_sharding {_LP}.slot_lists",
        "Every value an optimizer tracks, in Keras' save order.",
        on_instances=True,
    ),
    _internal(
        _OPTIMIZER,
        "_trainable_variables",
        "loss_scaling.optimizer loss_scaling.optimizer_state "
        f"{_LP}.optimizer {_LP}.slot_lists",
        "The variables an optimizer was built on, in slot order.",
        on_instances=True,
    ),
    _internal(
        _OPTIMIZER,
        "_iterations",
        f"{_LP}.optimizer {_LP}.tensorflow_step",
        "The step counter, advanced by the wrapper's own fused steps.",
        on_instances=True,
    ),
    _internal(
        _OPTIMIZER,
        "_learning_rate",
        f"loss_scaling.optimizer_state {_LP}.optimizer {_LP}.optimizer_values "
        "tf_keras_compat.state_transfer",
        "The learning rate as given (a Variable or a schedule).",
        on_instances=True,
    ),
    _internal(
        _OPTIMIZER,
        "_get_variable_index",
        f"loss_scaling.optimizer {_LP}.torch_coded_adam {_LP}.torch_step",
        "The slot index of a variable, to read its slots in a fused step.",
    ),
    _internal(
        _OPTIMIZER,
        "_var_key",
        f"{_LP}.float32_views",
        "How slots are keyed; routed on the inner optimizer "
        "(INSTANCE_PATCHES).",
    ),
    _internal(
        _OPTIMIZER,
        "_track_variable",
        f"{_LP}.optimizer",
        "Track the wrapper's own seed state for saving.",
    ),
    _internal(
        _OPTIMIZER,
        "_tracker",
        f"{_LP}.stand_ins",
        "What an optimizer adds to its variables; stand-ins kept out.",
        on_instances=True,
    ),
    _internal(
        _OPTIMIZER,
        "_clip_gradients",
        f"{_LP}.optimizer",
        "Clip as the inner optimizer would (clipnorm, clipvalue).",
    ),
    _internal(
        _OPTIMIZER,
        "_use_weight_decay",
        f"{_LP}.optimizer {_LP}.torch_coded_adam {_LP}.tensorflow_step",
        "Which variables the inner optimizer decays.",
    ),
    _internal(
        _OPTIMIZER,
        "_apply_weight_decay",
        f"{_LP}.torch_step {_LP}.optimizer",
        "Decay the weights as the inner optimizer would, before a step.",
    ),
    _internal(
        _OPTIMIZER,
        "_backend_update_step",
        f"{_LP}.optimizer",
        "The inner optimizer's own update of one released variable.",
    ),
    _internal(
        _OPTIMIZER,
        "_overwrite_variable_with_gradient",
        "loss_scaling.optimizer",
        "Which variables take their gradient as their new value.",
    ),
    _internal(
        "keras.src.optimizers.adam.Adam",
        "_momentums",
        f"{_LP}.torch_coded_adam {_LP}.torch_step",
        "Adam's first moments, read in the fused torch steps.",
        on_instances=True,
    ),
    _internal(
        "keras.src.optimizers.adam.Adam",
        "_velocities",
        f"{_LP}.torch_coded_adam {_LP}.torch_step",
        "Adam's second moments, read in the fused torch steps.",
        on_instances=True,
    ),
    _internal(
        "keras.src.optimizers.adam.Adam",
        "_velocity_hats",
        f"{_LP}.torch_step",
        "AMSGrad's largest second moments, for torch's fused Adam.",
        on_instances=True,
    ),
    _internal(
        "keras.src.optimizers.nadam.Nadam",
        "_u_product",
        f"loss_scaling.optimizer_state {_LP}.inner_step",
        "Nadam's running momentum product, a value of its own state.",
        on_instances=True,
    ),
    # Keras' LossScaleOptimizer: hooks the package's subclass overrides.
    _internal(
        _LSO,
        "_common_apply",
        "loss_scaling.optimizer loss_scaling.tf_replicas",
        "Overridden: Keras' apply() runs the step through it.",
    ),
    _internal(
        _LSO,
        "_stateful_handle_finite_grads",
        "loss_scaling.optimizer loss_scaling.tf_replicas",
        "Overridden: the step of finite gradients.",
    ),
    _internal(
        _LSO,
        "_stateful_handle_non_finite_grads",
        "loss_scaling.optimizer loss_scaling.tf_replicas",
        "Overridden: the skipped step of non-finite gradients.",
    ),
    # Keras' torch backend.
    *(
        _internal(
            f"{_TORCH_OPTIMIZERS}.{module}",
            "_parallel_update_step",
            f"{_LP}.torch_step",
            "The torch optimizer's batched update, run on float32 views.",
            backend="torch",
        )
        for module in (
            "torch_adadelta.Adadelta",
            "torch_adagrad.Adagrad",
            "torch_adamax.Adamax",
            "torch_lion.Lion",
            "torch_rmsprop.RMSprop",
            "torch_sgd.SGD",
        )
    ),
    *(
        _internal(
            f"{_TORCH_OPTIMIZERS}.{module}",
            None,
            f"{_LP}.torch_step",
            "Keras' torch optimizer classes, recognised by identity.",
            backend="torch",
        )
        for module in (
            "torch_adadelta",
            "torch_adagrad",
            "torch_adam",
            "torch_adamax",
            "torch_adamw",
            "torch_lion",
            "torch_rmsprop",
            "torch_sgd",
        )
    ),
    # Variables.
    _internal(
        _VARIABLE,
        "_value",
        f"{_LP}.torch_arena {_LP}.torch_coded_adam {_LP}.torch_sharding "
        f"{_LP}.torch_step",
        "A variable's backend tensor, updated in place by the torch steps.",
        on_instances=True,
    ),
    _internal(
        _VARIABLE,
        "_shape",
        f"{_LP}.stand_ins",
        "A stand-in's own scalar shape, while Keras makes its storage.",
        on_instances=True,
    ),
    _internal(
        "tensorflow.python.autograph.impl.api",
        "is_autograph_artifact",
        "unconverted",
        "AutoGraph calls a function with `autograph_info__` (what "
        "do_not_convert sets) unconverted: the optimizers carry it.",
        backend="tensorflow",
    ),
    *(
        _internal(
            "keras.src.backend.tensorflow.core.Variable",
            name,
            f"{_LP}.stand_ins",
            "Overridden: TensorFlow's checkpoints save no stand-in.",
            backend="tensorflow",
        )
        for name in ("_serialize_to_tensors", "_restore_from_tensors")
    ),
    *(
        _internal(
            "keras.src.backend.tensorflow.core.Variable",
            name,
            f"{_LP}.stand_ins",
            "Overridden: a SavedModel exports a stand-in's own storage.",
            backend="tensorflow",
        )
        for name in (
            "_export_to_saved_model_graph",
            "_copy_trackable_to_cpu",
            "_write_object_proto",
        )
    ),
    _internal(
        _VARIABLE,
        "_layout",
        f"{_LP}.float32_views {_LP}.optimizer {_LP}.state_sharding "
        f"{_LP}.torch_sharding {_LP}.jax_reduce_scatter",
        "A variable's distribution layout, copied to views and sharded.",
        on_instances=True,
    ),
    _internal(
        "keras.src.backend.jax.trainer.JAXTrainer",
        "_update_metrics_variables",
        f"{_LP}.jax_reduce_scatter",
        "Called: the reduce-scatter train step updates the metrics as "
        "Keras' JAX train step does.",
        backend="jax",
    ),
    # Keras' torch distribution API (its development builds, 3.16).
    _internal(
        "keras.src.backend.torch.ops.core.Variable",
        "_initialize",
        f"{_LP}.torch_sharding",
        "Lays a torch variable's value out anew (assign keeps its layout).",
        backend="torch",
        releases=((3, 16), (3, 17)),
    ),
    _internal(
        "keras.src.backend.torch.ops.core",
        "KerasDTensorPromotionMode",
        f"{_LP}.torch_sharding",
        "Promotes plain tensors meeting split state to replicated DTensors.",
        backend="torch",
        releases=((3, 16), (3, 17)),
    ),
    _internal(
        "keras.src.backend.torch.distribution_lib",
        "DTensorLayout",
        f"{_LP}.torch_sharding",
        "The torch layout Keras keeps on a distributed variable.",
        backend="torch",
        releases=((3, 16), (3, 17)),
    ),
    _internal(
        "keras.src.optimizers.multi_optimizer.MultiOptimizer",
        "_optimizer_map",
        f"{_LP}.multi_optimizers",
        "A MultiOptimizer's OptimizerMap or callable, wrapped per entry.",
        on_instances=True,
        releases=((3, 15), (3, 17)),
    ),
    # Layers, models, policies.
    _internal(
        _LAYER,
        "_dtype_policy",
        "loss_scaling.compile_hook policies.float8 policies.rules_application",
        "A layer's policy as set, read and set without the property.",
        on_instances=True,
    ),
    _internal(
        _LAYER,
        "_convert_input_args",
        "policies.rules_application",
        "Whether a layer casts its inputs to its compute dtype.",
        on_instances=True,
    ),
    _internal(
        _LAYER,
        "_flatten_layers",
        "policies.keras_internals",
        "The layers a layer tracks (the one layer walk).",
    ),
    _internal(
        _LAYER,
        "_float8_call",
        "policies.keras_internals",
        "Where a layer class gets its float8 path (to Keras 3.15).",
        releases=((3, 12), (3, 16)),
    ),
    _internal(
        _LAYER,
        "_quantization_geometry",
        "policies.keras_internals",
        "Where a layer class gets its float8 path (Keras 3.16).",
        releases=((3, 16), (3, 17)),
    ),
    _internal(
        "keras.src.layers.core.dense.Dense",
        "_is_quantized",
        "policies.float8",
        "Set by quantize(): the layer already trains quantized.",
        on_instances=True,
    ),
    _internal(
        "keras.src.layers.core.dense.Dense",
        "_api_export_path",
        "policies.introspection",
        "The public path of a Keras class, set by its export decorator.",
    ),
    _internal(
        "keras.src.models.model.Model",
        "_compile_config",
        "loss_scaling.compile_hook",
        "The compile arguments a model saves: the optimizer as given.",
        on_instances=True,
    ),
    _internal(
        _POLICY,
        "_parse_name",
        "policies.policy tf_keras_compat.legacy_policy "
        "tf_keras_compat.tf_keras_policy",
        "Overridden: Keras' __init__ reads the name through it.",
    ),
    *(
        _internal(
            _POLICY,
            name,
            users,
            "Set by the tf.keras policies, read by Keras' properties.",
            on_instances=True,
        )
        for name, users in (
            ("_name", _TF_KERAS_POLICIES),
            ("_compute_dtype", _TF_KERAS_POLICIES),
            ("_variable_dtype", _TF_KERAS_POLICIES),
            ("_quantization_mode", "tf_keras_compat.legacy_policy"),
        )
    ),
    # Modules of keras.src.
    *(
        _internal(owner, attribute, users, why)
        for owner, attribute, users, why in (
            (
                "keras.src",
                "dtype_policies",
                "patches policies.global_policy",
                "Where layers look policies up (patched there).",
            ),
            ("keras.src.layers.layer", "Layer", "patches", "Patched."),
            (
                "keras.src.legacy.saving",
                "legacy_h5_format",
                "patches",
                "Patched: the .h5 reader.",
            ),
            (
                "keras.src.legacy.saving",
                "saving_utils",
                "patches",
                "Patched: the .h5 config readers.",
            ),
            ("keras.src.ops.operation", "Operation", "patches", "Patched."),
            (
                "keras.src.optimizers.loss_scale_optimizer",
                "LossScaleOptimizer",
                "patches",
                "Patched: its from_config.",
            ),
            (
                "keras.src.saving",
                "saving_lib",
                "patches",
                "Patched: the .keras reader.",
            ),
            (
                "keras.src.saving.keras_saveable",
                "KerasSaveable",
                "loss_scaling.saved_layouts",
                "The base Keras saves and loads objects through.",
            ),
            (
                "keras.src.trainers.trainer",
                None,
                "policies.keras_internals",
                "Defines the trainer class that compile is patched on.",
            ),
            (
                "keras.src.backend.common",
                "global_state",
                "tools.memory_plan_models",
                "Where Keras lists the variables a stateless scope deferred.",
            ),
            (
                "keras.src.models.functional",
                "Functional",
                "policies.introspection tf_keras_compat.config_translation",
                "The class of keras.Model(inputs, outputs), by module.",
            ),
        )
    ),
    _internal(
        "keras.src.dtype_policies.dtype_policy",
        "QUANTIZATION_MODES",
        "policies.keras_internals",
        "The quantization modes (to Keras 3.15).",
        releases=((3, 12), (3, 16)),
    ),
    _internal(
        "keras.src.quantizers.strategy_registry",
        "registered_modes",
        "policies.keras_internals",
        "The quantization modes (Keras 3.16).",
        releases=((3, 16), (3, 17)),
    ),
    # Private kernels of PyTorch.
    *(
        _internal("torch", name, users, why, backend="torch")
        for name, users, why in (
            (
                "_foreach_copy_",
                f"{_LP}.torch_arena",
                "Copy many tensors in one call.",
            ),
            (
                "_foreach_add_",
                f"{_LP}.torch_step",
                "Add many tensors in one call.",
            ),
            (
                "_foreach_zero_",
                f"{_LP}.torch_coded_adam",
                "Zero many tensors in one call.",
            ),
            (
                "_fused_adam_",
                f"{_LP}.torch_step",
                "torch's one-pass Adam, the general path's Adam and AdamW.",
            ),
            (
                "_amp_foreach_non_finite_check_and_unscale_",
                "loss_scaling.gradient_check",
                "Unscale and check gradients in one kernel, as torch.amp.",
            ),
        )
    ),
)
