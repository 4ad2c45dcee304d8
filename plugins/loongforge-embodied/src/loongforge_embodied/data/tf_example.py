"""``tf.train.Example`` without TensorFlow: the message types declared to protobuf at run time, and a parser that
turns one serialized Example into ``{feature key: numpy array or list of bytes}``.

The messages are those of TensorFlow's ``core/example/example.proto`` and ``feature.proto`` (proto3, package
``tensorflow``)::

    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }
    message Feature { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    message Features { map<string, Feature> feature = 1; }
    message Example { Features features = 1; }

Why build them from a ``FileDescriptorProto`` rather than ship generated ``*_pb2`` modules: generated code is tied
to the protobuf release that generated it, while the descriptor API is stable across protobuf 4-7, so only
``protobuf`` itself is needed (the plugin's ``rlds`` extra). They live in a private descriptor pool, so a
TensorFlow imported in the same process (which registers ``tensorflow.Example`` in the default pool) cannot clash.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

_PACKAGE = "tensorflow"
_F = descriptor_pb2.FieldDescriptorProto


def _field(message: Any, name: str, number: int, kind: int, *, repeated: bool = False, type_name: str = "",
           oneof: int | None = None) -> None:
    field = message.field.add(name=name, number=number, type=kind,
                              label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
    if type_name:
        field.type_name = f".{_PACKAGE}.{type_name}"
    if oneof is not None:
        field.oneof_index = oneof


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """example.proto and feature.proto as one file (proto3: repeated scalars are packed, as TensorFlow writes)."""
    proto = descriptor_pb2.FileDescriptorProto(name="loongforge_tf_example.proto", package=_PACKAGE, syntax="proto3")
    for name, kind in (("BytesList", _F.TYPE_BYTES), ("FloatList", _F.TYPE_FLOAT), ("Int64List", _F.TYPE_INT64)):
        _field(proto.message_type.add(name=name), "value", 1, kind, repeated=True)
    feature = proto.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, type_name) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"),
                                                ("int64_list", "Int64List")), start=1):
        _field(feature, name, number, _F.TYPE_MESSAGE, type_name=type_name, oneof=0)
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")  # how protoc spells map<string, Feature>
    entry.options.map_entry = True
    _field(entry, "key", 1, _F.TYPE_STRING)
    _field(entry, "value", 2, _F.TYPE_MESSAGE, type_name="Feature")
    _field(features, "feature", 1, _F.TYPE_MESSAGE, repeated=True, type_name="Features.FeatureEntry")
    _field(proto.message_type.add(name="Example"), "features", 1, _F.TYPE_MESSAGE, type_name="Features")
    return proto


@cache
def example_class() -> type:
    """The ``tensorflow.Example`` message class (built once, in a private pool)."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file_descriptor())
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Example"))


def parse_example(data: bytes) -> dict[str, np.ndarray | list[bytes]]:
    """A serialized Example -> feature key -> int64 / float32 array, or list of bytes; ``ValueError`` when ``data``
    is not an Example."""
    example = example_class()()
    try:
        example.ParseFromString(data)
    except DecodeError as err:
        raise ValueError(f"not a tf.train.Example ({err})") from None
    parsed: dict[str, np.ndarray | list[bytes]] = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            parsed[key] = list(feature.bytes_list.value)
        elif kind == "float_list":
            parsed[key] = np.asarray(feature.float_list.value, dtype=np.float32)
        else:  # int64_list, or no kind at all (an empty feature): an empty int64 array
            parsed[key] = np.asarray(feature.int64_list.value if kind else (), dtype=np.int64)
    return parsed


def serialize_example(features: dict[str, np.ndarray | list[bytes]]) -> bytes:
    """Feature key -> values (bytes list, or an array: integer/bool kinds as ``int64_list``, floats as
    ``float_list``) -> a serialized Example, flattened row-major as TFDS flattens a step sequence."""
    example = example_class()()
    for key, values in features.items():
        feature = example.features.feature[key]
        if isinstance(values, list):
            feature.bytes_list.value.extend(values)
            continue
        array = np.asarray(values).reshape(-1)
        if array.dtype.kind in "biu":
            feature.int64_list.value.extend(array.astype(np.int64).tolist())
        else:
            feature.float_list.value.extend(array.astype(np.float32).tolist())
    return example.SerializeToString(deterministic=True)
