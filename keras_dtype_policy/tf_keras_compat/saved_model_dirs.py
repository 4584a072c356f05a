"""SavedModel directories that tf.keras 2 wrote with `model.save(dir)`.

Such a directory holds `saved_model.pb` (TensorFlow's graph and object
graph), `keras_metadata.pb` (the model's config, and its training config
when it was compiled) and, under `variables/`, a TensorFlow checkpoint with
the weights and the optimizer's state, the loss scale and its counter
included.

The configs are read here without TensorFlow: `keras_metadata.pb` is a
small protobuf (`SavedMetadata`) whose root node carries the model's
metadata as JSON. Reading the checkpoint needs TensorFlow. The model is
then loaded the way a tf.keras 2 `.h5` file is: its weights, per layer in
tf.keras order, and the optimizer's `[iterations, slots...]` are written to
a temporary `.h5` file in tf.keras' layout, which Keras loads with this
package's translation; the loss scale and its counter are then set from the
checkpoint.
"""

import json
import pathlib
import re
import tempfile

import keras
import numpy as np

from keras_dtype_policy.tf_keras_compat import keras_files
from keras_dtype_policy.tf_keras_compat.keras_files import ModelFile
from keras_dtype_policy.tf_keras_compat.keras_files import ModelFileError

METADATA_FILE = "keras_metadata.pb"
GRAPH_FILE = "saved_model.pb"
_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_LAYER_CHILD = re.compile(r"layer-(\d+)$")
# SavedModel children that repeat what a layer's own attributes hold.
_KERAS_API_CHILDREN = {
    "variables",
    "trainable_variables",
    "non_trainable_variables",
    "regularization_losses",
    "keras_api",
}
_KERAS_OBJECTS = ("_tf_keras_layer", "_tf_keras_network", "_tf_keras_model")
_INNER_OPTIMIZER = ("inner_optimizer", "base_optimizer", "_optimizer")


def read_saved_model_dir(path):
    """Reads the configs of a tf.keras 2 SavedModel directory.

    Needs no TensorFlow: only `keras_metadata.pb` is read.

    Args:
        path: The directory.

    Returns:
        A `ModelFile` of format `"savedmodel"`.

    Raises:
        ModelFileError: if the directory is no SavedModel, was not written
            by Keras, or its metadata cannot be read.
    """
    path = pathlib.Path(path)
    metadata_path = path / METADATA_FILE
    if not metadata_path.is_file():
        if (path / GRAPH_FILE).is_file():
            raise ModelFileError(
                f"{path}: a SavedModel that Keras did not write (it holds "
                f"no {METADATA_FILE}); Keras 3 can only call it, with "
                "keras.layers.TFSMLayer"
            )
        raise ModelFileError(
            f"{path}: is a directory, but no SavedModel: expected a .keras "
            f"or .h5 file, or a directory with {METADATA_FILE}"
        )
    nodes = read_metadata_nodes(metadata_path)
    root = _root_metadata(metadata_path, nodes)
    model_config = root.get("model_config")
    if not isinstance(model_config, dict):
        raise ModelFileError(
            f"{path}: holds a subclassed {root.get('class_name', 'model')} "
            "with no config to rebuild it from; Keras 3 can only call it, "
            "with keras.layers.TFSMLayer"
        )
    keras_files.check_model_config(path, model_config)
    training_config = root.get("training_config")
    return ModelFile(
        path=path,
        format="savedmodel",
        model_config=model_config,
        compile_config=training_config or None,
        keras_version=keras_files.version_string(root.get("keras_version")),
    )


def read_metadata_nodes(path):
    """Returns the nodes of a `keras_metadata.pb` file.

    Args:
        path: The file.

    Returns:
        A list of dicts with `node_id`, `node_path`, `identifier` and
        `metadata` (the JSON text), as the file holds them.

    Raises:
        ModelFileError: if the file is not a `SavedMetadata` protobuf.
    """
    try:
        nodes = []
        for number, value in _fields(path.read_bytes()):
            if number == 1:
                nodes.append(_saved_object(value))
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelFileError(
            f"{path}: not Keras metadata (a SavedMetadata protobuf): {error}"
        ) from None
    return nodes


def _saved_object(data):
    if not isinstance(data, bytes):
        raise ValueError("a node is not a message")
    node = {"node_id": 0, "node_path": "", "identifier": "", "metadata": ""}
    names = {3: "node_path", 4: "identifier", 5: "metadata"}
    for number, value in _fields(data):
        if number == 2 and isinstance(value, int):
            node["node_id"] = value
        elif number in names and isinstance(value, bytes):
            node[names[number]] = value.decode("utf-8")
    return node


def _fields(data):
    """Yields `(field number, value)` of a protobuf message's wire format.

    Varints come as ints, length-delimited fields as bytes, fixed-width
    fields as their raw bytes.
    """
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError(f"field number 0 at byte {position}")
        if wire_type == 0:
            value, position = _varint(data, position)
        elif wire_type == 2:
            length, position = _varint(data, position)
            value = data[position : position + length]
            if len(value) != length:
                raise ValueError("truncated")
            position += length
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value = data[position : position + size]
            if len(value) != size:
                raise ValueError("truncated")
            position += size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        yield number, value


def _varint(data, position):
    result = 0
    shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def _root_metadata(path, nodes):
    roots = [node for node in nodes if node["node_path"] == "root"]
    if not roots:
        raise ModelFileError(f"{path}: its Keras metadata has no root node")
    try:
        metadata = json.loads(roots[0]["metadata"])
    except ValueError as error:
        raise ModelFileError(
            f"{path}: its root metadata is not JSON: {error}"
        ) from None
    if not isinstance(metadata, dict):
        raise ModelFileError(f"{path}: its root metadata is not an object")
    return metadata


def load_model(model_file):
    """Loads the model of a SavedModel directory, its state included.

    Args:
        model_file: A `ModelFile` of format `"savedmodel"`.

    Returns:
        A `(model, messages)` pair, as `keras_files.load_path`.

    Raises:
        ModelFileError: if TensorFlow is not installed, or the checkpoint
            does not fit the model.
    """
    directory = model_file.path
    state = read_checkpoint(directory)
    with tempfile.TemporaryDirectory(prefix="keras-dtype-policy-") as tmp:
        h5_path = pathlib.Path(tmp) / f"{directory.name or 'model'}.h5"
        write_h5(h5_path, model_file, state)
        try:
            model, messages = keras_files.load_path(h5_path)
        except ModelFileError as error:
            raise ModelFileError(
                str(error).replace(str(h5_path), str(directory))
            ) from error
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and state["optimizer"] is None:
        messages.append(
            "the SavedModel holds no optimizer state that can be read (saved "
            "with include_optimizer=False, or a tf.keras legacy optimizer): "
            "the optimizer starts afresh"
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        set_loss_scale_state(optimizer, state["loss_scale"])
    return model, messages


def set_loss_scale_state(optimizer, saved):
    """Sets a loss-scale optimizer's scale and counter to the saved ones."""
    if not optimizer.built:
        return
    scale = saved.get("current_loss_scale")
    if scale is not None and getattr(optimizer, "dynamic", True):
        optimizer.dynamic_scale.assign(np.asarray(scale, "float32"))
    counter = saved.get("good_steps")
    if counter is not None:
        optimizer.step_counter.assign(np.asarray(counter, "int64"))


def read_checkpoint(directory):
    """Reads the weights and optimizer state of a SavedModel directory.

    Args:
        directory: The directory.

    Returns:
        A dict: `layers`, a list of `(layer name, [(weight name, array)])`
        in the model's layer order; `optimizer`, the optimizer's
        `[(name, array)]` in tf.keras' order (`[iterations, slots...]`),
        or None; `loss_scale`, a dict with the `current_loss_scale` and
        `good_steps` saved, if any.

    Raises:
        ModelFileError: if TensorFlow is missing or the checkpoint cannot be
            read.
    """
    tf = _import_tensorflow(directory)
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    prefix = directory / "variables" / "variables"
    try:
        graph_def = saved_model_pb2.SavedModel()
        graph_def.ParseFromString((directory / GRAPH_FILE).read_bytes())
        objects = graph_def.meta_graphs[0].object_graph_def.nodes
        reader = tf.train.load_checkpoint(str(prefix))
        checkpoint = trackable_object_graph_pb2.TrackableObjectGraph()
        checkpoint.ParseFromString(
            reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
        )
    except Exception as error:
        message = str(error).strip().splitlines()
        raise ModelFileError(
            f"{directory}: its SavedModel cannot be read: "
            f"{type(error).__name__}: {message[0] if message else ''}"
        ) from None
    metadata = {
        node["node_id"]: node
        for node in read_metadata_nodes(directory / METADATA_FILE)
    }
    graph = _Graph(objects, checkpoint.nodes, reader, directory, metadata)
    layers = [
        (graph.layer_name(node_id), graph.layer_weights(node_id))
        for node_id in graph.layer_nodes(0)
    ]
    optimizer_id = graph.child(0, "optimizer")
    optimizer = None
    loss_scale = {}
    if optimizer_id is not None:
        optimizer = graph.optimizer_values(optimizer_id)
        scale_id = graph.child(optimizer_id, "loss_scale")
        if scale_id is not None:
            for name in ("current_loss_scale", "good_steps"):
                value_id = graph.child(scale_id, name)
                if value_id is not None:
                    loss_scale[name] = graph.value(value_id)
    return {"layers": layers, "optimizer": optimizer, "loss_scale": loss_scale}


def _import_tensorflow(directory):
    try:
        import tensorflow as tf
    except ImportError as error:
        missing = isinstance(error, ModuleNotFoundError) and error.name in (
            None,
            "tensorflow",
        )
        if not missing:
            raise ModelFileError(
                f"{directory}: reading a SavedModel directory needs "
                f"TensorFlow, which does not import: {error}"
            ) from None
        raise ModelFileError(
            f"{directory}: reading a SavedModel directory needs TensorFlow, "
            "which is not installed: pip install tensorflow-cpu (the model's "
            "weights are in a TensorFlow checkpoint)"
        ) from None
    return tf


class _Graph:
    """The SavedModel's object graph, with the checkpoint's values.

    The object graph of `saved_model.pb` (kinds of objects, variables'
    names and trainability) and the checkpoint's (where each value is)
    number their nodes alike.
    """

    def __init__(self, objects, checkpoint_nodes, reader, directory, metadata):
        if len(objects) != len(checkpoint_nodes):
            raise ModelFileError(
                f"{directory}: its checkpoint does not match its "
                f"{GRAPH_FILE} ({len(checkpoint_nodes)} objects instead of "
                f"{len(objects)})"
            )
        self._objects = objects
        self._checkpoint = checkpoint_nodes
        self._reader = reader
        self._directory = directory
        self._metadata = metadata

    def children(self, node_id):
        return [
            (c.local_name, c.node_id)
            for c in self._checkpoint[node_id].children
        ]

    def child(self, node_id, name):
        for local_name, child_id in self.children(node_id):
            if local_name == name:
                return child_id
        return None

    def kind(self, node_id):
        return self._objects[node_id].WhichOneof("kind")

    def is_variable(self, node_id):
        return self.kind(node_id) == "variable"

    def is_layer(self, node_id):
        if self.kind(node_id) != "user_object":
            return False
        identifier = self._objects[node_id].user_object.identifier
        return identifier.startswith(_KERAS_OBJECTS)

    def name(self, node_id):
        name = self._objects[node_id].variable.name
        return name if name.endswith(":0") else f"{name}:0"

    def value(self, node_id):
        keys = [
            a.checkpoint_key
            for a in self._checkpoint[node_id].attributes
            if a.checkpoint_key.endswith(_VALUE_SUFFIX)
        ]
        if not keys:
            raise ModelFileError(
                f"{self._directory}: its checkpoint holds no value for "
                f"{self.name(node_id)}"
            )
        return np.asarray(self._reader.get_tensor(keys[0]))

    def layer_nodes(self, node_id):
        """The model's layers, in its `layers` order (`layer-<i>`)."""
        found = []
        for name, child_id in self.children(node_id):
            match = _LAYER_CHILD.match(name)
            if match:
                found.append((int(match.group(1)), child_id))
        return [child_id for _, child_id in sorted(found)]

    def layer_weights(self, node_id):
        """A layer's `(name, value)`s in the order of tf.keras' `.h5` files.

        That order is tf.keras' `trainable_weights + non_trainable_weights`.
        A leaf layer's are read from its `variables` list, which tf-keras
        saves in that order (unless the model was saved with
        `save_traces=False`: then they are gathered from its attributes).
        A nested model's are built from its layers (`layer-<i>`) as
        tf.keras orders them: every layer's trainable weights, then every
        layer's others (all of them, in that order, for a frozen model).
        The checkpoint's own `variables` list of a nested model goes layer
        by layer, which is not that order.
        """
        trainable, others = self._split(node_id)
        ids = list(dict.fromkeys(trainable + others))
        return [(self.name(i), self.value(i)) for i in ids]

    def _is_trainable(self, node_id):
        return self._layer_metadata(node_id).get("trainable") is not False

    def _split(self, node_id):
        """Returns a layer's (trainable, other) weights, as node ids."""
        sublayers = self.layer_nodes(node_id)
        if not sublayers:
            listed = self.child(node_id, "variables")
            if listed is None:
                return self._gather(node_id, set(), frozen=False)
            ids = self._listed(listed)
            if not self._is_trainable(node_id):
                return [], ids
            trainable = [i for i in ids if self._objects[i].variable.trainable]
            return trainable, [i for i in ids if i not in trainable]
        trainable, others = [], []
        for sublayer in sublayers:
            more_trainable, more_others = self._split(sublayer)
            trainable += more_trainable
            others += more_others
        if not self._is_trainable(node_id):
            return [], trainable + others
        return trainable, others

    def _listed(self, node_id):
        items = []
        for name, child_id in self.children(node_id):
            if name.isdigit() and self.is_variable(child_id):
                items.append((int(name), child_id))
        return [child_id for _, child_id in sorted(items)]

    def _gather(self, node_id, seen, frozen):
        """Returns a layer's (trainable, other) weights, as node ids."""
        frozen = (
            frozen or self._layer_metadata(node_id).get("trainable") is False
        )
        own, sublayers = [], []

        def visit(current):
            for name, child_id in self.children(current):
                if child_id in seen or name in _KERAS_API_CHILDREN:
                    continue
                seen.add(child_id)
                if self.is_variable(child_id):
                    own.append(child_id)
                elif self.is_layer(child_id):
                    sublayers.append(child_id)
                elif self.kind(child_id) == "user_object":
                    visit(child_id)

        seen.add(node_id)
        visit(node_id)
        trainable = [i for i in own if self._objects[i].variable.trainable]
        others = [i for i in own if not self._objects[i].variable.trainable]
        if frozen:
            trainable, others = [], trainable + others
        for sublayer in sublayers:
            more_trainable, more_others = self._gather(sublayer, seen, frozen)
            trainable += more_trainable
            others += more_others
        return trainable, others

    def _layer_metadata(self, node_id):
        entry = self._metadata.get(node_id)
        if entry is None:
            return {}
        try:
            metadata = json.loads(entry["metadata"])
        except ValueError:
            return {}
        return metadata if isinstance(metadata, dict) else {}

    def layer_name(self, node_id):
        name = self._layer_metadata(node_id).get("name")
        return name if isinstance(name, str) else f"layer_{node_id}"

    def optimizer_values(self, node_id):
        """The optimizer's `[iterations, slots...]`, or None if unsaved."""
        listed = self.child(node_id, "_variables")
        if listed is None:
            for name in _INNER_OPTIMIZER:
                inner = self.child(node_id, name)
                if inner is not None:
                    return self.optimizer_values(inner)
            return None
        return [(self.name(i), self.value(i)) for i in self._listed(listed)]


def write_h5(path, model_file, state):
    """Writes a model and its state as tf.keras 2 would have in `.h5`."""
    import h5py

    def array(value):
        value = np.asarray(value)
        if value.dtype.name == "bfloat16":
            # HDF5 has no bfloat16; Keras casts to the variable's dtype.
            value = value.astype("float32")
        return value

    with h5py.File(path, "w") as f:
        f.attrs["model_config"] = json.dumps(model_file.model_config)
        if model_file.compile_config:
            f.attrs["training_config"] = json.dumps(model_file.compile_config)
        f.attrs["keras_version"] = model_file.keras_version or "2"
        f.attrs["backend"] = "tensorflow"
        weights = f.create_group("model_weights")
        weights.attrs["keras_version"] = model_file.keras_version or "2"
        weights.attrs["backend"] = "tensorflow"
        layer_names = []
        for name, values in state["layers"]:
            group = weights.create_group(_unique(name, layer_names))
            group.attrs["weight_names"] = _write_values(group, values, array)
            layer_names.append(group.name.rsplit("/", 1)[-1])
        weights.attrs["layer_names"] = layer_names
        if model_file.compile_config and state["optimizer"] is not None:
            group = f.create_group("optimizer_weights")
            group.attrs["weight_names"] = _write_values(
                group, state["optimizer"], array
            )


def _write_values(group, values, array):
    names = []
    for index, (name, value) in enumerate(values):
        unique = name if name not in names else f"{index}/{name}"
        group.create_dataset(unique, data=array(value))
        names.append(unique)
    return names


def _unique(name, taken):
    name = name.replace("/", "_")
    candidate = name
    index = 1
    while candidate in taken:
        candidate = f"{name}_{index}"
        index += 1
    return candidate
