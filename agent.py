"""The multi-turn agent loop: the model talks, calls tools or hears from a simulated user, and talks again; only
the tokens it wrote are trained (verl's ToolAgentLoop, experimental/agent_loop/tool_agent_loop.py, v0.5.0; the
interactions as verl v0.5.0's SGLang rollout runs them, workers/rollout/sglang_rollout/sglang_rollout.py).

One conversation, start to end (`AgentLoop.converse`):
    1. create an instance of every tool (create_kwargs from the row's extra_info.tools_kwargs), and start the
       row's interaction (extra_info.interaction_kwargs; interactions.py)
    2. generate an assistant turn with what is left of the response budget (and the prompt's images, if it has
       any: every turn is generated from them)                                          -> response_mask 1
    3. stop at the budget (response_length for the whole conversation), max_assistant_turns, max_user_turns,
       when the turn holds no <tool_call> and the row has no interaction, or after this first turn when the
       row's agent_name is single_turn_agent (verl's agent loop for it: one generation, no tools)
    4. run its calls (the first max_parallel_calls, concurrently), truncate each answer to
       max_tool_response_length characters, template the tool messages                 -> response_mask 0
       or, without calls, hand the conversation to the interaction: its turn score is kept; it ends the
       conversation or its reply is templated as a user message                        -> response_mask 0
       (stop instead if the new turn would leave no room for another assistant token); both count as user turns
    5. back to 2; at the end calc_reward and release every tool instance, finalize the interaction
The sequence trained is prompt + exactly the sampled tokens + the template's tokens between turns, so nothing is
re-tokenised; `tokenization_sanity_check_mode` compares it with a full re-templating of the messages.

Failures are data: a call with malformed JSON, an unknown tool, a tool that raises or runs past its timeout gets
an "Error: ..." answer, is counted (tool_calls/errors), and the conversation goes on. An interaction that raises,
runs past its timeout or answers malformed ends its conversation there, counted (multi_turn/interaction_errors)
and warned about once.

Scheduling (rollout.mode):
    sync   turn-synchronous: every live conversation generates its turn in one engine call, then all their tools
           run (concurrently); the next turn waits for the slowest tool.
    async  every conversation is its own asyncio task; the engine runs (in a worker thread) for whichever
           conversations are waiting for a turn, while the others wait on their tools.
Each turn is sampled with its own seed (run seed, conversation, turn), and the hf engine generates one request at
a time, so sync and async give the same tokens; vLLM also seeds per request (same tokens where its batched
kernels are batch-invariant).

Left out: multimodal tool answers, tool-call formats other than hermes (SGLang names it qwen, qwen25).
"""
from __future__ import annotations

import asyncio
import dataclasses
import numbers
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from batch import gather_tp_groups
from config import ConfigError, multi_turn_on
from interactions import interaction_kwargs, interaction_name, load_interactions
from tools import load_tools, parse_hermes, truncate_tool_text

MARK = "\x00minirl-assistant\x00"       # stands in for an assistant message when measuring the template
# verl's agent loops that a row's `agent_name` column picks (AgentLoop.default_agent for a row without one)
AGENT_NAMES = ("tool_agent", "single_turn_agent")
ROW_COLUMNS = ("raw_prompt", "extra_info", "agent_name")    # what AgentLoop.run reads of a row besides its ids


@dataclass
class Request:
    """One assistant turn to generate: the conversation so far, its token budget, its seed, and for a prompt with
    images what the engines need of them (vision.rollout_inputs' entry, its expanded prompt_ids continued with the
    conversation so far: the hf engine generates from those)."""
    ids: list
    max_tokens: int
    seed: int
    multi_modal: dict = None


@dataclass
class Conversation:
    prompt_ids: list                     # the templated prompt (with the tool schemas), as the dataset made it
    messages: list                       # the chat so far: prompt messages, then assistant and tool messages
    tools_kwargs: dict
    interaction_kwargs: dict = field(default_factory=dict)    # the row's; {} when it has no interaction
    multi_modal: dict = None             # the prompt's images (vision.rollout_inputs' entry); None: text only
    index: int = 0
    prompt_messages: int = 0             # how many of `messages` are the prompt's
    single_turn: bool = False            # the row's agent_name is single_turn_agent: one turn, no tools
    response_ids: list = field(default_factory=list)    # everything after the prompt: model and template tokens
    mask: list = field(default_factory=list)            # 1 where the model wrote the token, 0 for tool/template
    logprobs: list = field(default_factory=list)        # the engine's log-probs of model tokens (0.0 elsewhere)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    instances: dict = field(default_factory=dict)       # tool name -> instance id
    reward_scores: dict = field(default_factory=dict)   # tool name -> calc_reward
    interaction: object = None                          # the row's interaction, once started
    interaction_id: str = None
    user_turn_rewards: list = field(default_factory=list)   # the interaction's turn scores, in order
    interaction_errors: int = 0
    tokenization_mismatch: bool = False
    done: bool = False

    @property
    def num_turns(self):
        """verl's count: user + assistant turns + 1 (the prompt)."""
        return self.user_turns + self.assistant_turns + 1


class AgentLoop:
    """Runs conversations for a batch of rows. `tools`: {name: tool} (tools.load_tools); `interactions`: {name:
    interaction} (interactions.load_interactions); `multi_turn`: actor_rollout_ref.rollout.multi_turn;
    `response_length`: the budget of every whole conversation."""

    def __init__(self, tokenizer, tools, multi_turn, response_length, mode="sync", eos_ids=(), chat_template=None,
                 interactions=None):
        self.tokenizer, self.tools, self.response_length, self.mode = tokenizer, tools, response_length, mode
        self.interactions = interactions or {}
        self.cfg = multi_turn
        # a row without agent_name: with multi_turn.enable the tool loop (verl's SGLang rollout runs every row
        # multi-turn); without it (rollout.mode=async alone) one generation, as verl's async agent loop gives it
        self.default_agent = "tool_agent" if multi_turn.enable else "single_turn_agent"
        self.eos_ids = set(eos_ids) or {tokenizer.eos_token_id}
        self.chat_template = chat_template
        self.schemas = [dict(tool.get_openai_tool_schema()) for tool in tools.values()] or None
        self.base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": MARK}]
        self.base_text = self.render(self.base)
        # what the template writes after an assistant message's content (e.g. '<|im_end|>\n')
        self.closing = self.base_text[self.base_text.rindex(MARK) + len(MARK):]
        self.warned = False
        self.warned_interaction = False

    def render(self, messages, add_generation_prompt=False):
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, chat_template=self.chat_template,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- running a batch ------------------------------------------------------------------------------------
    def run(self, batch, generate, seed, multi_modal=None):
        """batch: columns raw_prompt_ids, raw_prompt (the messages) and extra_info (for tools_kwargs), one entry
        per conversation. generate: a blocking function from a list of Requests to [(tokens, logprobs or None)]
        (see engine_generate). multi_modal: vision.rollout_inputs of the rows (None without images); every turn
        is generated with the prompt's images. Returns one Conversation per row."""
        rows = len(batch["raw_prompt_ids"])
        infos = batch.get("extra_info") or [None] * rows
        images = multi_modal or [None] * rows
        agents = batch.get("agent_name") or [None] * rows
        # a single_turn_agent row (verl's agent loop for one generation) has no tools and no interaction
        conversations = [Conversation(list(ids), [dict(m) for m in messages], _tools_kwargs(info),
                                      interaction_kwargs(info) if self.interactions and not single else {},
                                      entry if entry and entry["images"] else None, index=i,
                                      prompt_messages=len(messages), single_turn=single)
                         for i, (ids, messages, info, entry, single) in enumerate(zip(
                             batch["raw_prompt_ids"], batch["raw_prompt"], infos, images,
                             [(agent or self.default_agent) == "single_turn_agent" for agent in agents]))]
        return asyncio.run(self._run(conversations, generate, seed))

    async def _run(self, conversations, generate, seed):
        await asyncio.gather(*(self.open_tools(c) for c in conversations if not c.single_turn))
        await asyncio.gather(*(self.start_interaction(c, seed) for c in conversations))
        if self.mode == "async":
            scheduler = Scheduler(generate)
            await asyncio.gather(*(self.converse(c, scheduler.generate, seed) for c in conversations))
        else:
            live = conversations
            while live:
                outputs = await asyncio.to_thread(generate, [self.request(c, seed) for c in live])
                await asyncio.gather(*(self.take_turn(c, *out) for c, out in zip(live, outputs)))
                live = [c for c in live if not c.done]
        await asyncio.gather(*(self.close_tools(c) for c in conversations))
        await asyncio.gather(*(self.finalize_interaction(c) for c in conversations))
        for conversation in conversations:
            if not conversation.single_turn:    # one generation is trained as sampled: nothing was re-templated
                self.check_tokenization(conversation)
        return conversations

    async def converse(self, conversation, generate_one, seed):
        """Async mode: this conversation's turns, one after another, independent of the others."""
        while not conversation.done:
            tokens, logprobs = await generate_one(self.request(conversation, seed))
            await self.take_turn(conversation, tokens, logprobs)

    def request(self, conversation, seed):
        c = conversation
        turn_seed = (seed * 1_000_003 + c.index * 1009 + c.assistant_turns) % 2**31
        # the hf engine generates from the expanded prompt ids (an image's tokens spelled out) plus what followed
        images = c.multi_modal and {**c.multi_modal, "prompt_ids": c.multi_modal["prompt_ids"] + c.response_ids}
        return Request(c.prompt_ids + c.response_ids, self.response_length - len(c.mask), turn_seed, images)

    # -- one turn -------------------------------------------------------------------------------------------
    async def take_turn(self, conversation, tokens, logprobs):
        """Append the sampled assistant turn, then stop, run its tool calls, or hear from the interaction."""
        c, cfg = conversation, self.cfg
        c.response_ids += tokens
        c.mask += [1] * len(tokens)
        c.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        c.assistant_turns += 1
        ended = bool(tokens) and tokens[-1] in self.eos_ids
        eos = tokens[-1] if ended else None
        content = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
        c.messages.append({"role": "assistant", "content": content})
        if (c.single_turn or len(c.mask) >= self.response_length
                or (cfg.max_assistant_turns and c.assistant_turns >= cfg.max_assistant_turns)
                or (cfg.max_user_turns and c.user_turns >= cfg.max_user_turns)):
            c.done = True
            return
        calls = parse_hermes(content)
        if calls:
            answers = await asyncio.gather(*(self.call_tool(c, call) for call in calls[:cfg.max_parallel_calls]))
            self.append_turn(c, [{"role": "tool", "content": truncate_tool_text(
                answer, cfg.max_tool_response_length, cfg.tool_response_truncate_side)} for answer in answers], eos)
        elif c.interaction is not None:
            reply = await self.interact(c)
            if reply is not None:
                self.append_turn(c, [{"role": "user", "content": reply}], eos)
        else:
            c.done = True

    def append_turn(self, c, messages, eos_token):
        """Template `messages` (tool answers or the interaction's reply) after the model's turn, masked out; or
        end the conversation if they would leave no room for another model token (its reward sits on one)."""
        ids = self.between_turns_ids(messages, eos_token)
        if len(c.mask) + len(ids) >= self.response_length:
            c.done = True
            return
        c.response_ids += ids
        c.mask += [0] * len(ids)
        c.logprobs += [0.0] * len(ids)
        c.messages += messages
        c.user_turns += 1

    def between_turns_ids(self, messages, eos_token):
        """The template's tokens between the model's last token and its next turn: the rest of the assistant
        message's closing (what follows the eos the model sampled), the tool (or user) messages, the generation
        prompt. Measured as the difference of two renderings of a stand-in conversation, so any template works as
        long as appending messages only appends text."""
        full = self.render(self.base + messages, add_generation_prompt=True)
        if not full.startswith(self.base_text):
            raise ValueError("the chat template renders a conversation differently once tool messages follow it; "
                             "multi-turn rollouts need a template that only appends (set "
                             "actor_rollout_ref.model.custom_chat_template)")
        closing = self.closing
        if eos_token is not None:
            eos_text = self.tokenizer.decode([eos_token], skip_special_tokens=False)
            closing = closing[len(eos_text):] if closing.startswith(eos_text) else closing
        return self.encode(closing + full[len(self.base_text):])

    # -- tools ----------------------------------------------------------------------------------------------
    async def open_tools(self, c):
        for name, tool in self.tools.items():
            try:
                c.instances[name] = await asyncio.wait_for(tool.create(**_kwargs(c, name, "create")), tool.timeout)
            except Exception as err:          # the tool answers every call with the error instead
                c.tool_errors += 1
                c.instances[name] = err

    async def call_tool(self, c, call):
        """The answer text of one call; every failure becomes an 'Error: ...' answer and is counted."""
        c.tool_calls += 1
        tool = self.tools.get(call.name)
        if call.error is None and tool is None:
            call.error = f"Error: unknown tool {call.name!r}; available tools: {', '.join(self.tools) or 'none'}"
        elif call.error is None and isinstance(c.instances.get(call.name), Exception):
            call.error = f"Error: tool {call.name!r} could not be created: {c.instances[call.name]!r}"
        if call.error is not None:
            c.tool_errors += 1
            return call.error
        try:
            result = await asyncio.wait_for(
                tool.execute(c.instances[call.name], call.arguments, **_kwargs(c, call.name, "execute")),
                tool.timeout)
            return str(result[0])
        except asyncio.TimeoutError:
            c.tool_errors += 1
            return f"Error: tool {call.name!r} did not answer within {tool.timeout:g} s"
        except Exception as err:
            c.tool_errors += 1
            return f"Error: tool {call.name!r} failed: {type(err).__name__}: {err}"

    async def close_tools(self, c):
        """calc_reward then release every instance (verl's order); failures count as errors, reward 0."""
        for name, instance in c.instances.items():
            if isinstance(instance, Exception):
                continue
            tool = self.tools[name]
            try:
                c.reward_scores[name] = float(await asyncio.wait_for(
                    tool.calc_reward(instance, **_kwargs(c, name, "calc_reward")), tool.timeout))
            except Exception:
                c.tool_errors += 1
                c.reward_scores[name] = 0.0
            try:
                await asyncio.wait_for(tool.release(instance, **_kwargs(c, name, "release")), tool.timeout)
            except Exception:
                c.tool_errors += 1

    # -- the interaction (interactions.py) -------------------------------------------------------------------
    async def start_interaction(self, c, seed):
        """Start the row's interaction under an id made of the call's seed and the row (the same on a rerun, so a
        seeded run stays reproducible whatever the interaction does with it; verl uses a random one)."""
        if not c.interaction_kwargs:
            return
        name = interaction_name(c.interaction_kwargs)
        if name not in self.interactions:       # the datasets' rows are checked at load (interactions.check_rows)
            raise ValueError(f"a row's extra_info.interaction_kwargs names interaction {name!r}; the interaction "
                             f"yaml has {', '.join(map(repr, self.interactions))}")
        interaction = self.interactions[name]
        try:
            c.interaction_id = await asyncio.wait_for(
                interaction.start_interaction(f"{seed}-{c.index}", **c.interaction_kwargs), interaction.timeout)
            c.interaction = interaction
        except Exception as err:          # the conversation runs without it (tool calls still work)
            self.interaction_failed(c, "start_interaction", err, "runs without it")

    async def interact(self, c):
        """The interaction's reply to the conversation so far, or None when it ends the conversation (verl
        v0.5.0's SGLang rollout: the closing reply is not appended, so the conversation ends on the model's turn).
        Its turn score is kept either way."""
        try:
            result = await asyncio.wait_for(c.interaction.generate_response(
                c.interaction_id, [dict(m) for m in c.messages], **c.interaction_kwargs), c.interaction.timeout)
            terminate, reply, score = _checked_response(result)
        except Exception as err:
            self.interaction_failed(c, "generate_response", err, "ends there")
            c.done = True
            return None
        if score is not None:
            c.user_turn_rewards.append(score)
        if terminate:
            c.done = True
            return None
        return reply

    async def finalize_interaction(self, c):
        if c.interaction is None:
            return
        try:
            await asyncio.wait_for(c.interaction.finalize_interaction(c.interaction_id), c.interaction.timeout)
        except Exception as err:
            self.interaction_failed(c, "finalize_interaction", err, "is kept as it is")

    def interaction_failed(self, c, method, err, consequence):
        c.interaction_errors += 1
        if not self.warned_interaction:
            self.warned_interaction = True
            what = "did not answer in time" if isinstance(err, asyncio.TimeoutError) else f"failed: {err!r}"
            warnings.warn(f"interaction {interaction_name(c.interaction_kwargs)!r}: {method} {what}; the "
                          f"conversation {consequence} (counted in multi_turn/interaction_errors; warned once)",
                          stacklevel=2)

    # -- tokenization check ---------------------------------------------------------------------------------
    def check_tokenization(self, c):
        """verl's tokenization_sanity_check_mode: the trained ids against a full re-templating of the messages
        (strict: token for token; ignore_strippable: the texts, whitespace ignored; disable). A mismatch (a
        sampled token sequence that re-tokenises differently, a template that rewrites earlier turns) is
        warned about once and counted; the sampled ids are trained either way."""
        mode = self.cfg.tokenization_sanity_check_mode
        prompt = self.render(c.messages[:c.prompt_messages], add_generation_prompt=True)
        if mode == "disable" or c.prompt_ids != self.encode(prompt):
            return                              # (a prompt cut by data.truncation cannot match)
        got = c.prompt_ids + c.response_ids
        expected = self.encode(self.render(c.messages))
        if mode == "strict":
            ok = expected[:len(got)] == got
        else:
            squash = lambda ids: "".join(self.tokenizer.decode(ids, skip_special_tokens=False).split())  # noqa: E731
            ok = squash(expected).startswith(squash(got))
        if not ok:
            c.tokenization_mismatch = True
            if not self.warned:
                self.warned = True
                warnings.warn("multi-turn tokenization: the trained token ids differ from a re-templating of the "
                              "conversation (counted in multi_turn/tokenization_mismatch); the sampled ids are "
                              "trained as they are", stacklevel=2)


def load_plugins(cfg):
    """(tools, interactions) of the run's multi-turn yamls: {name: tool}, {name: interaction}; {} for a yaml not
    set, both {} when multi-turn is off."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    on = multi_turn_on(cfg)
    return (load_tools(multi_turn.tool_config_path) if on and multi_turn.tool_config_path else {},
            load_interactions(multi_turn.interaction_config_path) if on and multi_turn.interaction_config_path
            else {})


def loop_for(cfg, tokenizer, engine, rank, tools, interactions):
    """The run's AgentLoop over `engine` (its TP size and EOS ids) on rank `rank` (of the engine's world), with
    the loaded tool and interaction yamls."""
    arr = cfg.actor_rollout_ref
    return AgentLoop(tokenizer, tools, arr.rollout.multi_turn, arr.rollout.response_length,
                     scheduling_mode(arr.rollout.mode, engine.tp_size, rank), engine.eos_ids,
                     arr.model.custom_chat_template, interactions)


def scheduling_mode(mode, tp_size, rank=0):
    """rollout.mode, except that vLLM tensor parallelism runs async as sync: the ranks of a TP group must send the
    same requests in the same order, which timing-driven scheduling cannot promise (the conversations are the same
    either way; only the overlap of tools and generation is lost)."""
    if mode == "async" and tp_size > 1:
        if rank == 0:
            warnings.warn(f"rollout.mode=async with tensor_model_parallel_size={tp_size}: conversations are scheduled "
                          f"turn-synchronously (same results, no overlap of tools and generation)", stacklevel=2)
        return "sync"
    return mode


def check_agent_names(rows, key):
    """Every row's agent_name (verl's column picking its agent loop) is one of AGENT_NAMES, before any model loads.
    rows: (where, row) pairs; key: the data file key, for the message."""
    for where, row in rows:
        name = row.get("agent_name")
        if name is not None and name not in AGENT_NAMES:
            raise ConfigError(f"{key} {where}: agent_name {name!r} is not an agent loop minirl runs; use "
                              f"{' or '.join(AGENT_NAMES)}, or leave the column out (the tool loop)")


TOOL_METHODS = ("create", "execute", "calc_reward", "release")       # verl's BaseTool: tools_kwargs[name][<m>_kwargs]


def check_tools_kwargs(rows, tools, key):
    """Every row's extra_info.tools_kwargs names tools of the tool yaml and verl's `<method>_kwargs` keys, before
    any model loads: a misspelt name would otherwise reach no tool, which then runs without its arguments.
    rows: (where, row) pairs; tools: {name: tool}; key: the data file key, for the message. Entries a parquet
    struct holds as None (keys other rows set) are absent. Without a tool yaml the rows' tools_kwargs are not
    used (verl's rollout reads them only when it has tools), so a tool row set runs without tools too."""
    if not tools:
        return
    methods = [f"{method}_kwargs" for method in TOOL_METHODS]
    for where, row in rows:
        for name, per_tool in _tools_kwargs(row.get("extra_info")).items():
            if per_tool is None:
                continue
            if name not in tools:
                raise ConfigError(f"{key} {where}: extra_info.tools_kwargs names tool {name!r}, which the tool "
                                  f"yaml (actor_rollout_ref.rollout.multi_turn.tool_config_path) does not define; "
                                  f"its tools: {sorted(tools)}")
            unknown = sorted(k for k, v in per_tool.items() if v is not None and k not in methods)
            if unknown:
                raise ConfigError(f"{key} {where}: extra_info.tools_kwargs[{name!r}] has {unknown}; verl's keys "
                                  f"are {', '.join(methods)}")


def missing_tools_kwargs_warning(rows, tools, key):
    """A warning (or None) for rows that say extra_info.need_tools_kwargs yet give no tools_kwargs: their tools
    are created without the row's arguments (a gsm8k tool without its ground truth), which verl's dataset warns
    about too. rows and key as check_tools_kwargs; without a tool yaml nothing is needed."""
    if not tools:
        return None
    lacking = [where for where, row in rows if (row.get("extra_info") or {}).get("need_tools_kwargs")
               and not any(per_tool for per_tool in _tools_kwargs(row.get("extra_info")).values())]
    if not lacking:
        return None
    return (f"{key} {lacking[0]}{f' and {len(lacking) - 1} more rows' if len(lacking) > 1 else ''}: "
            f"extra_info.need_tools_kwargs is true but tools_kwargs is empty, so the tools are created without the "
            f"row's arguments")


def _tools_kwargs(extra_info):
    return dict((extra_info or {}).get("tools_kwargs") or {})


def _kwargs(c, name, method):
    """tools_kwargs[name][<method>_kwargs], without the None entries a parquet struct adds for absent keys."""
    kwargs = (c.tools_kwargs.get(name) or {}).get(f"{method}_kwargs") or {}
    return {k: v for k, v in kwargs.items() if v is not None}


def _checked_response(result):
    """(should_terminate, reply, score) from generate_response's (should_terminate, reply, score, extra)."""
    if not (isinstance(result, (tuple, list)) and len(result) == 4 and isinstance(result[1], str)
            and (result[2] is None or isinstance(result[2], numbers.Real))):      # numpy's scalars too
        raise TypeError(f"generate_response must return (should_terminate, reply text, turn score, extra dict), "
                        f"got {result!r:.200}")
    return bool(result[0]), result[1], None if result[2] is None else float(result[2])


class Scheduler:
    """Async mode's engine feeder: conversations submit requests whenever they are ready; while the engine is
    busy (in a worker thread, so tools keep running) new requests queue, and the next engine call takes all of
    them."""

    def __init__(self, generate):
        self.generate_batch, self.pending, self.busy = generate, [], False

    async def generate(self, request):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((request, future))
        self._start()
        return await future

    def _start(self):
        if not self.busy and self.pending:
            self.busy = True
            asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        batch, self.pending = self.pending, []     # taken when the task runs: every request queued by then
        try:
            outputs = await asyncio.to_thread(self.generate_batch, [request for request, _ in batch])
            for (_, future), output in zip(batch, outputs):
                future.set_result(output)
        except Exception as err:
            for _, future in batch:
                future.set_exception(err)
        finally:
            self.busy = False
            self._start()


def engine_generate(engine, sampling, batched):
    """A blocking Request-list -> [(tokens, logprobs)] function over a rollout engine (rollout.py).
    batched=False (hf): one request per engine call with its own seed, so its tokens depend on nothing else.
    batched=True (vllm): one call for all, a seed per request, max_tokens the largest budget; each response is
    then cut to its own budget (a prefix of what was sampled). Requests with images pass them on."""
    def images(requests):
        if not any(r.multi_modal for r in requests):
            return {}
        return {"multi_modal": [r.multi_modal or {"images": [], "prompt_ids": r.ids, "inputs": {}} for r in requests]}

    def generate(requests):
        if batched:
            wanted = dataclasses.replace(sampling, max_tokens=max(r.max_tokens for r in requests))
            tokens, logprobs = engine.generate([r.ids for r in requests], wanted, [r.seed for r in requests],
                                               **images(requests))
        else:
            outputs = [engine.generate([r.ids], dataclasses.replace(sampling, max_tokens=r.max_tokens), r.seed,
                                       **images([r])) for r in requests]
            tokens = [out[0][0] for out in outputs]
            logprobs = [out[1][0] if out[1] is not None else None for out in outputs]
        if logprobs is None:
            logprobs = [None] * len(tokens)
        return [(list(t[:r.max_tokens]), None if lp is None else list(lp[:r.max_tokens]))
                for r, t, lp in zip(requests, tokens, logprobs)]
    return generate


# ----------------------------------------------------------------------------------------------------------------
# Conversations -> the rollout batch (the same layout as a single-turn rollout)


def conversations_to_batch(prompts, conversations, response_length, pad_id, extra_info):
    """prompts: the rows' input_ids/attention_mask/position_ids [b, P]. Returns responses [b, R], response_mask
    [b, R] (1 on model tokens only), attention_mask/position_ids/input_ids [b, P+R] (tool tokens attended),
    rollout_log_probs [b, R], and per-row lists: num_turns, tool_calls, tool_errors, tokenization_mismatch,
    interaction_errors, messages, and extra_info with num_turns and rollout_reward_scores added (what verl's
    reward manager passes to the reward function)."""
    b = len(conversations)
    responses = torch.full((b, response_length), pad_id, dtype=torch.long)              # [b, R]
    response_mask = torch.zeros((b, response_length), dtype=torch.long)                 # [b, R]
    attended = torch.zeros((b, response_length), dtype=torch.long)                      # [b, R]
    logprobs = torch.zeros((b, response_length), dtype=torch.float32)                   # [b, R]
    for i, c in enumerate(conversations):
        n = min(len(c.response_ids), response_length)
        responses[i, :n] = torch.tensor(c.response_ids[:n], dtype=torch.long)
        response_mask[i, :n] = torch.tensor(c.mask[:n], dtype=torch.long)
        attended[i, :n] = 1
        logprobs[i, :n] = torch.tensor(c.logprobs[:n], dtype=torch.float32)
    response_pos = prompts["position_ids"][:, -1:] + torch.arange(1, response_length + 1).unsqueeze(0)   # [b, R]
    return {
        "prompts": prompts["input_ids"], "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([prompts["attention_mask"], attended], dim=1),
        "position_ids": torch.cat([prompts["position_ids"], response_pos], dim=1),
        "rollout_log_probs": logprobs,
        "num_turns": [c.num_turns for c in conversations],
        "tool_calls": [c.tool_calls for c in conversations],
        "tool_errors": [c.tool_errors for c in conversations],
        "tokenization_mismatch": [c.tokenization_mismatch for c in conversations],
        "interaction_errors": [c.interaction_errors for c in conversations],
        "messages": [c.messages for c in conversations],
        # each tool's calc_reward, and for a row with an interaction its turn scores (verl v0.5.0's SGLang rollout)
        "extra_info": [{**(info or {}), "num_turns": c.num_turns, "rollout_reward_scores": {
                            **c.reward_scores, **({"user_turn_rewards": list(c.user_turn_rewards)}
                                                  if c.interaction_kwargs else {})}}
                       for info, c in zip(extra_info, conversations)],
    }


def gather_rows(local, world_size, tp_size):
    """Every rank's rows (tensors and python lists), one copy per TP group, in group order. A collective."""
    return {key: gather_tp_groups(value, world_size, tp_size) for key, value in local.items()}


def multi_turn_metrics(batch):
    """num_turns/{min,max,mean} (verl's names) and tool-call counts over the whole batch."""
    turns = np.asarray(batch["num_turns"], dtype=np.float64)
    calls, errors = sum(batch["tool_calls"]), sum(batch["tool_errors"])
    return {"num_turns/min": float(turns.min()), "num_turns/max": float(turns.max()),
            "num_turns/mean": float(turns.mean()), "tool_calls/total": float(calls),
            "tool_calls/per_conversation": calls / len(turns), "tool_calls/errors": float(errors),
            "multi_turn/tokenization_mismatch": float(np.mean(batch["tokenization_mismatch"])),
            "multi_turn/interaction_errors": float(sum(batch["interaction_errors"]))}
