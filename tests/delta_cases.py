"""Delta payloads a test writes into a rank, as a trainer would encode them
(`weightsync.delta_codec`), and what the rank must hold after applying them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from weightsync.delta_codec import Section, as_bits, checksums, encode_payload


def changed(
    params: Mapping[str, torch.Tensor], changes: Mapping[str, Sequence[int]], *, seed: int
) -> tuple[list[Section], dict[str, torch.Tensor]]:
    """Sections that set the elements `changes` names (``{param_name: element indices}``)
    of a rank's `params` to new random bits, and every changed parameter after them.

    Parameters are numbered as a payload numbers them: by their sorted names.
    """
    generator = torch.Generator().manual_seed(seed)
    order = {name: index for index, name in enumerate(sorted(params))}
    sections, after = [], {}
    for name, elements in changes.items():
        bits = as_bits(params[name])
        index = torch.tensor(list(elements), dtype=torch.int64)
        new = torch.randint(-30000, 30000, (len(elements),), generator=generator).to(bits.dtype)
        new = torch.where(new == bits[index], new + 1, new)
        target = params[name].clone()
        as_bits(target)[index] = new
        after[name] = target
        sections.append(Section(param_index=order[name], elements=index, values=new))
    return sections, after


def payload(
    params: Mapping[str, torch.Tensor], changes: Mapping[str, Sequence[int]], *, seed: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
    """One encoded payload (uint8, host memory) of `changed`, every changed parameter after
    it, and the checksums the trainers expect of them."""
    sections, after = changed(params, changes, seed=seed)
    return encode_payload(sections, "cpu"), after, checksums(after)
