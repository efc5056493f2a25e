"""Benchmark the agent loop's scheduling: rollout wall time of rollout.mode=async against mode=sync when tool
latency varies (uniform 0-200 ms per call, seeded), measured side by side in one run.

The engine is scripted (every conversation makes --calls tool calls, then answers) and costs --ms-per-token of
wall time per generated token, one request at a time as the hf engine generates (it sleeps, releasing the GIL as
torch kernels do). The same tokens, tool latencies and seeds go to both modes, and the conversations are checked
to be identical, so the ratio is scheduling alone: sync waits for the slowest tool of every round, async keeps
the engine busy with whichever conversations are ready.
Usage: .venv/bin/python bench/multiturn.py [--conversations 16] [--calls 3] [--max-latency-ms 200] [--repeats 3]
Prints the median wall time of each mode and the sync/async ratio, then a markdown table.
"""

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from agent import AgentLoop, engine_generate  # noqa: E402
from config import Config, default_tree  # noqa: E402
from demo import build_tokenizer  # noqa: E402
from demo_tools import TOOL_CHAT_TEMPLATE  # noqa: E402
from rollout import Sampling  # noqa: E402
from tools import BaseTool  # noqa: E402

CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'


class LatencyTool(BaseTool):
    """Answers 'ok' after a latency drawn per (conversation, call) from a seeded uniform [0, max] ms."""

    def __init__(self, max_latency_s, seed=0):
        super().__init__({}, {"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {}}}})
        self.max_latency_s, self.seed, self.timeout = max_latency_s, seed, 60.0

    async def create(self, instance_id=None, conversation=0, **kwargs):
        return {"conversation": conversation, "calls": 0}

    async def execute(self, instance, parameters, **kwargs):
        rng = random.Random(f"{self.seed}/{instance['conversation']}/{instance['calls']}")
        instance["calls"] += 1
        await asyncio.sleep(rng.uniform(0, self.max_latency_s))
        return "ok", 0.0, {}


class TimedScriptedEngine:
    """Each request: --calls tool-call turns, then '#### 1'; costs ms_per_token per generated token, one request
    after another (as the hf engine)."""

    def __init__(self, tokenizer, calls, ms_per_token):
        self.tok, self.calls, self.seconds_per_token = tokenizer, calls, ms_per_token / 1000

    def generate(self, prompt_ids, sampling, seed):
        out = []
        for ids in prompt_ids:
            turn = self.tok.decode(ids, skip_special_tokens=False).count("<|im_start|>assistant") - 1
            text = CALL if turn < self.calls else "#### 1"
            tokens = (self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])[:sampling.max_tokens]
            time.sleep(self.seconds_per_token * len(tokens))
            out.append(tokens)
        return out, None


def rollout_once(tokenizer, args, mode):
    tool = LatencyTool(args.max_latency_ms / 1000)
    multi_turn = Config.wrap(default_tree()["actor_rollout_ref"]["rollout"]["multi_turn"])
    multi_turn.update(enable=True, max_assistant_turns=args.calls + 1)
    loop = AgentLoop(tokenizer, {"lookup": tool}, multi_turn, 1024, mode=mode, eos_ids=[tokenizer.eos_token_id],
                     chat_template=TOOL_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "Look it up."}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        messages, tools=loop.schemas, chat_template=TOOL_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    batch = {"raw_prompt_ids": [prompt] * args.conversations, "raw_prompt": [messages] * args.conversations,
             "extra_info": [{"tools_kwargs": {"lookup": {"create_kwargs": {"conversation": i}}}}
                            for i in range(args.conversations)]}
    engine = engine_generate(TimedScriptedEngine(tokenizer, args.calls, args.ms_per_token), Sampling(1024), False)
    start = time.perf_counter()
    conversations = loop.run(batch, engine, seed=0)
    return time.perf_counter() - start, [c.response_ids for c in conversations]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3, help="tool calls per conversation")
    parser.add_argument("--max-latency-ms", type=float, default=200.0)
    parser.add_argument("--ms-per-token", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = build_tokenizer(folder)
    times = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode in times:                   # interleaved, so drift in machine load hits both modes alike
            seconds, responses = rollout_once(tokenizer, args, mode)
            times[mode].append(seconds)
            if mode == "sync":
                reference = responses
            elif responses != reference:
                raise SystemExit("sync and async produced different conversations")
    sync, asyn = statistics.median(times["sync"]), statistics.median(times["async"])
    print(f"{args.conversations} conversations x {args.calls} tool calls, tool latency uniform 0-"
          f"{args.max_latency_ms:g} ms, engine {args.ms_per_token:g} ms/token, median of {args.repeats}")
    print(f"sync {sync:.3f} s, async {asyn:.3f} s: async is {sync / asyn:.2f}x faster")
    print("\n| rollout.mode | wall time (s) | ratio |\n|---|---|---|")
    print(f"| sync | {sync:.3f} | 1.00 |\n| async | {asyn:.3f} | {sync / asyn:.2f}x |")


if __name__ == "__main__":
    main()
