"""The Responses API on the chat path: a Responses request -> the chat completions body it means,
and a chat answer (its message, finish reason, usage) -> the Response object.

One internal request type: a Responses request is served as the chat request built here, so it gets
the chat path's validation, tool prompt, forced calls, grammars and tool-call parsing unchanged.
Pure: no I/O.
"""

from __future__ import annotations

import time
import uuid

from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.responses_models import InputContent, InputItem, ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- request -> chat body -------------------------------------------------------------------------

def _text_parts(parts: str | list[InputContent], where: str) -> str | list[dict]:
    if isinstance(parts, str):
        return parts
    out: list[dict] = []
    for j, p in enumerate(parts):
        if p.type in ("input_text", "output_text", "text") and p.text is not None:
            out.append({"type": "text", "text": p.text})
        elif p.type == "input_image" and p.image_url:
            out.append({"type": "image_url", "image_url": {"url": p.image_url}})
        else:
            raise ValidationError(f"`{where}[{j}]`: only input_text, output_text and input_image (with "
                                  f"`image_url`) parts are supported; got {p.type!r}")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _call_message(messages: list[dict]) -> dict:
    """The assistant message a function call belongs to: the last one when it is an assistant's
    (the text the model wrote before its calls), else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]


def _item_message(item: InputItem, i: int, messages: list[dict]) -> None:
    where = f"input[{i}]"
    if item.type == "message":
        if item.role not in ("user", "system", "developer", "assistant"):
            raise ValidationError(f"`{where}.role` must be user, system, developer or assistant")
        if item.content is None:
            raise ValidationError(f"Failed to deserialize the JSON body: missing field `content` in `{where}`")
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": _text_parts(item.content, f"{where}.content")})
    elif item.type == "function_call":
        if not item.call_id or not item.name:
            raise ValidationError(f"`{where}`: a function_call needs `call_id` and `name`")
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"}}
        _call_message(messages).setdefault("tool_calls", []).append(call)
    elif item.type == "function_call_output":
        if not item.call_id or item.output is None:
            raise ValidationError(f"`{where}`: a function_call_output needs `call_id` and `output`")
        output = _text_parts(item.output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item.call_id,
                         "content": output if isinstance(output, str) else str(output)})
    elif item.type != "reasoning":  # the model's own reasoning is not given back to it
        raise ValidationError(f"`{where}.type`: {item.type!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)")


def input_messages(req: ResponsesRequest) -> list[dict]:
    """`input` as chat messages (without `instructions`)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        _item_message(item, i, messages)
    return messages


def _tools(req: ResponsesRequest) -> dict:
    out: dict = {}
    if req.tools:
        for i, t in enumerate(req.tools):
            if t.type != "function" or not t.name:
                raise ValidationError(f"`tools[{i}]`: only function tools (with a `name`) are supported; "
                                      f"got {t.type!r}")
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.parameters or {"type": "object", "properties": {}}}} for t in req.tools]
        out["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice is not None:
        choice = req.tool_choice
        out["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                    "function": {"name": choice.name}}
    return out


def _response_format(req: ResponsesRequest) -> dict:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.schema_ is None:
        raise ValidationError("`text.format.schema` is required when `text.format.type` is json_schema")
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}}


def chat_body(req: ResponsesRequest, history: list[dict], stream: bool) -> tuple[dict, list[dict]]:
    """The chat completions body of `req` after the conversation `history` (the messages of the
    responses before it), and the conversation with this request's input (to store with its answer)."""
    conversation = history + input_messages(req)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body = {"messages": messages, "model": req.model, "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user, "stream": stream,
            **_tools(req), **_response_format(req)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {k: v for k, v in body.items() if v is not None}, conversation


# --- chat answer -> Response ------------------------------------------------------------------------

def reasoning_text(message: dict) -> str | None:
    """The reasoning a chat message (or a stream delta) carries when a reasoning parser split it out
    of the text (`--reasoning-parser`, `openai_api._chat_choice`). The one place the Responses API
    reads it."""
    text = message.get("reasoning")
    return text if isinstance(text, str) and text else None


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status ==
            "completed" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
            "status": status}


def output_items(message: dict) -> list[dict]:
    """A chat answer's message as output items: its reasoning, its text, then each call."""
    items = []
    reasoning = reasoning_text(message)
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or ():
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def assistant_messages(items: list[dict]) -> list[dict]:
    """Output items as the chat messages a next turn gives the model (reasoning left out)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message] if text or calls else []


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(rid: str, req: ResponsesRequest, model: str, output: list[dict], *, status: str,
                    usage_: dict | None, created_at: int | None = None) -> dict:
    """The Response: its output and the request's settings, as OpenAI repeats them."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    choice = req.tool_choice
    text = req.text.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else {
        "format": {"type": "text"}}
    return {
        "id": rid, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "model": model, "output": output, "usage": usage_, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": "auto" if choice is None else (choice if isinstance(choice, str) else choice.model_dump()),
        "tools": tools, "text": text, "metadata": req.metadata or {}, "store": req.store,
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"
