"""A chat request's prompt and tool parser, as ``vllm serve`` makes them: the thinker's chat
template applied with the request's ``tools`` and vLLM's template arguments
(``add_generation_prompt``, ``continue_final_message``, ``documents``, ``reasoning_effort``,
``chat_template_kwargs``, filtered by vLLM's ``resolve_chat_template_kwargs``), and vLLM's parser
for ``server.tool_call_parser``, which first adjusts the request: for ``tool_choice`` "required"
or a named function it constrains the answer to a tool call through structured outputs (the
arguments too for a tool with ``strict: true``), so the call holds whatever the weights."""

from __future__ import annotations

from typing import Any

from omni_cache.runtime.request_path.results import RequestError
from omni_cache.serving.chat_request import ChatRequest
from omni_cache.serving.errors import APIError

__all__ = ["rendered_prompt", "tool_parser"]


def rendered_prompt(orch: Any, chat: ChatRequest, parser_class: Any) -> list[int]:
    """The prompt's token ids (blocking: the template and the tokenizer run here)."""
    req = chat.body
    _check_tool_choice(req, parser_class)
    tools = [tool.model_dump() for tool in req.tools] if req.tools else None
    kwargs = _template_kwargs(req, orch.codec.tokenizer)
    try:
        return orch.tokenize_messages(chat.messages, tools=tools, template_kwargs=kwargs)
    except RequestError as e:  # too long for the model's context (text_codec.PromptTooLong)
        raise APIError.from_request_error(e) from None
    except Exception as e:  # noqa: BLE001 -- a chat template may raise on odd conversations
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None


def tool_parser(orch: Any, chat: ChatRequest, parser_class: Any) -> Any:
    """vLLM's parser of this request's answer (None without ``server.tool_call_parser``), after
    another instance adjusted the request as vLLM's renderer has it adjusted (``chat.body`` is
    changed in place: its structured outputs, ``skip_special_tokens``)."""
    if parser_class is None:
        return None
    req = chat.body
    tokenizer = orch.codec.tokenizer
    kwargs = _template_kwargs(req, tokenizer)
    if parser_class.always_adjust_request or parser_class.reasoning_parser_cls is not None or req.tool_choice != "none":
        adjusted = parser_class(tokenizer, req.tools, chat_template_kwargs=kwargs).adjust_request(req)
        assert adjusted is req, "vLLM's parser returned a new request instead of adjusting it"
    return parser_class(tokenizer, req.tools, chat_template_kwargs=kwargs)


def _check_tool_choice(req: Any, parser_class: Any) -> None:
    """vLLM's refusal of a tool choice that needs a tool parser when none is configured."""
    if parser_class is not None or req.tool_choice in (None, "none"):
        return
    if req.tool_choice == "auto":
        raise APIError(
            400,
            '"auto" tool choice requires server.tool_call_parser to be set (vllm '
            "serve: --enable-auto-tool-choice and --tool-call-parser)",
            param="tool_choice",
        )
    desc = (
        f'function "{req.tool_choice.function.name}"'
        if hasattr(req.tool_choice, "function")
        else f'"{req.tool_choice}"'
    )
    raise APIError(
        400,
        f"tool_choice={desc} requires server.tool_call_parser to be set (vllm serve: --tool-call-parser)",
        param="tool_choice",
    )


def _template_kwargs(req: Any, tokenizer: Any) -> dict[str, Any]:
    """The chat template's arguments of ``req``, as vLLM builds and filters them."""
    from vllm.renderers.hf import resolve_chat_template_kwargs

    params = req.build_chat_params(None, "auto")
    try:
        return resolve_chat_template_kwargs(tokenizer, tokenizer.chat_template, params.chat_template_kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None
