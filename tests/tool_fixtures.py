"""Tools for the multi-turn tests (named in tool yamls as tool_fixtures.X, or tests.tool_fixtures.X from the repo
root): an adder, a long-text echo, one that raises, one that sleeps."""
import asyncio
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import BaseTool  # noqa: E402


class AddTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return str(int(parameters["a"]) + int(parameters["b"])), 0.0, {}


class EchoTool(BaseTool):
    """Returns 'x' * n followed by the digits 0-9, so truncation sides are visible."""
    async def execute(self, instance_id, parameters, **kwargs):
        return "a" * int(parameters.get("n", 10)) + "0123456789", 0.0, {}


class RaisingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool broke")


class SleepyTool(BaseTool):
    """Sleeps config.delay seconds (or the 'delay' argument), then answers 'slept'."""
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(float(parameters.get("delay", self.config.get("delay", 0.0))))
        return "slept", 0.0, {}


def schema(name, **properties):
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in properties.items()},
        "required": list(properties)}}}


def write_tool_yaml(path, prefix="tool_fixtures", **timeouts):
    """add, echo, boom, sleepy (config.timeout from `timeouts`, e.g. sleepy=0.2)."""
    entries = []
    for name, cls, props in (("add", "AddTool", {"a": "integer", "b": "integer"}), ("echo", "EchoTool", {}),
                             ("boom", "RaisingTool", {}), ("sleepy", "SleepyTool", {})):
        config = {"type": "native", **({"timeout": timeouts[name]} if name in timeouts else {})}
        entries.append({"class_name": f"{prefix}.{cls}", "config": config, "tool_schema": schema(name, **props)})
    Path(path).write_text(yaml.safe_dump({"tools": entries}))
    return path


from demo_tools import BoxTool  # noqa: E402


class FlakyBoxTool(BoxTool):
    """The demo's open_box, but the lid sticks (raises) for even codes and it hangs (past any timeout) for 1 and 3."""
    async def execute(self, instance_id, parameters, **kwargs):
        code = self.boxes[instance_id]["code"]
        if code % 2 == 0:
            raise RuntimeError("the lid is stuck")
        if code < 5:
            await asyncio.sleep(3600)
        return await super().execute(instance_id, parameters, **kwargs)


from interactions import BaseInteraction  # noqa: E402


class EchoInteraction(BaseInteraction):
    """Replies 'heard <answer>' with the answer's length as the turn score; 'bye' ends the conversation. Keeps
    every conversation it was shown, and which instances are still open."""

    def __init__(self, config):
        super().__init__(config)
        self.seen, self.open, self.started = [], set(), []

    async def start_interaction(self, instance_id=None, **kwargs):
        instance_id = await super().start_interaction(instance_id)
        self.open.add(instance_id)
        self.started.append(instance_id)
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.seen.append([dict(m) for m in messages])
        answer = messages[-1]["content"]
        return answer == "bye", f"heard {answer}", float(len(answer)), {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.open.discard(instance_id)


class RaisingInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        raise RuntimeError("the user simulator broke")


class SlowInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        await asyncio.sleep(30)
        return False, "too late", 0.0, {}


class MalformedInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return False, None, 0.0, {}


class FailingStartInteraction(BaseInteraction):
    async def start_interaction(self, instance_id=None, **kwargs):
        raise RuntimeError("no session")
