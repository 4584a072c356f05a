"""The public names of the objects in a model: `keras.layers.Dense`."""


def public_class_name(obj):
    """Returns the public path of an object's class: `keras.layers.Dense`.

    Keras' backend-specific subclasses (such as the torch backend's Adam)
    are named by the public class they derive from.
    """
    for cls in type(obj).__mro__:
        module = cls.__module__
        if module.split(".")[0] == "keras_dtype_policy":
            return f"keras_dtype_policy.{cls.__qualname__}"
        if not module.startswith("keras."):
            break
        if module == "keras.src.models.functional":
            # What `keras.Model(inputs, outputs)` builds; Keras exports it
            # under no name, and `keras.Function`, its base, is no model.
            return f"keras.{cls.__qualname__}"
        paths = vars(cls).get("_api_export_path")
        if isinstance(paths, str):
            return paths
        if isinstance(paths, (list, tuple)) and paths:
            return paths[0]
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
