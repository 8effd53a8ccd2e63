"""The KServe v2 gRPC service's messages, compiled from kserve_v2.proto when first used.

Its messages live in a descriptor pool of their own, not protobuf's default one: tritonclient.grpc
registers the same `inference.*` names (Triton's superset of the protocol) in the default pool, and a
process that holds both (a test, a client beside the service) would refuse the second. The wire
format is what the protocol fixes, so either side's messages read the other's.

service/grpc/protocol.py registers the service's methods (grpc.py) on Serve's gRPC servers.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from types import SimpleNamespace

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO = Path(__file__).resolve().parent / "kserve_v2.proto"
PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"
# method -> (request message, response message), all unary
METHODS = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
    "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse"),
    "RepositoryModelLoad": ("RepositoryModelLoadRequest", "RepositoryModelLoadResponse"),
    "RepositoryModelUnload": ("RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"),
}


def method_path(method: str) -> str:
    """The call's full name on the wire, as clients and Ray's metrics write it."""
    return f"/{SERVICE}/{method}"


MESSAGES = sorted({name for pair in METHODS.values() for name in pair} | {"InferParameter", "InferTensorContents",
                                                                  "ModelRepositoryParameter"})


@cache
def messages() -> SimpleNamespace:
    """Every message class of the service, by name (ModelInferRequest, InferParameter, ...)."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_compiled())
    classes = {}
    for name in MESSAGES:
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        # importable by name, so that a message pickles: Serve's proxy actor hands a request it routes
        # to a replica pickled (module __getattr__ below finds the class again there)
        cls.__module__, cls.__qualname__ = __name__, name
        classes[name] = cls
    return SimpleNamespace(**classes)


def __getattr__(name: str):
    """`service.apis.kserve_v2.messages.ModelInferRequest` and the others, compiled when first asked for."""
    if name in MESSAGES:
        return getattr(messages(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _compiled() -> descriptor_pb2.FileDescriptorProto:
    """kserve_v2.proto as protoc reads it (grpcio-tools' protoc, run as a child process: its in-process
    entry point registers into the default pool, which is what this module avoids)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kserve_v2.pb"
        run = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parent}", f"--descriptor_set_out={out}", PROTO.name],
            capture_output=True, text=True, check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(f"protoc could not compile {PROTO}: {run.stderr.strip() or run.stdout.strip()}")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (proto,) = files.file
    return proto
