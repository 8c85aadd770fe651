"""The quantisation a replica serves, read from what it reports, never from a trainer flag.

SGLang reports ``quantization`` in ``/server_info`` when it was told one; for a checkpoint it
detects itself (DeepSeek-V3's and Kimi-K2's block-FP8 ``quantization_config``) it may report
``null``. Then the checkpoint config it serves says (its ``model_path``'s ``config.json``,
where that folder can be read), and failing that, what its ranks publish: block-FP8 weights
are 1-byte parameters, each followed by its float32 ``weight_scale_inv``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from weightsync.layout.quant import DEFAULT_BLOCK_SIZE, SCALE_SUFFIX, block_fp8_size

# SGLang's online FP8 (``--quantization fp8`` over an unquantised checkpoint) keeps a
# ``weight_scale`` per tensor or channel, where a block-FP8 checkpoint keeps a
# ``weight_scale_inv`` (`SCALE_SUFFIX` after the weight's name) per block.
_ONLINE_SCALE_SUFFIX = "_scale"

WeightsInfo = Mapping[str, tuple[int, int, int] | list[int]]


def served_fp8_block(
    server_info: Mapping[str, Any], *, checkpoint_config: Mapping[str, Any] | None = None
) -> int:
    """The block size of the block-FP8 weights a replica serves, 0 for unquantised ones.

    Read from SGLang's ``quantization`` key, with the block from the ``weight_block_size``
    the reference server publishes beside it, else from `checkpoint_config`'s
    ``quantization_config``, else DeepSeek-V3's and Kimi-K2's 128. A replica that reports
    no quantisation serves what `checkpoint_config` (the config.json of the checkpoint it
    serves, when readable) says.

    Raises:
        ValueError: a quantisation weightsync does not write (another method, non-square
            blocks, per-tensor FP8), naming the key.
    """
    method = server_info.get("quantization")
    quantization = (checkpoint_config or {}).get("quantization_config")
    model_type = str((checkpoint_config or {}).get("model_type", "served checkpoint"))
    if method in (None, "", "none"):
        return block_fp8_size(quantization, model_type) if quantization is not None else 0
    if method != "fp8":
        raise ValueError(
            f"the replica serves quantization={method!r}; weightsync writes unquantised and "
            "block-FP8 ('fp8') rollouts"
        )
    block = server_info.get("weight_block_size")
    if block is None and isinstance(quantization, Mapping):
        block = quantization.get("weight_block_size")
    block = block or [DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE]
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or block[0] != block[1]
        or not isinstance(block[0], int)
        or block[0] < 1
    ):
        raise ValueError(f"the replica serves FP8 with weight_block_size={block!r}: not square")
    return block[0]


def published_fp8(weights_infos: Iterable[WeightsInfo]) -> bool:
    """Whether ranks publish block-FP8 weights: a 1-byte parameter whose
    ``weight_scale_inv`` is published beside it.

    Raises:
        ValueError: 1-byte weights with per-tensor or per-channel ``weight_scale`` only
            (SGLang's online FP8 of an unquantised checkpoint), which weightsync does not
            write.
    """
    for info in weights_infos:
        for name, entry in info.items():
            if not name.endswith(".weight") or int(entry[2]) != 1:
                continue
            if name + SCALE_SUFFIX in info:
                return True
            if name + _ONLINE_SCALE_SUFFIX in info:
                raise ValueError(
                    f"the replica publishes {name!r} as 1-byte weights with "
                    f"{name + _ONLINE_SCALE_SUFFIX!r} and no {name + SCALE_SUFFIX!r}: online FP8 "
                    "quantisation (--quantization fp8 over an unquantised checkpoint) is not "
                    "written; serve a block-FP8 checkpoint or an unquantised one"
                )
    return False


def served_quantization(
    server_info: Mapping[str, Any],
    *,
    checkpoint_config: Mapping[str, Any] | None = None,
    weights_infos: Iterable[WeightsInfo] = (),
) -> int:
    """The FP8 block a replica serves (0: unquantised), from what it reports
    (`served_fp8_block`) and, where it reports none and no checkpoint config says, from what
    its ranks publish (`published_fp8`; the block is then the config's or 128).

    Raises:
        ValueError: a quantisation weightsync does not write, or a replica that reports FP8
            while its ranks publish no 1-byte weight beside a ``weight_scale_inv``.
    """
    block = served_fp8_block(server_info, checkpoint_config=checkpoint_config)
    infos = list(weights_infos)
    if not infos:
        return block
    published = published_fp8(infos)
    if block and not published:
        raise ValueError(
            f"the replica reports block-FP8 weights (block {block}) but its ranks publish no "
            f"1-byte weight with a 'weight{SCALE_SUFFIX}': its /server_info and its parameters "
            "disagree"
        )
    if not block and published:
        return DEFAULT_BLOCK_SIZE
    return block
