"""ONNX Runtime's ``InferenceSession``, over staronnx's runtime: existing ORT code switches with
one line (``staronnx.InferenceSession``). Above :mod:`staronnx.runtime`, which knows nothing of
ORT's call shape; :mod:`staronnx.compat.session` holds the table of ORT's options and what each
does here.
"""

from staronnx.compat.errors import InvalidArgument, InvalidProtobuf, NoSuchFile, NotRecorded
from staronnx.compat.io import IOBinding
from staronnx.compat.model import ModelMetadata, NodeArg
from staronnx.compat.options import OptionNotApplied
from staronnx.compat.session import InferenceSession, SessionSpec

__all__ = ["InferenceSession", "SessionSpec", "IOBinding", "ModelMetadata", "NodeArg", "OptionNotApplied",
           "InvalidArgument", "InvalidProtobuf", "NoSuchFile", "NotRecorded"]
