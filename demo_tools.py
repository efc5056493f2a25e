"""The tool-use demo (`python data.py demo-tools --out DIR`): a task the tiny model cannot solve without its tool.

Each prompt asks for the code hidden in a box; the code is a random number drawn per row, so nothing in the prompt
or the weights can predict it. The `open_box` tool (this module's BoxTool) returns it: the row's tools_kwargs give
the tool the code (create_kwargs), as verl's gsm8k rows give Gsm8kTool the ground truth. A supervised warm-up
teaches the call format on whole conversations (the tool's answer is masked out of the loss, as in RL) with noisy
final answers, so RL starts from a policy that calls the tool but often misreports the code; the reward (1.0 for
the right '#### code', 0.1 for a wrong number) then rewards reading the tool's answer.

Left out: anything but hermes-format calls; the demo model is the same tiny Qwen2 as `data.py demo`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tools import BaseTool

# A Qwen2.5-style template cut to the bone: tool names in a system block, tool answers as <tool_response> blocks
# in a user turn (consecutive tool messages share one turn), assistant tool calls kept as the text the model wrote.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class BoxTool(BaseTool):
    """open_box: returns the code of the row's box (create_kwargs: code). calc_reward: 1.0 once opened."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.boxes = {}

    async def create(self, instance_id=None, code=None, **kwargs):
        instance_id = await super().create(instance_id)
        self.boxes[instance_id] = {"code": code, "opened": False}
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        box = self.boxes[instance_id]
        box["opened"] = True
        return f"code {box['code']}", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0 if self.boxes[instance_id]["opened"] else 0.0

    async def release(self, instance_id, **kwargs):
        self.boxes.pop(instance_id, None)
