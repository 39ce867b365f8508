"""What both services share: the generated contract, the tensor-reference
codec, shared-memory naming and validation, and error codes <-> gRPC status.

The two services (`tokenizer_svc`, `scheduler_svc`) import from here and never
from each other.
"""

__version__ = "0.1.0"
