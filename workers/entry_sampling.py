"""The entry stage's vLLM ``SamplingParams`` for a request, from the fields its ``Submit`` carries
(omni_cache/wire/sampling.py: what the server's ``to_sampling_params`` produced). vLLM checks them
again here; a value it refuses fails the request with a 400."""

from __future__ import annotations

from typing import Any

import msgspec

from omni_cache.wire.sampling import EngineSampling


def sampling_params(sampling: EngineSampling) -> Any:
    """vLLM's ``SamplingParams`` with exactly the carried fields (the rest vLLM's defaults)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    fields = msgspec.structs.asdict(sampling)
    structured = fields.pop("structured_outputs")
    if structured is not None:
        fields["structured_outputs"] = StructuredOutputsParams(**msgspec.structs.asdict(structured))
    return SamplingParams(**fields)
