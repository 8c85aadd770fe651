"""weightsync inside SGLang as released: delta syncs through SGLang's custom weight loader.

SGLang 0.5.23 offers no region to write a delta into and no route to apply one, but it runs a
function named by ``--custom-weight-loader`` inside every rank when asked through
``POST /update_weights_from_tensor`` with that ``load_format``. `apply_delta` is that
function: the call carries one small `DeltaDescriptor` per rank (`request_body`); each rank
reads its payloads one-sidedly from the trainers' registered memory, applies them in place
after proving its base, checks the result, and writes a `DeltaReply` into a slot the manager
registered. Start SGLang with::

    python -m sglang.launch_server ... --custom-weight-loader \\
        weightsync.integrations.sglang.apply_delta

This package imports torch, `weightsync.delta_codec` and `weightsync.transport.mooncake`
only, so that it loads inside SGLang's workers beside SGLang's own pins.
"""

from weightsync.delta_wire import (
    DESCRIPTOR_NAME,
    LOAD_FORMAT,
    DeltaDescriptor,
    DeltaReply,
    DescriptorError,
    Remote,
    ReplyError,
    ReplyStatus,
    names_digest,
    reply_bytes,
    request_body,
)
from weightsync.integrations.sglang.loader import apply_delta

__all__ = [
    "DESCRIPTOR_NAME",
    "LOAD_FORMAT",
    "DeltaDescriptor",
    "DeltaReply",
    "DescriptorError",
    "Remote",
    "ReplyError",
    "ReplyStatus",
    "apply_delta",
    "names_digest",
    "reply_bytes",
    "request_body",
]
