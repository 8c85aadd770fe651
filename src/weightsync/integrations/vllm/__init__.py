"""weightsync inside vLLM (written against vLLM 0.32.0): trainers write one-sidedly into the
weights a running vLLM computes with.

Launch
------
Start vLLM with weightsync importable in its workers and the extension mixed into them, and
its RL routes on (``/collective_rpc``, ``/pause``, ``/resume`` need
``VLLM_SERVER_DEV_MODE=1``)::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls \\
        weightsync.integrations.vllm.WorkerExtension [--tensor-parallel-size N] ...

The trainer side (`weightsync.control`) drives every worker at once through
``POST /collective_rpc`` with ``{"method": ..., "args": [json_request]}``; each method takes
one JSON string and answers a dict with ``"success"`` and ``"message"`` (it never raises; a
failure answers ``"success": false`` with the error's text), one reply per worker in rank
order:

- ``weightsync_init`` ``{"host", "delta_region_bytes", "protocol", "timeout_s"}`` (all
  optional; ``host``, the address trainers reach this worker's Mooncake engine at, defaults
  to ``VLLM_HOST_IP`` else 127.0.0.1; ``protocol`` to ``"tcp"``; ``MOONCAKE_DEVICE`` names
  RDMA devices) → ``rank``, ``instance`` (one per worker process), ``session_id``,
  ``weights_info`` ``{name: [ptr, numel, element_size]}``, ``registered_regions``,
  ``delta_region``, ``parallelism_config``, ``dtype``, ``in_place``, ``staged``,
  ``reprocessed``, ``staged_bytes``, ``reprocessed_layers``, ``capture_s``,
  ``layout_checked``, ``checker``, ``weightsync_version``, ``vllm_version``. Idempotent:
  later calls answer the first successful call's reply.
- ``weightsync_begin`` ``{"selector": "target"}`` → ``instance``, ``weight_version``,
  ``changed`` (parameters written outside a session), ``digest_s``. Pause generation first
  (``POST /pause``): nothing stops a forward pass from reading half-written weights.
- ``weightsync_end`` ``{"digests": [{name: int}, ...] | {name: int} | null,
  "weight_version": str | null}`` →
  ``verified``, ``mismatched``, ``changed``, ``digest_s``, ``apply_s``, ``applied_params``,
  ``weight_version``; ``success`` false when a digest differs (the message names the
  parameters) or vLLM's processing failed. The session is closed either way; the version is
  set only when no digest differs.
- ``weightsync_checker`` ``{"action": "snapshot" | "reset_tensors" | "compare" |
  "checksum"}`` → the checker's ``details``; ``success`` false on a failed compare.
- ``weightsync_delta_checksums`` ``{}`` → ``rank``, ``checksums`` (the base a delta is
  proven against; kept by an open session).
- ``weightsync_apply_delta`` ``{"ranks": {"<tp rank>": {"payloads": [[offset, num_bytes],
  ...], "expected": {name: checksum}}}, "check": "changes" | "full"}`` (needs an init with
  ``delta_region_bytes``; payloads written into ``delta_region``) → ``num_elements``,
  ``mismatched``, ``checksums``, ``error``, ``verified``, ``seconds``, ``check``;
  ``success`` is whether it verified.

Every worker receives the same request, so what differs per rank travels keyed by tp rank:
``weightsync_end``'s ``digests`` is a list indexed by tp rank (or one mapping, taken by every
rank: what tp 1 needs), ``weightsync_apply_delta``'s ``ranks`` a mapping by rank.

Names are weightsync's (`weightsync.layout.rank_layout`, SGLang's); vLLM names a fused
MoE's experts ``...mlp.experts.routed_experts.w13_weight`` where weightsync says
``...mlp.experts.w13_weight`` (`weightsync.layout.vllm`). The init checks the rank's
parameters against `rank_layout` (names, shapes, dtype) and fails on a difference.

Two modes per parameter, measured at init
-----------------------------------------
vLLM post-processes some weights after loading: on the CPU it repacks every unquantised
linear weight (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, the MoE router)
into a oneDNN handle and leaves the parameter empty, gives fused MoE experts new, padded
memory, and computes the logits from a oneDNN copy of ``lm_head`` (which keeps its bytes);
on a GPU without quantisation it changes nothing. The first ``weightsync_init`` re-runs
vLLM's own in-place reload from the checkpoint on disk with each layer's
``quant_method.process_weights_after_loading`` wrapped, copies every parameter of the layer
(its loaded shape: the rank's layout) just before processing, notes what else of the layer
(and its quant method) the processing replaced, and compares afterwards
(`weightsync.integrations.vllm.staging`):

- **in place** (``in_place``): the live parameter kept the loaded shape, dtype and bytes
  (embeddings, ``lm_head``, norms, biases; everything on a GPU without quantisation).
  Trainers write the memory vLLM reads. Where the layer's processing also derived other
  state from it (``reprocessed``: on the CPU ``lm_head`` and ``embed_tokens``, whose oneDNN
  copies are set up from them), the layer is processed again at every ``weightsync_end``,
  so vLLM's derived copy follows.
- **staged** (``staged``): anything else. Trainers write the parameter's view of the rank's
  staging buffer (one allocation on the weights' device); at every ``weightsync_end`` each
  layer with staged parameters is processed again from its views through vLLM's own steps
  (restore the loaded-shape tensors from the metadata vLLM recorded at load, fill them, run
  ``process_weights_after_loading``, copy the result into the original kernel storage), so
  vLLM's repacked copy follows what trainers wrote.

What the checks compare: digests (``weightsync_end``), delta checksums and the weights
checker cover exactly the bytes trainers write: the live parameter where in place, the
staging view where staged. For a staged parameter (and vLLM's derived copy of a reprocessed
one) "bit-exact" means those bytes equal the trainer's and vLLM consumed them at the end of
the session; generation is what shows the latter. The init reply's ``checker`` says so.

The init's reload leaves every weight as the checkpoint on disk has it: call it before the
first sync (weights written by other means before it are lost).

Mooncake's threads are started with every CPU the process may use: vLLM's CPU build pins a
worker to the cores of its OpenMP threads, and threads started there would share them.

Costs
-----
- First contact: one read of the checkpoint from disk per rank (vLLM's reload), the
  processing of every layer once more, one layer's parameters copied at a time, and the
  staged parameters held twice for a moment (``capture_s`` in the reply; 20-50 ms for the
  tests' tiny model on this CPU).
- Memory: ``staged_bytes`` per rank for as long as the worker lives (on the CPU, every
  linear weight once more in the checkpoint's layout; on a GPU without quantisation none).
- Every session end: vLLM's processing of every ``reprocessed_layers`` layer (``apply_s``;
  on the CPU that repacks every linear weight and ``lm_head``: about 6 ms for the tests'
  tiny model, and the time vLLM's own load spends repacking for a real one).

Refused (``weightsync_init`` answers ``success`` false, naming the flag)
------------------------------------------------------------------------
``--pipeline-parallel-size`` > 1; ``--data-parallel-size`` > 1 (vLLM's MoE then spans TP x
DP ranks of several engines: EP across DP is not taken yet); ``--enable-sleep-mode`` (it
frees and moves the weights); any ``--quantization``; ``--load-format dummy`` (no checkpoint
to measure against).

Imports torch, `weightsync.receiver`, `weightsync.layout` and `weightsync.transport` only;
vLLM's private functions are used in one module (`weightsync.integrations.vllm._vllm`),
which fails with a clear error on a vLLM that lacks them.
"""

from weightsync.integrations.vllm.extension import WorkerExtension

__all__ = ["WorkerExtension"]
