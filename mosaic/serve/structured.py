"""The server's structured-output fields and tool calls (docs/STRUCTURED.md, docs/SERVING.md).

Fields read (one constraint per request; two is a 400 naming both):
  response_format       OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema":
                        {"name", "schema", "strict"}} (strict or not, the answer follows the schema)
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's extra fields (older names)
  structured_outputs    vLLM's current field: {"json" | "regex" | "choice" | "grammar" | "json_object"}
  tools + tool_choice   "required" or {"type": "function", "function": {"name"}}: the answer is
                        constrained to {"name": one of the tools, "arguments": an object valid
                        against that tool's parameters} and returned as `tool_calls`; "none": text;
                        "auto": text (documented: none of the supported families has a tool-call
                        format the engine could let the model choose; labelled in mosaic.ignored)

Tools reach the prompt through the chat template when it reads `tools` (Qwen-style templates), else
through the default: a system message listing the functions and the JSON shape of a call.

A tool-calling history (the agent loop's second request: the assistant's tool_calls, then `tool`
messages with their results) is read (`history`): passed to a chat template that renders
`tool_calls` as transformers passes them (arguments as objects, the tool message named), else in
the documented default: the assistant's turn says its calls in the shape it was asked to answer
in, one JSON object a line, and each result becomes a user message "The function NAME returned:
CONTENT"."""

from __future__ import annotations

import json
import uuid

from ..config.structured import NOT_ENFORCED, spec_of, spec_of_response_format, unenforced
from ..errors import InputError

AUTO = ("tool_choice 'auto': the answer is text; this server lets the model call a tool only when asked "
        "(tool_choice 'required' or a named function), since the model has no tool-call format of its own")
NONE = "tool_choice 'none': the tools are not offered to the model; the answer is text"
VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def constraint_args(req) -> dict:
    """generate()'s constraint keywords of a request's fields (InputError: several given, or a
    malformed field), without the tools (tool_call below)."""
    found = []
    if getattr(req, "response_format", None) is not None:
        found.append(("response_format", "response_format", req.response_format))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if getattr(req, field, None) is not None:
            found.append((field, kind, getattr(req, field)))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        found += structured_outputs(so)
    if len(found) > 1:
        raise InputError(f"give one output constraint, not {len(found)}: {', '.join(f for f, _, _ in found)}",
                         param=found[1][0])
    if not found:
        return {}
    field, kind, value = found[0]
    if kind == "response_format":
        spec = spec_of_response_format(value)
    else:
        spec = spec_of(**{kind: value}, names={kind: field})
    return {} if spec is None else {"constraint": spec}


def unenforced_fields(req, spec, funcs=None) -> dict[str, str]:
    """{request field path: why} for each keyword of the request's JSON schema (or of the forced
    tools' parameters) that the compiled grammar does not enforce (config/structured.UNENFORCED),
    for mosaic.ignored: 'response_format.json_schema.schema.maximum', 'tools.0.function.parameters.
    properties.n.minimum'."""
    if spec is None or spec.kind != "json_schema":
        return {}
    if funcs is not None:
        roots = [(f"tools.{i}.function.parameters", t["function"].get("parameters"))
                 for i, t in enumerate(req.tools) if t.get("function") in funcs]
    elif spec.name == "response_format":
        roots = [("response_format.json_schema.schema", json.loads(spec.value))]
    else:
        roots = [(spec.name, json.loads(spec.value))]
    return {path: NOT_ENFORCED for root, schema in roots for path in unenforced(schema, root)}


def structured_outputs(so) -> list:
    """vLLM's structured_outputs object -> [(field path, kind, value)]."""
    if not isinstance(so, dict):
        raise InputError("structured_outputs must be an object with one of 'json', 'regex', 'choice', 'grammar', "
                         "'json_object'", param="structured_outputs")
    out = []
    for key, value in so.items():
        if value is None or value is False:
            continue
        if key == "json_object":
            out.append(("structured_outputs.json_object", "response_format", {"type": "json_object"}))
        elif key in VLLM:
            out.append((f"structured_outputs.{key}", VLLM[key], value))
        elif key not in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                         "disable_fallback", "backend"):
            raise InputError(f"structured_outputs.{key} is not one of json, regex, choice, grammar, json_object",
                             param=f"structured_outputs.{key}")
    return out


def tool_mode(tools, choice) -> tuple[list[dict] | None, str | None]:
    """(the tools the answer must call, or None for text; the reason to list in mosaic.ignored)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InputError(f"tool_choice {choice!r} needs tools (tool calling answers with a call of one of the "
                             "given functions)", param="tool_choice")
        return None, None
    funcs = [t.get("function") if isinstance(t, dict) else None for t in tools]
    for i, f in enumerate(funcs):
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or tools[i].get("type", "function") != \
                "function":
            raise InputError(f"tools.{i} must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                             param=f"tools.{i}")
    if choice in (None, "auto"):
        return None, AUTO
    if choice == "none":
        return None, NONE
    if choice == "required":
        return funcs, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    chosen = [f for f in funcs if f["name"] == name]
    if not chosen:
        raise InputError(f"tool_choice {choice!r}: use 'none', 'auto', 'required' or {{'type': 'function', "
                         f"'function': {{'name': one of {[f['name'] for f in funcs]}}}}}", param="tool_choice")
    return chosen, None


def call_schema(funcs: list[dict]) -> dict:
    """The JSON schema of one call of any of funcs: {"name": its name, "arguments": its parameters}."""
    def one(f):
        params = f.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}
    alts = [one(f) for f in funcs]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def tool_prompt(messages: list[dict], funcs: list[dict], template: str | None) -> list[dict]:
    """messages with the tools described in a system message (the default format), unless the
    chat template renders `tools` itself (then they are passed to it: prompts.encode)."""
    if template and "tools" in template:
        return messages
    lines = ["You can call these functions. Answer with one JSON object {\"name\": <function name>, "
             "\"arguments\": <its arguments>}:"]
    lines += [json.dumps({"name": f["name"], "description": f.get("description", ""),
                          "parameters": f.get("parameters") or {}}) for f in funcs]
    text = "\n".join(lines)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tool_calls(text: str) -> list[dict]:
    """The answer of a tool-constrained request in OpenAI's `tool_calls` shape."""
    call = json.loads(text)
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]


def history(messages: list[dict], template: str | None) -> list[dict]:
    """Chat messages with their tool-calling history rendered for the template (module
    docstring); messages without one as they are. InputError for a call whose arguments are not a
    JSON object, or a tool message whose tool_call_id no earlier call has."""
    if not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages
    native = bool(template) and "tool_calls" in template
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = [(c["id"], c["function"]["name"], _arguments(c, f"messages.{i}.tool_calls.{j}"))
                     for j, c in enumerate(m["tool_calls"])]
            names |= {cid: name for cid, name, _ in calls}
            if native:
                out.append({**m, "tool_calls": [{"id": cid, "type": "function", "function": {
                    "name": name, "arguments": args}} for cid, name, args in calls]})
            else:
                said = "\n".join(json.dumps({"name": name, "arguments": args}) for _, name, args in calls)
                out.append({"role": "assistant", "content": f"{m['content']}\n{said}" if m["content"] else said})
        elif m["role"] == "tool":
            name = names.get(m["tool_call_id"])
            if name is None:
                raise InputError(f"messages.{i}: a tool message answers tool_call_id {m['tool_call_id']!r}, which no "
                                 f"earlier assistant message's tool_calls has (known: {sorted(names)})",
                                 param=f"messages.{i}.tool_call_id")
            out.append({**m, "name": name} if native else
                       {"role": "user", "content": f"The function {name} returned: {m['content']}"})
        else:
            out.append(m)
    return out


def _arguments(call: dict, where: str) -> dict:
    """A call's arguments (JSON text) as an object (InputError otherwise)."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError as e:
        raise InputError(f"{where}.function.arguments is not JSON: {e}", param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise InputError(f"{where}.function.arguments must be a JSON object, got {type(args).__name__}",
                         param=f"{where}.function.arguments")
    return args
