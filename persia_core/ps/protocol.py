"""The parameter-server protocol's constants, shared by the server, its clients and the launchers.

A leaf module (standard library only): a launcher or a pipeline compiler that needs the token variable or an
exit code imports this, not the gRPC server. The service and its calls are described in
``persia_core.ps.servicer``; the message encoding in ``persia_core.ps.wire``.
"""

SERVICE = "persia.ParameterServer"
"""The gRPC service name: calls are ``/persia.ParameterServer/<Method>``."""
TOKEN_ENV = "PERSIA_PS_TOKEN"
"""Environment variable holding the shared token every call carries (servers refuse calls without it)."""
TOKEN_SECRET_ENV = "PERSIA_PS_TOKEN_SECRET"
"""Environment variable naming a Secret Manager secret version that holds the token (Vertex AI jobs)."""
TOKEN_HEADER = "x-persia-token"
"""gRPC metadata key of the token."""
STORAGE_ROOTS_ENV = "PERSIA_PS_STORAGE_ROOTS"
"""Environment variable: comma-separated storage roots, the only places ``Dump`` and ``Load`` may reach."""
MAX_MESSAGE_BYTES = 1 << 30
"""Largest gRPC message either side sends or accepts (bytes)."""
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
"""Channel and server options of every parameter-server connection."""
EXIT_BAD_INIT = 3
"""Exit code of the server's ``main`` when the state to start from is refused (missing, partial or corrupt)."""
EXIT_PORT_IN_USE = 4
"""Exit code of the server's ``main`` when its port cannot be bound (``servicer.PortInUse``)."""
EW_ADDRESSES_ENV = "PERSIA_EMBEDDING_WORKER_ADDRESSES"
"""Environment variable of an NN worker: comma-separated ``host:port`` of its embedding workers on other hosts
(``persia_core.train.ready_stream``); unset: they run beside it (shared memory)."""
