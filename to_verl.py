"""`--to-verl`: verl's command line (`python3 -m verl.trainer.main_ppo key=value ...`) for a resolved minirl config,
so a user who outgrows one host runs the same experiment on verl with Ray. Keys verl lacks but reads go with
Hydra's `+`; minirl-only settings are left out and listed in a trailing comment. A run with DAPO's dynamic
sampling becomes `python3 -m recipe.dapo.main_dapo`, whose yaml declares the recipe's keys (verl_keys.DAPO_RECIPE).
The line loads back through minirl's own loader to the same config (tests/test_config.py,
tests/test_verl_config.py)."""
from __future__ import annotations

import json
import re
import shlex

import yaml

from config import RECIPE_BUFFER, ConfigError, dapo_reward_arguments, default_tree, float_or_same, multi_turn_on
from config_keys import ALL_KEYS, MINIRL_ONLY, get_dotted
from verl_keys import DAPO_RECIPE, VERL_DEFAULTS, VERL_UNDECLARED

_ABSENT = object()

VERL_REFUSES = {"trainer.device": ("auto", "cpu"), "trainer.n_gpus_per_node": (None,)}   # minirl's values only


def _hydra_value(value):
    """`value` as Hydra (and minirl's yaml reading) parse it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text   # yaml 1.1 needs the dot
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_hydra_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_hydra_value(item)}" for key, item in value.items()) + "}"
    plain = (re.fullmatch(r"[A-Za-z0-9_./~+-]+", value) and yaml.safe_load(value) == value
             and float_or_same(value) == value)
    return value if plain else json.dumps(value)


def _dapo_reward_args(cfg, recipe):
    """DAPORewardManager's arguments (config.dapo_reward_arguments) where the entry point reads them: verl's
    main_ppo from +reward_model.reward_kwargs, DAPO's main_dapo from reward_model.overlong_buffer, with the
    response length as max_resp_len."""
    arguments, _ = dapo_reward_arguments(cfg)
    if not recipe:
        return [f"+reward_model.reward_kwargs={_hydra_value(arguments)}"]
    if arguments["max_resp_len"] != cfg.data.max_response_length:
        raise ConfigError(f"--to-verl: DAPO's recipe (main_dapo) measures overlong responses against "
                          f"data.max_response_length={cfg.data.max_response_length}, but "
                          f"reward_model.reward_kwargs.max_resp_len={arguments['max_resp_len']}; make them equal")
    return [f"{RECIPE_BUFFER}.{key}={_hydra_value(value)}" for key, value in arguments["overlong_buffer_cfg"].items()
            if value != DAPO_RECIPE[f"{RECIPE_BUFFER}.{key}"]]


def to_verl(cfg, world_size=None):
    """verl's command line for the resolved config (the seed's backend_config flattened): every verl key whose value
    differs from verl's default or minirl's, so that the line loads in both to this config; then a comment listing
    the minirl-only settings it leaves out, in the same key=value form. `world_size` (--world-size) fills
    trainer.n_gpus_per_node when it is null (torchrun decides in minirl; verl needs the number)."""
    defaults = default_tree()
    args, left_out = [], []
    dapo = cfg.algorithm.filter_groups.enable
    for dotted in ALL_KEYS:
        value, verl_default = get_dotted(cfg, dotted), get_dotted(VERL_DEFAULTS, dotted, None)
        if dotted == "trainer.n_gpus_per_node" and value is None and world_size:
            value = world_size
        if dotted == "reward_model.reward_kwargs" or dotted.startswith(RECIPE_BUFFER):
            continue                         # DAPO's reward arguments: below, where the entry point reads them
        if dotted in DAPO_RECIPE:            # main_ppo has none of them: without dynamic sampling they do nothing
            if value != DAPO_RECIPE[dotted]:
                (args if dapo else left_out).append(f"{dotted}={_hydra_value(value)}")
        elif dotted in VERL_UNDECLARED:
            if value != VERL_UNDECLARED[dotted] or value != get_dotted(defaults, dotted):
                args.append(f"+{dotted}={_hydra_value(value)}")
        elif dotted in MINIRL_ONLY or value in VERL_REFUSES.get(dotted, ()):
            if value != get_dotted(defaults, dotted):     # loading the line in minirl gives the default back
                left_out.append(f"{dotted}={_hydra_value(value)}")
        elif value == verl_default and value == get_dotted(defaults, dotted):
            continue
        elif isinstance(value, dict):     # free-form: one entry each; '+' adds a key verl's tree lacks
            verl_default, ours = verl_default or {}, get_dotted(defaults, dotted)
            args += [f"{'' if key in verl_default else '+'}{dotted}.{key}={_hydra_value(item)}"
                     for key, item in value.items()
                     if verl_default.get(key, _ABSENT) != item or ours.get(key, _ABSENT) != item]
        else:
            args.append(f"{dotted}={_hydra_value(value)}")
    if cfg.reward_model.reward_manager == "dapo":
        args += _dapo_reward_args(cfg, recipe=dapo)
    elif cfg.reward_model.reward_kwargs:        # batch: the reward function's own keyword arguments
        args.append(f"+reward_model.reward_kwargs={_hydra_value(cfg.reward_model.reward_kwargs)}")
    lines = [f"python3 -m {'recipe.dapo.main_dapo' if dapo else 'verl.trainer.main_ppo'}"]
    lines += [shlex.quote(arg) for arg in args]
    notes = ""
    if cfg.actor_rollout_ref.rollout.multi_turn.interaction_config_path and multi_turn_on(cfg):
        notes = ("\n# verl v0.5.0 runs interactions in its SGLang rollout only "
                 "(actor_rollout_ref.rollout.name=sglang); from verl PR 2896 (after v0.5.0) its agent loop runs "
                 "them with vLLM too")
    return (" \\\n    ".join(lines) + notes + "\n# minirl-only settings (not verl keys, or values verl does not "
            "take), left out: " + (" ".join(shlex.quote(item) for item in left_out) or "none") + "\n")
