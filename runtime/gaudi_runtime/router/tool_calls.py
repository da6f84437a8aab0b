"""Tool calls in the model family's own format: which format a model speaks, the grammar that makes
it call (tool_choice `required` or a named function), and the parser that turns its output into
OpenAI's `tool_calls`, whole or as stream deltas.

Formats (the model's chat template renders the tools and teaches it the format; a template that
does not render them gets them in a prompt appended to the last message, as TGI's `tool_prompt`,
which tells the model to call in `llama3_json` unless --tool-call-parser names another format):

- `llama3_json` (Llama 3.1/3.2/3.3): the answer is a JSON object `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`; several are separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
- `hermes` (Qwen2.5, Hermes, Qwen3): each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
- `deepseek_v3` (DeepSeek-V3, R1): `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`,
  a newline and the arguments in a ```json fence, `<｜tool▁call▁end｜>` (calls separated by a newline), and
  `<｜tool▁calls▁end｜>`.

Parsing reads the text so far from the start each time (outputs are short), so streaming is the
difference between two parses: the text before a call streams as content, a call's name goes out
once it is known, its arguments' JSON text as it grows. A marker half-written at the end is held
back until the next token tells whether it is one.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field

import jinja2
import jinja2.meta

from gaudi_runtime.config import TOOL_CALL_PARSERS
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.types import GrammarSpec

_WS = " \t\r\n"
_ARG_KEYS = ("arguments", "parameters")

# What in a chat template tells its format, in the order they are tried.
_TEMPLATE_MARKERS = (
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>",)),
    ("llama3_json", ("<|python_tag|>", "\"parameters\": dictionary of argument name")),
)

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
MARKERS = {"llama3_json": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",), "hermes": ("<tool_call>", "</tool_call>"),
           "deepseek_v3": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_SEP, DS_CALL_END)}


def detect_format(chat_template: str | None, configured: str | None = None) -> str | None:
    """The tool-call format: `configured` (--tool-call-parser) when given, else the one whose markers
    the chat template holds; None when it holds none."""
    if configured:
        return configured
    for name, markers in _TEMPLATE_MARKERS:
        if chat_template and any(m in chat_template for m in markers):
            return name
    return None


@functools.lru_cache(maxsize=8)
@functools.lru_cache(maxsize=8)
def renders_tools(chat_template: str | None) -> bool:
    """Whether the template uses the `tools` variable (TGI's test), read from its syntax tree; a
    template jinja cannot parse on its own (one with an extension's tags) by whether it names `tools`.
    Cached: a server has one template, and every request with tools asks."""
    if not chat_template:
        return False
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "tools" in chat_template
    return "tools" in jinja2.meta.find_undeclared_variables(tree)


# The format a model is asked to call in when its template does not render tools (and so teaches
# none): a bare JSON object, the easiest for a model that was never taught one.
PROMPTED_FORMAT = "llama3_json"


def tools_format(chat_template: str | None, configured: str | None = None) -> str:
    """The format of a request with tools, or a 422 when the template renders tools in a format this
    server does not parse (the model would call in it, whatever the prompt says)."""
    fmt = detect_format(chat_template, configured)
    if fmt is not None:
        return fmt
    if renders_tools(chat_template):
        raise ValidationError(
            "`tools`: the model's tool-call format is not one this server parses (its chat template shows "
            f"none of {', '.join(TOOL_CALL_PARSERS)}); start the server with --tool-call-parser")
    return PROMPTED_FORMAT


_CALL_SHAPES = {
    "llama3_json": '{"name": <function name>, "parameters": <arguments object>}',
    "hermes": '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": <function name>, "arguments": <arguments object>}]',
    "deepseek_v3": f"{DS_CALLS}{DS_CALL}function{DS_SEP}<function name>\n```json\n<arguments object>\n```"
                   f"{DS_CALL_END}{DS_CALLS_END}",
}
TOOL_PROMPT_SEPARATOR = "\n---\n"


def default_tool_prompt(fmt: str) -> str:
    """The instruction given with the tools when the request has no `tool_prompt`: how to call in `fmt`."""
    where = "on one line: " if "\n" not in _CALL_SHAPES[fmt] else "as it is written here:\n"
    return (f"To call one of the functions above, answer with only this, {where}{_CALL_SHAPES[fmt]}; "
            "the arguments object follows the function's parameters schema.")


def tool_prompt(tools: list[dict], fmt: str, instruction: str | None, template_renders_tools: bool) -> str | None:
    """The text appended to the last message (TGI's `tool_prompt` semantics): when the template does
    not render the tools, the tools as JSON and the instruction (the client's `tool_prompt`, else
    `default_tool_prompt`); when it does, only an instruction the client sent (the template already
    teaches its format). None: nothing is appended."""
    if template_renders_tools:
        return TOOL_PROMPT_SEPARATOR + instruction if instruction else None
    listed = json.dumps(tools, ensure_ascii=False)
    return f"{TOOL_PROMPT_SEPARATOR}{listed}\n{instruction or default_tool_prompt(fmt)}"


# --- the grammar that makes the model call ----------------------------------------------------------

def _tag(fmt: str, name: str, parameters: dict | None) -> dict:
    schema = parameters if parameters is not None else {"type": "object", "additionalProperties": True}
    # One whitespace at most between JSON elements: a sampled model could otherwise pad forever.
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if fmt == "deepseek_v3":
        return {"type": "tag", "begin": f"{DS_CALL}function{DS_SEP}{name}\n```json\n", "content": content,
                "end": f"\n```{DS_CALL_END}"}
    key = "parameters" if fmt == "llama3_json" else "arguments"
    begin = "{" + f"\"name\": {json.dumps(name, ensure_ascii=False)}, \"{key}\": "
    if fmt == "hermes":
        begin = "<tool_call>\n" + begin
    return {"type": "tag", "begin": begin, "content": content, "end": "}\n</tool_call>" if fmt == "hermes" else "}"}


def call_grammar(fmt: str, tools: list[tuple[str, dict | None]], *, several: bool) -> GrammarSpec:
    """A grammar whose every output is one call (or, `several`, one or more) to one of `tools`
    (name, parameters schema), in `fmt`: an xgrammar structural tag."""
    calls = {"type": "tags_with_separator", "tags": [_tag(fmt, n, p) for n, p in tools],
             "separator": {"llama3_json": "; ", "mistral": ", ", "hermes": "\n", "deepseek_v3": "\n"}[fmt],
             "at_least_one": True, "stop_after_first": not several}
    around = {"mistral": ("[TOOL_CALLS][", "]"), "deepseek_v3": (DS_CALLS, DS_CALLS_END)}.get(fmt)
    if around is not None:
        calls = {"type": "sequence", "elements": [{"type": "const_string", "value": around[0]}, calls,
                                                  {"type": "const_string", "value": around[1]}]}
    value = json.dumps({"type": "structural_tag", "format": calls}, ensure_ascii=False)
    return GrammarSpec("structural_tag", value, "tools")


# --- scanning JSON as it is written ---------------------------------------------------------------

def _skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def _string_end(t: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at t[i], None when `t` stops inside it."""
    j = i + 1
    while j < len(t):
        if t[j] == "\\":
            j += 2
        elif t[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(t: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at t[i], None when `t` stops inside it."""
    if t[i] == '"':
        return _string_end(t, i)
    if t[i] not in "{[":
        j = i
        while j < len(t) and t[j] not in ",}] \t\r\n":
            j += 1
        return j if j < len(t) else None
    depth, j = 0, i
    while j < len(t):
        if t[j] == '"':
            end = _string_end(t, j)
            if end is None:
                return None
            j = end
            continue
        if t[j] in "{[":
            depth += 1
        elif t[j] in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


@dataclass
class Call:
    """One call as far as the text goes: `end` is set once its object is closed."""

    name: str | None = None
    arguments: str = ""  # the arguments' JSON text so far
    end: int | None = None
    streamable: bool = True  # False: the arguments are a JSON string, sent decoded once complete


def scan_call(t: str, i: int) -> Call | None:
    """The call object opening at t[i] ('{'), as far as `t` goes; None if it is not one."""
    call, j = Call(), i + 1
    while True:
        j = _skip_ws(t, j)
        if j >= len(t):
            return call
        if t[j] in ",}":
            if t[j] == "}":
                call.end = j + 1
                return call if call.name is not None else None
            j += 1
            continue
        if t[j] != '"':
            return None
        key_end = _string_end(t, j)
        colon = _skip_ws(t, key_end) if key_end is not None else len(t)
        if colon >= len(t):
            return call
        if t[colon] != ":":
            return None
        key, j = json.loads(t[j:key_end]), _skip_ws(t, colon + 1)
        if j >= len(t):
            return call
        end = _value_end(t, j)
        if not _take(call, key, t, j, end):
            return None
        if end is None:
            return call
        j = end


def _take(call: Call, key: str, t: str, start: int, end: int | None) -> bool:
    """Record the value t[start:end] (end None: unfinished) of `key`; False if the object is no call."""
    if key == "name" and end is not None:
        try:
            name = json.loads(t[start:end])
        except ValueError:
            return False
        if not isinstance(name, str):
            return False
        call.name = name
    elif key in _ARG_KEYS:
        call.streamable = t[start] != '"'
        if end is None:
            call.arguments = t[start:] if call.streamable else ""
        elif call.streamable:
            call.arguments = t[start:end]
        else:
            try:
                call.arguments = json.loads(t[start:end])
            except ValueError:
                return False
    return True


# --- parsing each format --------------------------------------------------------------------------

@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that `marker` starts with (a marker being written)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _content_until(text: str, marker: str, final: bool) -> tuple[str, int]:
    """(content before `marker`, where the marker starts; -1 when absent)."""
    k = text.find(marker)
    if k >= 0:
        return text[:k], k
    return (text if final else text[:len(text) - _held_back(text, marker)]), -1


def parse(fmt: str, text: str, final: bool) -> Parsed:
    """The content and calls of `text` in `fmt`; `final`: the output is complete (nothing held back)."""
    return {"hermes": _parse_hermes, "mistral": _parse_mistral, "llama3_json": _parse_llama,
            "deepseek_v3": _parse_deepseek}[fmt](text, final)


def _parse_hermes(t: str, final: bool) -> Parsed:
    out, pos = Parsed(), 0
    while True:
        before, k = _content_until(t[pos:], "<tool_call>", final)
        if not out.calls or before.strip():
            out.content += before
        if k < 0:
            return out
        j = _skip_ws(t, pos + k + len("<tool_call>"))
        if j >= len(t):
            return out
        call = scan_call(t, j) if t[j] == "{" else None
        if call is None:  # not a call after all: the rest is text
            out.content += t[pos + k:]
            return out
        out.calls.append(call)
        if call.end is None:
            return out
        e = _skip_ws(t, call.end)
        if t.startswith("</tool_call>", e):
            pos = e + len("</tool_call>")
        elif not final and "</tool_call>".startswith(t[e:]):
            return out
        else:
            pos = call.end


def _calls_in_list(t: str, j: int, out: Parsed, separator: str, closing: str | None) -> int:
    """Calls one after the other from t[j] (separated by `separator`, the list ended by `closing`);
    returns where the text after the list starts (len(t) when it is not over)."""
    while True:
        j = _skip_ws(t, j)
        if j >= len(t):
            return j
        if closing is not None and t[j] == closing:
            return j + 1
        if t[j] == separator:
            j += 1
            continue
        call = scan_call(t, j) if t[j] == "{" else None
        if call is None:
            return j
        out.calls.append(call)
        if call.end is None:
            return len(t)
        j = call.end


def _parse_mistral(t: str, final: bool) -> Parsed:
    content, k = _content_until(t, "[TOOL_CALLS]", final)
    out = Parsed(content)
    if k < 0:
        return out
    j = _skip_ws(t, k + len("[TOOL_CALLS]"))
    if j < len(t) and t[j] == "[":
        j = _calls_in_list(t, j + 1, out, ",", "]")
    elif j < len(t) and t[j] == "{":
        j = _calls_in_list(t, j, out, ",", None)
    if t[j:].strip() and (final or out.calls and out.calls[-1].end is not None):
        out.content += t[j:]
    return out


def _parse_llama(t: str, final: bool) -> Parsed:
    start = _skip_ws(t, 0)
    if t.startswith("<|python_tag|>", start):
        start = _skip_ws(t, start + len("<|python_tag|>"))
    elif not final and start == len(t) or "<|python_tag|>".startswith(t[start:]) and not final:
        return Parsed()
    if start >= len(t) or t[start] != "{":
        return Parsed(t)
    out = Parsed()
    rest = _calls_in_list(t, start, out, ";", None)
    complete = out.calls and all(c.end is not None for c in out.calls)
    if not out.calls or (final and out.calls[0].name is None):
        return Parsed(t if final else "")  # no call (yet): text, once the output is over
    if t[rest:].strip() and (final or complete):
        out.content += t[rest:]
    return out


def _parse_deepseek(t: str, final: bool) -> Parsed:
    content, k = _content_until(t, DS_CALLS, final)
    out = Parsed(content)
    j = k + len(DS_CALLS)
    while k >= 0:
        j = _skip_ws(t, j)
        if t.startswith(DS_CALLS_END, j):
            j += len(DS_CALLS_END)
            break
        if not t.startswith(DS_CALL, j):
            if not final and any(m.startswith(t[j:]) for m in (DS_CALL, DS_CALLS_END)):
                return out  # a marker being written, or nothing yet
            break
        call = _deepseek_call(t, j + len(DS_CALL))
        if call is None or call.end is None:
            out.calls += [call] if call is not None else []
            return out
        out.calls.append(call)
        j = call.end
    if k >= 0 and t[j:].strip() and final:
        out.content += t[j:]
    return out


def _deepseek_call(t: str, i: int) -> Call | None:
    """The call after `<｜tool▁call▁begin｜>` at t[i], as far as `t` goes; None until its name is written."""
    sep = t.find(DS_SEP, i)
    line = t.find("\n", sep) if sep >= 0 else -1
    if line < 0:
        return None
    call = Call(name=t[sep + len(DS_SEP):line].strip())
    j = _skip_ws(t, line + 1)
    if t.startswith("```json", j):
        j = _skip_ws(t, j + len("```json"))
    elif "```json".startswith(t[j:]):
        return call
    if j >= len(t) or t[j] != "{":
        return call
    end = _value_end(t, j)
    call.arguments = t[j:] if end is None else t[j:end]
    closing = t.find(DS_CALL_END, end) if end is not None else -1
    if closing >= 0:
        call.end = closing + len(DS_CALL_END)
    return call


# --- OpenAI's shapes ------------------------------------------------------------------------------

def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls_json(calls: list[Call]) -> list[dict]:
    """Calls with a name, as an assistant message's `tool_calls`."""
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.name is not None]


@dataclass
class ToolCallStream:
    """The deltas of one choice's stream: content and tool-call pieces, from the text so far."""

    fmt: str
    text: str = ""
    sent_content: int = 0
    sent_calls: list[int] = field(default_factory=list)  # arguments characters sent, per call started

    def add(self, text: str, final: bool = False) -> list[dict]:
        self.text += text
        parsed = parse(self.fmt, self.text, final)
        deltas = []
        if len(parsed.content) > self.sent_content:
            deltas.append({"content": parsed.content[self.sent_content:]})
            self.sent_content = len(parsed.content)
        for i, c in enumerate(parsed.calls):
            if c.name is None:
                break
            if i == len(self.sent_calls):
                self.sent_calls.append(0)
                deltas.append(_call_delta(i, {"name": c.name, "arguments": ""}, call_id()))
            if (c.streamable or c.end is not None) and len(c.arguments) > self.sent_calls[i]:
                deltas.append(_call_delta(i, {"arguments": c.arguments[self.sent_calls[i]:]}))
                self.sent_calls[i] = len(c.arguments)
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)


def _call_delta(index: int, function: dict, id_: str | None = None) -> dict:
    call: dict = {"index": index, "function": function}
    if id_ is not None:
        call.update(id=id_, type="function")
    return {"tool_calls": [call]}
