from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_REQUEST: _ClassVar[ErrorCode]
    ERROR_CODE_MEDIA_DECODE_FAILED: _ClassVar[ErrorCode]
    ERROR_CODE_MEDIA_UNSUPPORTED: _ClassVar[ErrorCode]
    ERROR_CODE_MEDIA_TOO_LARGE: _ClassVar[ErrorCode]
    ERROR_CODE_MEDIA_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_MEDIA_SOURCE_FORBIDDEN: _ClassVar[ErrorCode]
    ERROR_CODE_MEDIA_FETCH_FAILED: _ClassVar[ErrorCode]
    ERROR_CODE_PREPROCESS_TIMEOUT: _ClassVar[ErrorCode]
    ERROR_CODE_PREPROCESS_WORKER_CRASHED: _ClassVar[ErrorCode]
    ERROR_CODE_OVERLOADED: _ClassVar[ErrorCode]
    ERROR_CODE_FEATURE_TRANSPORT_FAILED: _ClassVar[ErrorCode]
    ERROR_CODE_SCHEDULER_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_CANCELLED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_DEADLINE_EXCEEDED: _ClassVar[ErrorCode]
    ERROR_CODE_SHUTTING_DOWN: _ClassVar[ErrorCode]
    ERROR_CODE_UNAUTHENTICATED: _ClassVar[ErrorCode]

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_INT64: _ClassVar[Dtype]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LENGTH: _ClassVar[FinishReason]
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_REQUEST: ErrorCode
ERROR_CODE_MEDIA_DECODE_FAILED: ErrorCode
ERROR_CODE_MEDIA_UNSUPPORTED: ErrorCode
ERROR_CODE_MEDIA_TOO_LARGE: ErrorCode
ERROR_CODE_MEDIA_NOT_FOUND: ErrorCode
ERROR_CODE_MEDIA_SOURCE_FORBIDDEN: ErrorCode
ERROR_CODE_MEDIA_FETCH_FAILED: ErrorCode
ERROR_CODE_PREPROCESS_TIMEOUT: ErrorCode
ERROR_CODE_PREPROCESS_WORKER_CRASHED: ErrorCode
ERROR_CODE_OVERLOADED: ErrorCode
ERROR_CODE_FEATURE_TRANSPORT_FAILED: ErrorCode
ERROR_CODE_SCHEDULER_UNAVAILABLE: ErrorCode
ERROR_CODE_CANCELLED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_DEADLINE_EXCEEDED: ErrorCode
ERROR_CODE_SHUTTING_DOWN: ErrorCode
ERROR_CODE_UNAUTHENTICATED: ErrorCode
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
DTYPE_UINT8: Dtype
DTYPE_INT64: Dtype
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_CUDA_IPC: Transport
TRANSPORT_INLINE: Transport
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
MODALITY_AUDIO: Modality
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONTEXT_LENGTH: FinishReason

class ShmSlice(_message.Message):
    __slots__ = ("segment", "offset", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    nbytes: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("handle", "device_uuid", "offset", "nbytes", "lease")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device_uuid: str
    offset: int
    nbytes: int
    lease: str
    def __init__(self, handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., lease: _Optional[str] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("table", "index", "tag")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    table: str
    index: int
    tag: bytes
    def __init__(self, table: _Optional[str] = ..., index: _Optional[int] = ..., tag: _Optional[bytes] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("dtype", "shape", "shm", "cuda_ipc", "inline", "grant")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    shm: ShmSlice
    cuda_ipc: CudaIpcHandle
    inline: bytes
    grant: Grant
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., shm: _Optional[_Union[ShmSlice, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., inline: _Optional[bytes] = ..., grant: _Optional[_Union[Grant, _Mapping]] = ...) -> None: ...

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MultimodalItem(_message.Message):
    __slots__ = ("modality", "tensors", "placeholders", "content_hash")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorRef
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorRef, _Mapping]] = ...) -> None: ...
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDERS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    tensors: _containers.MessageMap[str, TensorRef]
    placeholders: _containers.RepeatedCompositeFieldContainer[PlaceholderRange]
    content_hash: bytes
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., tensors: _Optional[_Mapping[str, TensorRef]] = ..., placeholders: _Optional[_Iterable[_Union[PlaceholderRange, _Mapping]]] = ..., content_hash: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "seed", "top_p", "top_k", "min_tokens", "stop_token_ids", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "json_schema", "regex", "choice", "grammar", "min_p", "ignore_eos", "include_stop_str_in_output", "prompt_logprobs", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    seed: int
    top_p: float
    top_k: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    min_p: float
    ignore_eos: bool
    include_stop_str_in_output: bool
    prompt_logprobs: int
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., min_p: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model", "tp_size", "transports", "shm_namespace", "shm_prefix", "version", "rank_active_requests", "running_requests", "queued_requests", "kv_budget_tokens", "kv_reserved_tokens", "preprocess_cache_hits", "preprocess_cache_misses", "preprocess_cache_bytes", "encoder_cache_hits", "encoder_cache_misses", "encoder_cache_bytes", "shm_slab_bytes", "shm_slab_used_bytes", "cuda_device_uuids", "cuda_ipc_pool_bytes", "cuda_ipc_pool_used_bytes", "vocabulary", "item_rules", "cuda_ipc_open_pools", "prefix_cache_hits", "prefix_cache_misses", "prefix_cache_hit_tokens", "prefix_cache_bytes", "generate_stream", "max_message_bytes", "prefix_cache_diverged", "encoder_cache_diverged", "max_context_tokens", "one_frame_image_rows", "encoder_input_dtype", "image_min_pixels", "image_max_pixels", "max_tensor_bytes", "eos_token_ids", "default_max_tokens", "max_tokens_limit", "tool_call_parser", "reasoning_parser", "image_min_tiles", "image_max_tiles")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SHM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_SLAB_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_SLAB_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    ITEM_RULES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_OPEN_POOLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATE_STREAM_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_DIVERGED_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_DIVERGED_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ONE_FRAME_IMAGE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_MIN_TILES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_MAX_TILES_FIELD_NUMBER: _ClassVar[int]
    model: str
    tp_size: int
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    shm_namespace: str
    shm_prefix: str
    version: str
    rank_active_requests: _containers.RepeatedScalarFieldContainer[int]
    running_requests: int
    queued_requests: int
    kv_budget_tokens: int
    kv_reserved_tokens: int
    preprocess_cache_hits: int
    preprocess_cache_misses: int
    preprocess_cache_bytes: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    encoder_cache_bytes: int
    shm_slab_bytes: int
    shm_slab_used_bytes: int
    cuda_device_uuids: _containers.RepeatedScalarFieldContainer[str]
    cuda_ipc_pool_bytes: int
    cuda_ipc_pool_used_bytes: int
    vocabulary: str
    item_rules: str
    cuda_ipc_open_pools: int
    prefix_cache_hits: int
    prefix_cache_misses: int
    prefix_cache_hit_tokens: int
    prefix_cache_bytes: int
    generate_stream: bool
    max_message_bytes: int
    prefix_cache_diverged: bool
    encoder_cache_diverged: bool
    max_context_tokens: int
    one_frame_image_rows: bool
    encoder_input_dtype: Dtype
    image_min_pixels: int
    image_max_pixels: int
    max_tensor_bytes: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    default_max_tokens: int
    max_tokens_limit: int
    tool_call_parser: str
    reasoning_parser: str
    image_min_tiles: int
    image_max_tiles: int
    def __init__(self, model: _Optional[str] = ..., tp_size: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., shm_namespace: _Optional[str] = ..., shm_prefix: _Optional[str] = ..., version: _Optional[str] = ..., rank_active_requests: _Optional[_Iterable[int]] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., kv_reserved_tokens: _Optional[int] = ..., preprocess_cache_hits: _Optional[int] = ..., preprocess_cache_misses: _Optional[int] = ..., preprocess_cache_bytes: _Optional[int] = ..., encoder_cache_hits: _Optional[int] = ..., encoder_cache_misses: _Optional[int] = ..., encoder_cache_bytes: _Optional[int] = ..., shm_slab_bytes: _Optional[int] = ..., shm_slab_used_bytes: _Optional[int] = ..., cuda_device_uuids: _Optional[_Iterable[str]] = ..., cuda_ipc_pool_bytes: _Optional[int] = ..., cuda_ipc_pool_used_bytes: _Optional[int] = ..., vocabulary: _Optional[str] = ..., item_rules: _Optional[str] = ..., cuda_ipc_open_pools: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_misses: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., generate_stream: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., prefix_cache_diverged: _Optional[bool] = ..., encoder_cache_diverged: _Optional[bool] = ..., max_context_tokens: _Optional[int] = ..., one_frame_image_rows: _Optional[bool] = ..., encoder_input_dtype: _Optional[_Union[Dtype, str]] = ..., image_min_pixels: _Optional[int] = ..., image_max_pixels: _Optional[int] = ..., max_tensor_bytes: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., default_max_tokens: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., tool_call_parser: _Optional[str] = ..., reasoning_parser: _Optional[str] = ..., image_min_tiles: _Optional[int] = ..., image_max_tiles: _Optional[int] = ...) -> None: ...
