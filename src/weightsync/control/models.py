"""The bodies of docs/protocol.md's routes, as pydantic models with SGLang's exact field names.

Request models ignore unknown fields (SGLang clients may send more); response models allow
extra fields, so a reader keeps what a newer server adds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    field_validator,
    model_validator,
)

PauseMode = Literal["abort", "retract", "in_place"]
Selector = Literal["target", "draft", "all"]
CheckerAction = Literal["snapshot", "reset_tensors", "compare", "checksum"]

WeightsInfo = dict[str, tuple[int, int, int]]
"""``{param_name: (data_ptr, numel, element_size)}`` of one rollout rank."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# Main server: requests.


class PauseGenerationRequest(_Request):
    """``POST /pause_generation``: ``abort`` drops queued requests; the others hold them."""

    mode: PauseMode = "abort"


class ContinueGenerationRequest(_Request):
    """``POST /continue_generation`` (SGLang 0.5.23's default: empty the device cache)."""

    torch_empty_cache: bool = True


class AbortRequestRequest(_Request):
    """``POST /abort_request``: abort the request ``rid``, or every request."""

    rid: str = ""
    abort_all: bool = False


class MemoryOccupationRequest(_Request):
    """``POST /release_memory_occupation`` and ``/resume_memory_occupation``.

    ``tags=None`` means every releasable kind of memory.
    """

    tags: list[str] | None = None


class BeginWeightUpdateRequest(_Request):
    """``POST /begin_weight_update`` (SGLang 0.5.23's default selector: ``all``).

    ``lease_s`` is the reference server's extension (capability ``weight_update_lease``):
    the session becomes a lease of that many seconds, held by whoever gets its token.
    """

    selector: Selector = "all"
    lease_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class BeginWeightUpdateResponse(_Response):
    """``POST /begin_weight_update``'s reply; a leased session adds its token and lease, and
    the reference server lists the parameters that changed outside any session and says
    what it holds as the session begins: ``weight_version`` (its label),
    ``highest_numeric_version`` (the largest numeric label its process has held) and
    ``instance`` (its process's identity, new at every start)."""

    success: bool
    message: str = ""
    session_token: str | None = None
    lease_s: float | None = None
    changed_outside: list[str] = Field(default_factory=list)
    weight_version: str | None = None
    highest_numeric_version: int | None = None
    instance: str | None = None


class RenewWeightUpdateRequest(_Request):
    """``POST /renew_weight_update`` (the reference server's): extend a session's lease."""

    session_token: str
    lease_s: float = Field(gt=0, allow_inf_nan=False)


class EndWeightUpdateRequest(_Request):
    """``POST /end_weight_update`` (an empty object for SGLang).

    The reference server's extensions: ``session_token`` (a leased session's),
    ``digests`` (capability ``weight_update_digest``): per tp rank (a decimal string),
    ``{param_name: digest}`` of what the trainers wrote, verified against what arrived, and
    ``unverified``: the trainers computed no digests (a labelled leased session is complete
    without digests only with it, and its weights serve as unverified), and ``abandoned``
    (capability ``weight_update_lease``): the holder gives the session up after its writes
    began, saying why (1 to 1,000 characters); writes may still land after the end, so the
    weights are incomplete whatever arrived.
    """

    session_token: str | None = None
    digests: dict[int, dict[str, int]] | None = None
    unverified: bool | None = None
    abandoned: str | None = Field(default=None, min_length=1, max_length=1000)


class BeginWeightSyncRequest(_Request):
    """``POST /begin_weight_sync`` (capability ``weight_sync_fused``): what
    ``pause_generation``, ``release_memory_occupation`` and ``begin_weight_update`` take, in
    one call run in that order.

    ``pause_mode=None`` skips the pause (a caller that pauses generation itself) and
    ``release_kv_cache=False`` keeps the KV cache. With ``budget_s`` the call stops where
    it runs past that many seconds (a pause waiting on a long request stops waiting; it has
    taken effect, as a pause whose caller gave up): answered 504, the steps after it not run.
    ``fence`` (capability ``weight_sync_fence``): the session's begin digest is queued on
    the replica's GPU, not waited for; the reply's ``fences`` are the IPC handles of the CUDA
    events it completes at, one per tp rank, which every writer waits for before it writes.
    """

    pause_mode: PauseMode | None = "abort"
    release_kv_cache: bool = True
    selector: Selector = "target"
    lease_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    budget_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    fence: bool = False


IpcEventHandle = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]
"""A CUDA IPC event handle (``cudaIpcEventHandle_t``, 64 bytes) in lowercase hex."""


class EndWeightSyncRequest(_Request):
    """``POST /end_weight_sync`` (capability ``weight_sync_fused``): what
    ``update_weight_version``, ``end_weight_update``, ``resume_memory_occupation``,
    ``flush_cache`` and ``continue_generation`` take, in one call run in that order.

    ``new_version=None`` keeps the label; ``digests`` and ``unverified`` as in
    `EndWeightUpdateRequest`; ``resume=False`` stops after the session ends (a
    caller that resumes generation itself); ``resume_kv_cache`` takes back the KV cache that
    the fused begin released; ``budget_s`` as in `BeginWeightSyncRequest`. ``after_events``
    (capability ``weight_sync_events``): the IPC handles, in hex, of CUDA events on the
    replica's host that the trainers' copies complete at; the end waits for them, within the
    budget, before it verifies.
    """

    new_version: str | None = None
    session_token: str | None = None
    digests: dict[int, dict[str, int]] | None = None
    unverified: bool | None = None
    after_events: list[IpcEventHandle] | None = Field(default=None, max_length=64)
    resume: bool = True
    resume_kv_cache: bool = True
    torch_empty_cache: bool = False
    budget_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


Checksum = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]
"""A parameter's checksum (`weightsync.delta_codec.checksums`): a signed 64-bit JSON integer."""

PayloadSpan = tuple[Annotated[StrictInt, Field(ge=0)], Annotated[StrictInt, Field(gt=0)]]
"""``[offset, num_bytes]`` of one delta payload inside a rank's delta region."""


class DeltaChecksumsRequest(_Request):
    """``POST /weightsync/delta_checksums`` (capability ``weight_sync_delta``): every rank's
    checksums of its parameters, any time; ``session_token``, while a leased session is
    open, must be its holder's."""

    session_token: str | None = None


class ApplyDeltaRankRequest(_Request):
    """One rank's part of ``POST /weightsync/apply_delta``: ``payloads``, the ``[offset,
    num_bytes]`` of each payload the trainers wrote into its delta region, applied in this
    order; ``expected``, ``{param_name: checksum}`` each changed parameter must hold after
    them (its base's checksum plus the trainers' change, wrapped to int64)."""

    payloads: list[PayloadSpan] = Field(default_factory=list)
    expected: dict[str, Checksum] = Field(default_factory=dict)


class ApplyDeltaRequest(_Request):
    """``POST /weightsync/apply_delta`` (capability ``weight_sync_delta``): apply the delta
    payloads inside the open session and check them; ``ranks`` holds every tp rank (a
    decimal string) of the replica, ``session_token`` a leased session's token. ``check``:
    ``"changes"`` derives each parameter's checksum after from the one the rank read over
    every byte at ``/weightsync/delta_checksums`` in this session and the elements written
    (a rank without that read reads every byte); ``"full"`` reads every byte after
    applying, which also sees bytes written since that read into elements no payload
    changed."""

    session_token: str | None = None
    ranks: dict[int, ApplyDeltaRankRequest]
    check: Literal["changes", "full"] = "changes"


class UpdateWeightVersionRequest(_Request):
    """``POST /update_weight_version`` (SGLang 0.5.23 aborts every request by default);
    ``session_token`` is a leased session's."""

    new_version: str
    abort_all_requests: bool = True
    session_token: str | None = None


class WeightsCheckerRequest(_Request):
    """``POST /weights_checker`` (SGLang 0.5.23's default action: ``checksum``)."""

    action: CheckerAction = "checksum"
    allow_quant_error: bool = False
    selector: Selector = "target"
    skip_tensor_list: list[str] = Field(default_factory=list)


MIN_TEMPERATURE = 1e-5
"""The lowest sampling temperature above 0 (greedy). Below it sampling is greedy in all but
name (vLLM treats such temperatures as greedy), and the engine divides its float32 logits
by the temperature, in which a subnormal one such as 1e-320 is zero."""
MAX_TEMPERATURE = 100.0
"""The highest sampling temperature: above it, logits spread over 50 (a language model's)
differ by under a factor e^0.5 after scaling, which is sampling noise, so a larger value is
taken for a mistake."""


class SamplingParams(_Request):
    """The sampling parameters the reference server honours.

    Counts and seeds are JSON integers (not ``1.0``, ``"16"`` or ``true``) and floats are
    finite; ``temperature`` is 0 (greedy) or in [`MIN_TEMPERATURE`, `MAX_TEMPERATURE`]; the
    server also bounds ``max_new_tokens`` by the model's context length. A field the engine
    does not honour (``top_p``, ...) is ignored, as every unknown field.
    """

    max_new_tokens: int = Field(default=16, ge=1, strict=True)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    sampling_seed: int | None = Field(default=None, ge=0, lt=2**63, strict=True)

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampling(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                f"(sampling), got {temperature!r}"
            )
        return temperature


class GenerateRequest(_Request):
    """``POST /generate`` on the reference server (token ids in, token ids out)."""

    input_ids: list[StrictInt] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = None


class InitWeightsUpdateGroupRequest(_Request):
    """``POST /init_weights_update_group`` (the broadcast baseline, SGLang's fields): every
    rank of the replica joins group `group_name` as rank ``rank_offset + tp_rank``, with the
    trainer as rank 0 hosting the rendezvous at ``master_address:master_port``."""

    master_address: str
    master_port: int = Field(gt=0, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateWeightsFromDistributedRequest(_Request):
    """``POST /update_weights_from_distributed``: receive HF tensors broadcast by the
    trainer over group `group_name` and load them.

    ``load_format="flattened_bucket"``: one broadcast of the tensors packed back to back in
    this order, each starting at a multiple of 64 bytes; ``null``: one broadcast per tensor.
    With `weight_version`, the replica takes that label once the tensors are loaded.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes need one entry per tensor; got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        return self


class UpdateWeightsFromTensorRequest(_Request):
    """``POST /update_weights_from_tensor`` (the colocated baseline, SGLang's fields): one
    entry per tp rank of `serialized_named_tensors`, each a base64 ``ForkingPickler`` payload
    naming tensors the trainer shares (CUDA IPC handles; shared-memory files on CPU), which
    the rank rebuilds and loads tensor by tensor; with ``load_format="flattened_bucket"`` the
    payload is ``{"flattened_tensor", "metadata"}`` (SGLang's `FlattenedTensorBucket`)."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupRequest(_Request):
    """``POST /destroy_weights_update_group``."""

    group_name: str = "weight_update_group"


# Main server: responses.


class StatusResponse(_Response):
    """``{"status": "ok", "message": ...}`` of the generation-control routes."""

    status: str
    message: str = ""


class SuccessResponse(_Response):
    """``{"success": bool, "message": str}`` of the weight-update routes."""

    success: bool
    message: str = ""


class UpdateWeightVersionResponse(SuccessResponse):
    """``POST /update_weight_version``'s reply."""

    new_version: str | None = None


class WeightSyncStepResponse(BeginWeightUpdateResponse):
    """The reply of ``/begin_weight_sync`` and ``/end_weight_sync``: ``completed`` lists the
    routes whose step ran, in order; when a step refused, ``route`` names it and the status
    and ``message`` are what that route answers alone (later steps did not run). A fenced
    begin's ``fences`` are its tp ranks' event handles, in rank order; its end lists in
    ``changed_outside`` what had changed outside a session before it."""

    completed: list[str] = Field(default_factory=list)
    route: str | None = None
    fences: list[IpcEventHandle] = Field(default_factory=list)


class DeltaChecksumsRank(_Response):
    """One rank's ``checksums``: ``{param_name: checksum}`` of every parameter."""

    checksums: dict[str, int]


class DeltaChecksumsResponse(SuccessResponse):
    """``POST /weightsync/delta_checksums``'s reply: ``ranks`` by tp rank."""

    ranks: dict[int, DeltaChecksumsRank] = Field(default_factory=dict)


class ApplyDeltaRank(_Response):
    """What applying the delta found on one rank.

    ``num_elements``: elements the payloads wrote; ``mismatched``: the parameters whose
    checksum is not the expected one, then those a payload wrote without one expected;
    ``checksums``: ``{param_name: checksum}`` of every parameter after applying (the next
    base); ``error``: why a payload was refused (it changed nothing; the ones before it were
    applied), or null; ``verified``: no error and nothing mismatched; ``seconds``: what
    applying and checking took; ``check``: how the checksums after were found,
    ``"changes"`` (derived from the base and the elements written) or ``"full"`` (every
    byte read).
    """

    num_elements: int
    mismatched: list[str] = Field(default_factory=list)
    checksums: dict[str, int] = Field(default_factory=dict)
    error: str | None = None
    verified: bool = False
    seconds: float = 0.0
    check: Literal["changes", "full"] = "full"


class ApplyDeltaResponse(SuccessResponse):
    """``POST /weightsync/apply_delta``'s reply: ``ranks`` by tp rank; ``success`` false
    (HTTP 400) when a rank did not verify, the message naming it and what differs."""

    ranks: dict[int, ApplyDeltaRank] = Field(default_factory=dict)


class WeightVersionResponse(_Response):
    """``GET /get_weight_version``'s reply."""

    weight_version: str | None


class FinishReason(_Response):
    """Why a generation stopped: ``length`` (max_new_tokens reached) or ``abort``."""

    type: Literal["length", "stop", "abort"]
    message: str | None = None


class GenerateMetaInfo(_Response):
    """``meta_info`` of ``/generate``: the weight version that produced the tokens."""

    weight_version: str | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None


class GenerateResponse(_Response):
    """``POST /generate``'s reply."""

    output_ids: list[int]
    meta_info: GenerateMetaInfo


class ErrorDetail(_Response):
    """The ``error`` object of an error reply."""

    message: str


class ErrorResponse(_Response):
    """``{"error": {"message": ...}}``: how the reference server explains a refusal."""

    error: ErrorDetail


class TransferEngineInfoResponse(_Response):
    """``GET /remote_instance_transfer_engine_info`` (and the bootstrap's
    ``/get_transfer_engine_info``): ``[session_id, weights_info]`` of one rank; the reference
    server adds the ``[addr, num_bytes]`` regions the rank registered, and the
    ``[addr, num_bytes]`` scratch region registered beside them that a client may write and
    read back to test the transport (never a parameter), and with capability
    ``weight_sync_delta`` the ``[addr, num_bytes]`` delta region trainers write delta
    payloads into."""

    rank: int
    remote_instance_transfer_engine_info: tuple[str, WeightsInfo]
    registered_regions: list[tuple[int, int]] | None = None
    scratch_region: tuple[int, int] | None = None
    delta_region: tuple[int, int] | None = None


class ParallelismConfigModel(_Response):
    """SGLang's ``RankParallelismConfig.to_dict()``; readers ignore unknown keys. The
    reference server adds what SGLang's config does not carry: the shared experts fused into
    the routed experts, ``--moe-dense-tp-size`` and ``--enable-dp-lm-head``."""

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int | None = None
    moe_tp_size: int | None = None
    moe_tp_rank: int | None = None
    attn_tp_size: int | None = None
    attn_tp_rank: int | None = None
    attn_dp_size: int = 1
    attn_dp_rank: int | None = None
    num_fused_shared_experts: int = 0
    moe_dense_tp_size: int | None = None
    enable_dp_lm_head: bool = False
    world_size: int | None = None
    global_rank: int | None = None
    local_rank: int | None = None


class ServerInfo(_Response):
    """``GET /server_info``: the reference server's arguments, state and version; its layout
    under SGLang 0.5.23's keys (``attn_dp_size`` with ``enable_dp_attention``,
    ``enable_dp_lm_head``, ``moe_dense_tp_size``, ``quantization`` with
    ``weight_block_size``)."""

    model_path: str
    tp_size: int
    pp_size: int = 1
    ep_size: int = 1
    dtype: str
    device: str
    host: str
    port: int
    engine_info_bootstrap_port: int
    transport: str
    mooncake_protocol: str
    weight_version: str | None
    version: str
    status: str = "ready"
    dp_size: int = 1
    attn_dp_size: int = 1
    enable_dp_attention: bool = False
    enable_dp_lm_head: bool = False
    moe_dense_tp_size: int | None = None
    quantization: str | None = None
    weight_block_size: list[int] | None = None
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    cpu_offload_gb: float = 0
    weightsync: dict[str, Any] = Field(default_factory=dict)
    state: dict[str, Any] = Field(default_factory=dict)


# Engine-info bootstrap server.


class ModelInfo(_Response):
    """``GET /model_info`` (SGLang's fields that the reference server has)."""

    model_path: str
    weight_version: str | None
    is_generation: bool = True
    model_type: str | None = None
    architectures: list[str] | None = None


class TransferEngineInfo(_Request):
    """What one rank publishes about its transfer engine."""

    session_id: str
    weights_info_dict: WeightsInfo


class RegisterTransferEngineInfoRequest(_Request):
    """``PUT /register_transfer_engine_info``."""

    tp_rank: int = Field(ge=0)
    transfer_engine_info: TransferEngineInfo


class RegisterParallelismConfigRequest(_Request):
    """``PUT /register_parallelism_config``."""

    tp_rank: int = Field(ge=0)
    parallelism_config: dict[str, Any]
