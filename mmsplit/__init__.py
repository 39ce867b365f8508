"""The contract of mmsplit, and what a client needs of it: the generated
stubs (with their `.proto` sources), the error codes <-> gRPC status
mapping (`mmsplit.errors`), a client library (`mmsplit.client`), the
tokenizer/scheduler pairing digests, and the conformance kit.

This package is the light client distribution (`mmsplit-client`): it imports
gRPC and protobuf and nothing heavier. What the servers share besides is
`mmsplit_server`, in the server distribution.
"""

__version__ = "0.1.0"
