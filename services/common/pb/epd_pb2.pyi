from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImageGrid(_message.Message):
    __slots__ = ("t", "h", "w")
    T_FIELD_NUMBER: _ClassVar[int]
    H_FIELD_NUMBER: _ClassVar[int]
    W_FIELD_NUMBER: _ClassVar[int]
    t: int
    h: int
    w: int
    def __init__(self, t: _Optional[int] = ..., h: _Optional[int] = ..., w: _Optional[int] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("mm_hash", "offset", "num_tokens", "grid", "second_per_grid_t", "frame_offsets")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    FRAME_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    offset: int
    num_tokens: int
    grid: ImageGrid
    second_per_grid_t: float
    frame_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, mm_hash: _Optional[str] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., grid: _Optional[_Union[ImageGrid, _Mapping]] = ..., second_per_grid_t: _Optional[float] = ..., frame_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PreallocateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "items", "lease_ms", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    lease_ms: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ItemAllocation(_message.Message):
    __slots__ = ("mm_hash", "state", "reservation_id")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ItemAllocation.State]
        READY: _ClassVar[ItemAllocation.State]
        RESERVED: _ClassVar[ItemAllocation.State]
    STATE_UNSPECIFIED: ItemAllocation.State
    READY: ItemAllocation.State
    RESERVED: ItemAllocation.State
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    state: ItemAllocation.State
    reservation_id: str
    def __init__(self, mm_hash: _Optional[str] = ..., state: _Optional[_Union[ItemAllocation.State, str]] = ..., reservation_id: _Optional[str] = ...) -> None: ...

class PreallocateResponse(_message.Message):
    __slots__ = ("items", "lease_ms")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ItemAllocation]
    lease_ms: int
    def __init__(self, items: _Optional[_Iterable[_Union[ItemAllocation, _Mapping]]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    min_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "mm_items", "sampling", "cache_salt", "kv_handoff", "kv_reservation_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    sampling: SamplingParams
    cache_salt: str
    kv_handoff: KVHandoff
    kv_reservation_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., kv_handoff: _Optional[_Union[KVHandoff, _Mapping]] = ..., kv_reservation_id: _Optional[str] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("address", "reservation_id", "num_cached_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    reservation_id: str
    num_cached_blocks: int
    def __init__(self, address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("queue_ms", "embedding_wait_ms", "prefill_ms", "decode_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    embedding_wait_ms: float
    prefill_ms: float
    decode_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., embedding_wait_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "image_tokens", "timings")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    image_tokens: int
    timings: StageTimings
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., image_tokens: _Optional[int] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class EmbeddingHeader(_message.Message):
    __slots__ = ("request_id", "reservation_id", "mm_hash", "dtype", "shape", "num_bytes", "num_deepstack_levels")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEEPSTACK_LEVELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    mm_hash: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    num_deepstack_levels: int
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., mm_hash: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., num_deepstack_levels: _Optional[int] = ...) -> None: ...

class PushEmbeddingChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: EmbeddingHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[EmbeddingHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushEmbeddingResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PdLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_kv_blocks_used", "num_kv_blocks_total", "embedding_tokens_reserved", "embedding_tokens_ready", "embedding_tokens_capacity", "num_reservations", "num_running_tokens", "num_waiting_tokens")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TOKENS_READY_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TOKENS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    embedding_tokens_reserved: int
    embedding_tokens_ready: int
    embedding_tokens_capacity: int
    num_reservations: int
    num_running_tokens: int
    num_waiting_tokens: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., embedding_tokens_reserved: _Optional[int] = ..., embedding_tokens_ready: _Optional[int] = ..., embedding_tokens_capacity: _Optional[int] = ..., num_reservations: _Optional[int] = ..., num_running_tokens: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ...) -> None: ...

class SubscribeCacheEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CachedEmbedding(_message.Message):
    __slots__ = ("mm_hash", "num_tokens")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    num_tokens: int
    def __init__(self, mm_hash: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class CacheEvents(_message.Message):
    __slots__ = ("instance_id", "block_size", "sequence", "snapshot", "blocks_stored", "blocks_removed", "embeddings_stored", "embeddings_removed", "unix_time_ms")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_STORED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    block_size: int
    sequence: int
    snapshot: bool
    blocks_stored: _containers.RepeatedScalarFieldContainer[bytes]
    blocks_removed: _containers.RepeatedScalarFieldContainer[bytes]
    embeddings_stored: _containers.RepeatedCompositeFieldContainer[CachedEmbedding]
    embeddings_removed: _containers.RepeatedScalarFieldContainer[str]
    unix_time_ms: int
    def __init__(self, instance_id: _Optional[str] = ..., block_size: _Optional[int] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ..., blocks_stored: _Optional[_Iterable[bytes]] = ..., blocks_removed: _Optional[_Iterable[bytes]] = ..., embeddings_stored: _Optional[_Iterable[_Union[CachedEmbedding, _Mapping]]] = ..., embeddings_removed: _Optional[_Iterable[str]] = ..., unix_time_ms: _Optional[int] = ...) -> None: ...

class ReserveKVRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "items", "lease_ms", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    lease_ms: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReserveKVResponse(_message.Message):
    __slots__ = ("reservation_id", "num_blocks", "num_cached_blocks", "block_size", "lease_ms")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_blocks: int
    num_cached_blocks: int
    block_size: int
    lease_ms: int
    def __init__(self, reservation_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("request_id", "reservation_id", "dtype", "shape", "num_bytes", "first_token_id", "first_token_logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    first_token_id: int
    first_token_logprob: TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ...) -> None: ...

class PushKVChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class EncodeItem(_message.Message):
    __slots__ = ("mm_hash", "reservation_id", "pixel_values", "grid", "image_file", "video_file", "video_sampling", "frame_files")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FILE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FILE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FRAME_FILES_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    reservation_id: str
    pixel_values: Tensor
    grid: ImageGrid
    image_file: bytes
    video_file: bytes
    video_sampling: VideoSampling
    frame_files: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, mm_hash: _Optional[str] = ..., reservation_id: _Optional[str] = ..., pixel_values: _Optional[_Union[Tensor, _Mapping]] = ..., grid: _Optional[_Union[ImageGrid, _Mapping]] = ..., image_file: _Optional[bytes] = ..., video_file: _Optional[bytes] = ..., video_sampling: _Optional[_Union[VideoSampling, _Mapping]] = ..., frame_files: _Optional[_Iterable[bytes]] = ...) -> None: ...

class VideoSampling(_message.Message):
    __slots__ = ("fps", "num_frames", "max_frames")
    FPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    fps: float
    num_frames: int
    max_frames: int
    def __init__(self, fps: _Optional[float] = ..., num_frames: _Optional[int] = ..., max_frames: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "pd_address", "items", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pd_address: str
    items: _containers.RepeatedCompositeFieldContainer[EncodeItem]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., pd_address: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodeItem, _Mapping]]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class EncodeItemResult(_message.Message):
    __slots__ = ("mm_hash", "cache_hit", "encode_ms", "push_ms")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    PUSH_MS_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    cache_hit: bool
    encode_ms: float
    push_ms: float
    def __init__(self, mm_hash: _Optional[str] = ..., cache_hit: _Optional[bool] = ..., encode_ms: _Optional[float] = ..., push_ms: _Optional[float] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[EncodeItemResult]
    def __init__(self, items: _Optional[_Iterable[_Union[EncodeItemResult, _Mapping]]] = ...) -> None: ...

class EncoderLoad(_message.Message):
    __slots__ = ("num_pending", "cache_bytes", "outbound_bytes")
    NUM_PENDING_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTBOUND_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_pending: int
    cache_bytes: int
    outbound_bytes: int
    def __init__(self, num_pending: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., outbound_bytes: _Optional[int] = ...) -> None: ...
