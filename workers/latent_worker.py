"""vLLM Worker extensions (loaded through the engine argument `worker_cls`) that return latents.

The mixin adds four things to vLLM's own worker and leaves its model runner untouched:
- after `load_model`: turn on the layer taps through the EAGLE-3 aux-hidden-state interface
  (`set_aux_hidden_state_layers`; the model then returns `(hidden, aux_hidden)`), no forward hooks;
- after `initialize_from_config`: size the hidden-state mirror from the KV-cache config;
- after `execute_model`: the runner has left `hidden_states`, `aux_hidden_states` and the step's
  `slot_mappings` in `execute_model_state` (sampling has not run yet); hand them to LatentCapture;
- for a codec talker (Qwen3-Omni's, Qwen2.5-Omni's), `TalkerSteps` around each forward and after
  each sampling (workers/talker_steps.py): the input embedding of every position that feeds a code
  (its codebooks' embeddings plus the thinker's text row), and, with a code predictor, all
  codebooks of every sampled code.

Written against vLLM 0.32's V1 model runner (`GPUModelRunner`, which `CPUModelRunner` subclasses);
the stage sets VLLM_USE_V2_MODEL_RUNNER=0 so GPU hosts use it too. Speculative decoding is not
supported (its rejected draft tokens would need their rows dropped).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.latent_capture import HIDDEN, LatentCapture, LatentOptions, layer_name, media_token_ids, reused_storages
from workers.talker_steps import TalkerSteps


class LatentWorkerMixin:
    latents: LatentCapture | None = None
    talker: TalkerSteps | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        if hasattr(model, "codec_input_embeds"):  # a codec talker (Qwen3-Omni's, Qwen2.5-Omni's)
            self.talker = TalkerSteps(self.model_runner, model)  # type: ignore[attr-defined]
            model.step_inputs = self.talker.adjust_inputs
            model.prompt_positions = self.talker.next_prompt_positions
        options = LatentOptions.from_vllm_config(self.vllm_config)  # type: ignore[attr-defined]
        if options is None:
            return
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        if options.taps:
            if not hasattr(model, "set_aux_hidden_state_layers"):
                raise RuntimeError(
                    f"{type(model).__name__} has no aux-hidden-state interface: layer taps "
                    f"{list(options.taps)} are not available for this model"
                )
            num_layers = self.vllm_config.model_config.get_num_layers(  # type: ignore[attr-defined]
                self.vllm_config.parallel_config
            )  # type: ignore[attr-defined]
            bad = [i for i in options.taps if not 0 <= i < num_layers]
            if bad:
                raise ValueError(f"layer taps {bad} out of range: the model has {num_layers} layers")
            model.set_aux_hidden_state_layers(options.taps)
            runner.use_aux_hidden_state_outputs = True
        media_ids = None
        if options.merged is not None:
            ids = media_token_ids(self.vllm_config.model_config.hf_config)  # type: ignore[attr-defined]
            if not ids:
                raise ValueError(
                    f"latents.merged {list(options.merged)}: {type(model).__name__} has no image, "
                    "audio or video placeholder ids in its config, so there is nothing to merge"
                )
            media_ids = torch.tensor(ids, dtype=runner.input_ids.cpu.dtype)
        hidden_size = self.vllm_config.model_config.get_hidden_size()  # type: ignore[attr-defined]
        dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        dims = {name: (hidden_size, dtype) for name in options.names}
        self.latents = LatentCapture(
            options, dims, torch.device(runner.device), reused=reused_storages(runner), media_ids=media_ids
        )

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        if self.latents is not None:
            self.latents.bind_kv_cache(kv_cache_config, self.vllm_config.scheduler_config.max_num_batched_tokens)  # type: ignore[attr-defined]

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)  # type: ignore[misc]
        if self.talker is not None:
            self.talker.after_sampling(output)
        return output

    def execute_model(self, scheduler_output: Any) -> Any:
        if self.talker is not None:
            self.talker.before_step(scheduler_output)
        output = super().execute_model(scheduler_output)  # type: ignore[misc]
        state = self.model_runner.execute_model_state  # type: ignore[attr-defined]
        if self.talker is not None:
            self.talker.after_step(state)
        if self.latents is not None and state is not None:
            runner = self.model_runner  # type: ignore[attr-defined]
            # The runner's CPU-side input ids hold every prompt token of the step (decode tokens
            # may be on the device only, under async scheduling; they are never media rows).
            self.latents.on_step(
                scheduler_output,
                state,
                runner.input_batch.req_ids,
                runner.input_ids.cpu,
                runner.input_batch.num_prompt_tokens,
            )
        return output


def __getattr__(name: str) -> type:
    # Built on first use so that importing this module on a GPU host does not import the CPU
    # worker (and vice versa).
    if name == "CPULatentWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker

        cls = type("CPULatentWorker", (LatentWorkerMixin, CPUWorker), {"__module__": __name__})
    elif name == "GPULatentWorker":
        from vllm.v1.worker.gpu_worker import Worker

        cls = type("GPULatentWorker", (LatentWorkerMixin, Worker), {"__module__": __name__})
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls


# CPULatentWorker and GPULatentWorker are built on first access by the module __getattr__ above.
__all__ = ["LatentWorkerMixin", "CPULatentWorker", "GPULatentWorker", "HIDDEN", "layer_name"]  # noqa: F822
