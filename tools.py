"""Tools for multi-turn rollouts: verl's tool interface, its yaml format, the hermes call format and the built-in
gsm8k and geo3k tools.

A tool yaml (actor_rollout_ref.rollout.multi_turn.tool_config_path) is verl's:

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool     # import path; verl's gsm8k tool maps to Gsm8kTool here
        config: {type: native, timeout: 30}            # passed to the class; `timeout` (s) bounds each call
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}}

A tool class has verl's async interface (verl/tools/base_tool.py::BaseTool, v0.5.0): `cls(config, tool_schema)`,
`create(instance_id=None, **create_kwargs) -> instance_id`, `execute(instance_id, parameters, **execute_kwargs)
-> (text, step_reward, metrics)`, `calc_reward(instance_id, **kwargs) -> float`, `release(instance_id, **kwargs)`.
Per-row kwargs come from extra_info.tools_kwargs[tool_name].{create,execute,calc_reward,release}_kwargs.

Left out: verl's ToolResponse with images/videos ([HEAD]), MCP tools. Interactions (user simulators) are in
interactions.py.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import json
import re
import uuid
from pathlib import Path

from config import Config, ConfigError, read_config_file
from rewards import geo3k_compute_score, gsm8k_compute_score

DEFAULT_TIMEOUT_S = 30.0        # per tool call, unless the tool's config sets `timeout`
TRUNCATE_SIDES = ("left", "right", "middle")

# verl's own class names -> minirl's built-ins, so verl's example yamls work unchanged
VERL_CLASS_ALIASES = {"verl.tools.gsm8k_tool.Gsm8kTool": "tools.Gsm8kTool",
                      "verl.tools.geo3k_tool.Geo3kTool": "tools.Geo3kTool"}


class BaseTool:
    """verl's tool interface. Subclass it (or write a class with the same async methods) and name it in the yaml.
    `tool_schema` arrives as a dict with attribute access (tool_schema.function.name works, as in verl)."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema["function"]["name"]

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid.uuid4())

    async def execute(self, instance_id, parameters, **kwargs):
        return "Updated the tool state.", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass


class AnswerGradingTool(BaseTool):
    """verl's answer-checking demo tools: the model submits an answer (parameters.answer), the tool grades it
    against the row's ground truth (create_kwargs.ground_truth). Step reward 0.0 when the grade improved on the
    stored one, else -0.05; calc_reward is the stored answer's grade. Subclasses say how an answer is kept and
    graded."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.instances = {}

    def kept(self, answer):
        return answer

    def grade(self, response, ground_truth):
        raise NotImplementedError

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid.uuid4())
        self.instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self.instances[instance_id]
        state["response"] = self.kept(answer)
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return f"Current parsed {answer=} {reward=}", step_reward, {}

    async def calc_reward(self, instance_id, **kwargs):
        state = self.instances[instance_id]
        return self.grade(state["response"], state["ground_truth"])

    async def release(self, instance_id, **kwargs):
        self.instances.pop(instance_id, None)


class Gsm8kTool(AnswerGradingTool):
    """verl's verl.tools.gsm8k_tool.Gsm8kTool: the answer is graded as '#### <answer>' with gsm8k's flexible
    extraction (1.0 or 0.0)."""

    def kept(self, answer):
        return answer if answer.startswith("#### ") else "#### " + answer

    def grade(self, response, ground_truth):
        return gsm8k_compute_score(response, ground_truth, method="flexible", format_score=0.0, score=1.0)


class Geo3kTool(AnswerGradingTool):
    """verl's verl.tools.geo3k_tool.Geo3kTool: the answer itself (no \\boxed{} needed) is graded with geo3k's
    scorer without its format part (1.0 or 0.0)."""

    def grade(self, response, ground_truth):
        return geo3k_compute_score(response, ground_truth, use_boxed=False, format_score=0.0)


# ----------------------------------------------------------------------------------------------------------------
# The yaml


def load_tools(path):
    """{tool name: tool instance} from a verl tool yaml. Every problem (missing file, bad yaml, missing or
    unimportable class, a class without the async interface, a bad schema, a duplicate name) is a ConfigError
    naming the file and the entry, raised before any model loads."""
    where, entries = read_entries("actor_rollout_ref.rollout.multi_turn.tool_config_path", path, "tools",
                                  "{class_name, config, tool_schema}")
    tools = {}
    for i, entry in enumerate(entries):
        tool = _build_tool(entry, f"{where}, tools[{i}]")
        if tool.name in tools:
            raise ConfigError(f"{where}, tools[{i}]: a second tool named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools


def read_entries(key, path, list_key, entry_shape):
    """(where, entries): the non-empty top-level `list_key` list of the yaml at `path`, which config `key` names;
    `where` starts every error about the file."""
    where = f"{key} '{path}'"
    if not Path(path).is_file():
        raise ConfigError(f"{where} does not exist")
    try:                            # config.py's reader: bounded, no tags, UTF-8 text; its errors name the file
        raw = read_config_file(path)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get(list_key), list) or not raw[list_key]:
        raise ConfigError(f"{where}: expected a top-level '{list_key}:' list of {entry_shape}")
    return where, raw[list_key]


def entry_config(entry, where, example_class):
    """(config, timeout) of one yaml entry, after checking its class_name, config mapping and config.timeout."""
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ConfigError(f"{where}: needs 'class_name' (an import path such as {example_class})")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: 'config' must be a mapping")
    timeout = config.get("timeout", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ConfigError(f"{where}: config.timeout must be a positive number of seconds, got {timeout!r}")
    return config, float(timeout)


def require_async_methods(cls, methods, where, class_name, kind, base):
    for method in methods:
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise ConfigError(f"{where}: {class_name} has no async '{method}' method; {kind} follow verl's "
                              f"interface (subclass {base})")


def _build_tool(entry, where):
    config, timeout = entry_config(entry, where, "tools.Gsm8kTool")
    schema = _check_schema(entry.get("tool_schema"), where)
    cls = import_class(entry["class_name"], where)
    require_async_methods(cls, ("create", "execute", "calc_reward", "release"), where, entry["class_name"],
                          "tools", "tools.BaseTool")
    try:
        tool = cls(Config.wrap(dict(config)), Config.wrap(schema))
    except Exception as err:
        raise ConfigError(f"{where}: {entry['class_name']}(config, tool_schema) failed: {err!r}") from err
    tool.name = schema["function"]["name"]
    tool.timeout = timeout
    return tool


def _check_schema(schema, where):
    """An OpenAI function schema: {type: function, function: {name, description?, parameters: {type: object,
    properties, required?}}}."""
    def fail(problem):
        raise ConfigError(f"{where}: tool_schema {problem}; expected {{type: function, function: {{name, "
                          f"description, parameters: {{type: object, properties: {{...}}, required: [...]}}}}}}")

    if not isinstance(schema, dict) or schema.get("type") != "function":
        fail("must be a mapping with type: function")
    function = schema.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        fail("needs function.name")
    params = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(
            params.get("properties", {}), dict):
        fail("needs function.parameters with type: object and a properties mapping")
    required = params.get("required", [])
    if not isinstance(required, list) or any(not isinstance(name, str) or name not in params.get("properties", {})
                                             for name in required):
        fail(f"lists required parameters {required!r} that are not in its properties")
    return schema


def import_class(class_name, where, aliases=VERL_CLASS_ALIASES, kind="tools", base="tools.BaseTool"):
    """The class a yaml's class_name names (verl's own class names through `aliases`); a ConfigError naming
    `where` when it cannot be imported, with a did-you-mean for a typo in the class."""
    target = aliases.get(class_name, class_name)
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"{where}: class_name {class_name!r} must be a dotted import path (module.Class)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        verl_note = (f"; of verl's {kind} minirl has {', '.join(aliases)} (write others as a subclass of "
                     f"{base})" if class_name.startswith("verl.") else "")
        raise ConfigError(f"{where}: cannot import {module_name!r} for class_name {class_name!r}: {err!r} "
                          f"(is the module on PYTHONPATH?){verl_note}") from err
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        classes = [name for name, value in vars(module).items() if inspect.isclass(value)]
        close = difflib.get_close_matches(attr, classes, n=1)
        raise ConfigError(f"{where}: module {module_name!r} has no class {attr!r}"
                          + (f": did you mean {close[0]!r}?" if close else ""))
    return cls


# ----------------------------------------------------------------------------------------------------------------
# Calls: hermes parsing, truncation


class ToolCall:
    """One parsed call: name and arguments, or `error` (the text the model gets back) when it cannot be run."""

    def __init__(self, name=None, arguments=None, error=None):
        self.name, self.arguments, self.error = name, arguments or {}, error

    def __repr__(self):
        return f"ToolCall({self.name!r}, {self.arguments!r}, error={self.error!r})"


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text):
    """Every <tool_call>{"name": ..., "arguments": {...}}</tool_call> in `text`, in order. A call whose body is
    not a JSON object with a string name and object arguments (a JSON string of an object is accepted, as
    vLLM's hermes parser does) comes back with `error` set: verl drops those, minirl answers them with the error
    so the model learns the format."""
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(error=f"Error: the tool call is not valid JSON ({err.msg}): {body.strip()[:200]}"))
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall(error='Error: a tool call must be {"name": <string>, "arguments": <object>}, '
                                        f"got {body.strip()[:200]}"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def truncate_tool_text(text, max_length, side):
    """verl's ToolAgentLoop rule: texts longer than max_length characters keep the head ('left': head +
    '...(truncated)'), the tail ('right': '(truncated)...' + tail) or both halves ('middle')."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")
