from mmsplit.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHAT_ROLE_UNSPECIFIED: _ClassVar[ChatRole]
    CHAT_ROLE_SYSTEM: _ClassVar[ChatRole]
    CHAT_ROLE_USER: _ClassVar[ChatRole]
    CHAT_ROLE_ASSISTANT: _ClassVar[ChatRole]
    CHAT_ROLE_TOOL: _ClassVar[ChatRole]
CHAT_ROLE_UNSPECIFIED: ChatRole
CHAT_ROLE_SYSTEM: ChatRole
CHAT_ROLE_USER: ChatRole
CHAT_ROLE_ASSISTANT: ChatRole
CHAT_ROLE_TOOL: ChatRole

class Image(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "images", "sampling", "videos", "messages", "n", "cache_salt", "tools", "continue_final_message", "chat_template_kwargs", "prompt_token_ids", "tool_choice", "image_budget", "return_prompt_token_ids", "keep_special_tokens", "truncate_prompt_tokens", "priority", "video_budget", "documents", "no_generation_prompt", "chat_template", "beam_search", "prompt_as_written", "no_special_tokens", "split_reasoning")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    VIDEO_BUDGET_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    NO_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_AS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NO_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_REASONING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    sampling: _common_pb2.SamplingParams
    videos: _containers.RepeatedCompositeFieldContainer[Video]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    n: int
    cache_salt: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    continue_final_message: bool
    chat_template_kwargs: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tool_choice: ToolChoice
    image_budget: ImageBudget
    return_prompt_token_ids: bool
    keep_special_tokens: bool
    truncate_prompt_tokens: int
    priority: int
    video_budget: VideoBudget
    documents: str
    no_generation_prompt: bool
    chat_template: str
    beam_search: BeamSearch
    prompt_as_written: bool
    no_special_tokens: bool
    split_reasoning: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., videos: _Optional[_Iterable[_Union[Video, _Mapping]]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., image_budget: _Optional[_Union[ImageBudget, _Mapping]] = ..., return_prompt_token_ids: _Optional[bool] = ..., keep_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., video_budget: _Optional[_Union[VideoBudget, _Mapping]] = ..., documents: _Optional[str] = ..., no_generation_prompt: _Optional[bool] = ..., chat_template: _Optional[str] = ..., beam_search: _Optional[_Union[BeamSearch, _Mapping]] = ..., prompt_as_written: _Optional[bool] = ..., no_special_tokens: _Optional[bool] = ..., split_reasoning: _Optional[bool] = ...) -> None: ...

class BeamSearch(_message.Message):
    __slots__ = ("length_penalty",)
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    length_penalty: float
    def __init__(self, length_penalty: _Optional[float] = ...) -> None: ...

class ImageBudget(_message.Message):
    __slots__ = ("min_pixels", "max_pixels", "min_tiles", "max_tiles")
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MIN_TILES_FIELD_NUMBER: _ClassVar[int]
    MAX_TILES_FIELD_NUMBER: _ClassVar[int]
    min_pixels: int
    max_pixels: int
    min_tiles: int
    max_tiles: int
    def __init__(self, min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., min_tiles: _Optional[int] = ..., max_tiles: _Optional[int] = ...) -> None: ...

class VideoBudget(_message.Message):
    __slots__ = ("fps", "max_frames")
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    fps: float
    max_frames: int
    def __init__(self, fps: _Optional[float] = ..., max_frames: _Optional[int] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("auto", "required", "function", "single_call")
    AUTO_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SINGLE_CALL_FIELD_NUMBER: _ClassVar[int]
    auto: bool
    required: bool
    function: str
    single_call: bool
    def __init__(self, auto: _Optional[bool] = ..., required: _Optional[bool] = ..., function: _Optional[str] = ..., single_call: _Optional[bool] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: ChatRole
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning: str
    def __init__(self, role: _Optional[_Union[ChatRole, str]] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    video: Video
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., video: _Optional[_Union[Video, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "tool_calls", "content", "reasoning")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    reasoning: str
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ..., reasoning: _Optional[str] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "finished", "prompt_logprobs", "prompt_tokens", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TextDelta
    finished: Finished
    prompt_logprobs: PromptLogprobs
    prompt_tokens: PromptTokens
    index: int
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TextDelta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., prompt_tokens: _Optional[_Union[PromptTokens, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_context_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_context_tokens: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("info", "scheduler", "transport", "backends")
    INFO_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServerInfo
    scheduler: _common_pb2.ServerInfo
    transport: _common_pb2.Transport
    backends: _containers.RepeatedCompositeFieldContainer[SchedulerBackend]
    def __init__(self, info: _Optional[_Union[_common_pb2.ServerInfo, _Mapping]] = ..., scheduler: _Optional[_Union[_common_pb2.ServerInfo, _Mapping]] = ..., transport: _Optional[_Union[_common_pb2.Transport, str]] = ..., backends: _Optional[_Iterable[_Union[SchedulerBackend, _Mapping]]] = ...) -> None: ...

class SchedulerBackend(_message.Message):
    __slots__ = ("address", "ready", "transport", "requests_in_flight", "serves_another_model")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SERVES_ANOTHER_MODEL_FIELD_NUMBER: _ClassVar[int]
    address: str
    ready: bool
    transport: _common_pb2.Transport
    requests_in_flight: int
    serves_another_model: str
    def __init__(self, address: _Optional[str] = ..., ready: _Optional[bool] = ..., transport: _Optional[_Union[_common_pb2.Transport, str]] = ..., requests_in_flight: _Optional[int] = ..., serves_another_model: _Optional[str] = ...) -> None: ...
