"""Interactions for multi-turn rollouts: a user simulator that reads the model's answer and replies (verl's
verl/interactions/base.py::BaseInteraction, run as verl v0.5.0's SGLang rollout runs it), its yaml and the built-in
gsm8k interaction.

An interaction yaml (actor_rollout_ref.rollout.multi_turn.interaction_config_path) is verl's:

    interaction:
      - name: gsm8k                                                    # optional: from the class name otherwise
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction   # maps to interactions.Gsm8kInteraction
        config: {}                                        # passed to the class, with `name` added; `timeout` (s)
                                                          # bounds each call (default 30)

A row takes part when its extra_info.interaction_kwargs is set: `name` picks the interaction ("gsm8k" when absent,
as in verl v0.5.0), and all of interaction_kwargs goes to start_interaction and generate_response as keywords.
The class has verl's async interface: `cls(config)`, `start_interaction(instance_id, **kwargs) -> instance_id`,
`generate_response(instance_id, messages, **kwargs) -> (should_terminate, reply_text, turn_score, extra)`,
`finalize_interaction(instance_id, **kwargs)`. What the agent loop does with them is in agent.py.

Left out: verl's `calculate_score` is not called (verl's rollouts do not call it either); the turn scores reach
the reward function as extra_info.rollout_reward_scores["user_turn_rewards"].
"""
from __future__ import annotations

import uuid

from config import ConfigError
from rewards import gsm8k_compute_score
from tools import DEFAULT_TIMEOUT_S, entry_config, import_class, read_entries, require_async_methods

DEFAULT_NAME = "gsm8k"          # the interaction a row's interaction_kwargs without `name` gets (verl v0.5.0)
KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"

# verl's own class names -> minirl's built-ins, so verl's example yamls work unchanged
VERL_INTERACTION_ALIASES = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "interactions.Gsm8kInteraction"}


class BaseInteraction:
    """verl's interaction interface: subclass it (or write a class with the same async methods) and name it in
    the yaml. `config` is the yaml entry's config mapping with `name` set."""

    timeout = DEFAULT_TIMEOUT_S      # seconds each call may take; the yaml's config.timeout sets it

    def __init__(self, config):
        self.config = config
        self.name = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id or str(uuid.uuid4())

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "Your current result seems acceptable.", 0.0, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        pass


class Gsm8kInteraction(BaseInteraction):
    """verl's verl.interactions.gsm8k_interaction.Gsm8kInteraction: grades the model's latest answer against the
    row's ground truth (interaction_kwargs.ground_truth) with gsm8k's flexible extraction; a right answer ends the
    conversation, a wrong one asks the model to think again. The turn score is the grade (1.0 or 0.0)."""

    CORRECT = "Your response is correct!"
    INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config):
        super().__init__(config)
        self.instances = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or str(uuid.uuid4())
        self.instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        state = self.instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        score = gsm8k_compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                                    score=1.0)
        correct = score == 1.0
        return correct, self.CORRECT if correct else self.INCORRECT, score, {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.instances.pop(instance_id, None)


# ----------------------------------------------------------------------------------------------------------------
# The yaml, and which rows use which interaction


def load_interactions(path):
    """{name: interaction instance} from a verl interaction yaml. Every problem (missing file, bad yaml, missing
    or unimportable class, a class without the async interface, a duplicate name) is a ConfigError naming the
    file and the entry, raised before any model loads."""
    where, entries = read_entries(KEY, path, "interaction", "{name, class_name, config}")
    interactions = {}
    for i, entry in enumerate(entries):
        name, interaction = _build_interaction(entry, f"{where}, interaction[{i}]")
        if name in interactions:
            raise ConfigError(f"{where}, interaction[{i}]: a second interaction named {name!r}; names must be unique")
        interactions[name] = interaction
    return interactions


def _build_interaction(entry, where):
    config, timeout = entry_config(entry, where, "interactions.Gsm8kInteraction")
    class_name = entry["class_name"]
    name = entry.get("name")
    if name is None:                  # verl's rule: the class name without 'Interaction', lower-cased
        simple = class_name.rpartition(".")[2]
        name = (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    cls = import_class(class_name, where, VERL_INTERACTION_ALIASES, kind="interactions",
                       base="interactions.BaseInteraction")
    require_async_methods(cls, ("start_interaction", "generate_response", "finalize_interaction"), where,
                          class_name, "interactions", "interactions.BaseInteraction")
    try:
        interaction = cls(config={**config, "name": name})
    except Exception as err:
        raise ConfigError(f"{where}: {class_name}(config) failed: {err!r}") from err
    interaction.timeout = timeout
    return name, interaction


def interaction_kwargs(extra_info):
    """The row's interaction_kwargs without the None entries a parquet struct adds for absent keys ({} when the
    row has none: it takes no part)."""
    kwargs = (extra_info or {}).get("interaction_kwargs") or {}
    return {k: v for k, v in kwargs.items() if v is not None}


def interaction_name(kwargs):
    return kwargs.get("name", DEFAULT_NAME)


def check_rows(interactions, rows, key):
    """Every row that asks for an interaction names one of the yaml's; before any model loads. rows: (where, row)
    pairs; key: the data file key, for the message."""
    for where, row in rows:
        raw = (row.get("extra_info") or {}).get("interaction_kwargs")
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{key} {where}: extra_info.interaction_kwargs must be a mapping (name, and what the "
                              f"interaction reads, e.g. ground_truth), got {type(raw).__name__}")
        kwargs = interaction_kwargs(row.get("extra_info"))
        if not isinstance(interaction_name(kwargs), str):
            raise ConfigError(f"{key} {where}: extra_info.interaction_kwargs.name must be a string, got "
                              f"{interaction_name(kwargs)!r}")
        if kwargs and interaction_name(kwargs) not in interactions:
            named = (f"names interaction {interaction_name(kwargs)!r}" if "name" in kwargs else
                     f"has interaction_kwargs without a name, which means {DEFAULT_NAME!r} (verl's default)")
            raise ConfigError(f"{key} {where}: extra_info.interaction_kwargs {named}, but {KEY} has only "
                              f"{', '.join(map(repr, interactions))}; add it to the yaml or fix the row")
