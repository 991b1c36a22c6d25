"""The Python API on the tiny pipeline, cache on vs off (dtype and why the comparison is exact: see
test_pipeline_e2e.py). Its own module so the HTTP test server of test_pipeline_e2e.py is shut down
before these two pipelines start (memory)."""

from __future__ import annotations

import pytest
from served_config import system_prompt, write_pipeline_config
from shared_forkers import shared_forkers

pytestmark = pytest.mark.vllm


def test_python_api_cache_on_off_same_text_and_audio(tmp_path):
    """Pipeline.from_config with the cache on and off: same greedy text, same audio length, and
    with the cache on the second round hits in both vLLM stages."""
    from omni_cache import Pipeline

    system = system_prompt(900, seed=11)
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("why?", "how?")]
    results = {}
    for cache in (True, False):
        path = write_pipeline_config(tmp_path, f"api_{'on' if cache else 'off'}")
        with Pipeline.from_config(
            path, prefix_cache=cache, echo_stage_logs=False, stage_forkers=shared_forkers()
        ) as pipe:
            first = pipe.generate(prompts[:1], max_tokens=12, return_latents=True)
            second = pipe.generate(prompts, max_tokens=12, return_latents=True)
        results[cache] = first + second
    on, off = results[True], results[False]
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert a.audio is not None and len(a.audio) == len(b.audio) > 0 and a.sample_rate == 24000
        rows = a.num_prompt_tokens + len(a.token_ids) - 1
        assert a.latents["hidden"].shape[0] == rows == b.latents["hidden"].shape[0]
    assert on[1].cached_tokens["thinker"] >= 512 and on[1].cached_tokens["talker"] > 0
    assert all(v == 0 for r in off for v in r.cached_tokens.values())
