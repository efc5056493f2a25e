"""minirl's configuration: loading (safe yaml reading, the two shapes, overrides), deriving verl's inherited values,
and every check that can run before a model is loaded (`--to-verl` is to_verl.py). The key table (defaults, types, valid ranges,
choices, refusals) is config_keys.py, verl's own tree verl_keys.py, the batch arithmetic batch_plan.py.

Two yaml shapes load:
  * the seed's shape:  af_output_dir + backend_config.{data, actor_rollout_ref, critic, reward_model, algorithm,
                       trainer, rollout} (+ engine_kwargs.vllm.* at the top level)
  * verl's shape:      data, actor_rollout_ref, ... at the top level (af_output_dir optional); every key of verl
                       v0.5.0's trainer config loads (verl_keys.py holds that tree and what minirl does with each key)
Merge order: DEFAULTS, then the yaml, then CLI overrides in verl's (Hydra's) forms: `a.b.c=value`, `+a.b.c=value`,
`a.b=[x,y]`, with or without `backend_config.`.

    cfg = load_config("config.yaml", ["data.train_batch_size=64"], world_size=2)
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size   # attribute access, verl's names

Every error names the key (or file, or override) and the fix, and is raised as ConfigError before any model
loads: malformed yaml, unknown keys, wrong types, values out of range, batch sizes that do not divide. The valid
choices of algorithm keys come from losses.py (and truncation from data.py), so the two never disagree.
verl's `${...}` interpolations are resolved once all is merged (interpolation.py). Hydra's defaults list and
--config-path/--config-name (verl's example yamls) compose plain names (config_layers). Left out: config groups,
`~key`.
"""
from __future__ import annotations

import copy
import difflib
import math
import os
import re
from pathlib import Path

import yaml

import vision
from batch_plan import FSDP_SIZE_KEY, check_batch, check_split_keys
from config_keys import (ALL_KEYS, CHOICES, DEFAULTS, LOGGERS, MAX_CONFIG_BYTES, MAX_DEPTH, MAX_OVERRIDE_CHARS,
                         MAX_VALUES, NOT_YET, SCHEMA, SEED_SECTIONS, ConfigError, Key, get_dotted, leaves,
                         set_dotted)
from interpolation import resolve_interpolations
from verl_keys import DAPO_RECIPE, NO_EFFECT, VERL_DEFAULTS

__all__ = ["DEFAULTS", "ConfigError", "Config", "get_dotted", "load_config", "settings_without_effect",
           "planning_world_size", "float_or_same"]     # DEFAULTS, ConfigError and get_dotted are config_keys', re-exported


class Config(dict):
    """A dict with attribute access (cfg.data.train_batch_size), nested."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value

    @staticmethod
    def wrap(tree):
        if isinstance(tree, dict):
            return Config({k: Config.wrap(v) for k, v in tree.items()})
        if isinstance(tree, list):
            return [Config.wrap(v) for v in tree]
        return tree

    def to_dict(self):
        return yaml.safe_load(yaml.safe_dump(_plain(self)))


def _plain(tree):
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    return tree


def default_tree():
    """A fresh tree of every key's default value (minirl's table, verl's keys included)."""
    def fresh(node):
        return {k: fresh(v) if isinstance(v, dict) else copy.deepcopy(v.default) for k, v in node.items()}
    return fresh(SCHEMA)


_UNKNOWN = object()


def _schema_at(path):
    """The schema node at `path`: a dict, a Key, free() for anything inside a free-form mapping, or _UNKNOWN."""
    node = SCHEMA
    for part in path:
        if isinstance(node, Key) and node.kinds is dict:
            return node
        if part == "_target_":          # the dataclass verl builds from a section: accepted anywhere
            return Key(None)
        if not isinstance(node, dict) or part not in node:
            return _UNKNOWN
        node = node[part]
    return node


# keys of older verl versions that verl v0.5.0 replaced: the replacement, for the unknown-key hint
RENAMED_KEYS = {"use_token_level_loss": "it became 'actor_rollout_ref.actor.loss_agg_mode' (token-mean for true, "
                                        "seq-mean-token-mean for false)"}


def _unknown_key_hint(path):
    """Where an unknown key probably belongs: the same name, of a key or a section, elsewhere first (e.g.
    'ppo_epochs' under 'data', 'custom_chat_template' under 'data' for the model's, 'overlong_buffer' under
    'custom_reward_function' for the reward model's section), else a close spelling among its siblings, else
    a close dotted key anywhere."""
    parent, key = path[:-1], path[-1]
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key]
    same = list(dict.fromkeys(k[:k.index(f".{key}.") + len(key) + 1] if f".{key}." in k else k
                              for k in ALL_KEYS if k.endswith("." + key) or f".{key}." in k))   # a key or a section
    if same:
        return "did you mean " + " or ".join(f"'{k}'" for k in same[:3]) + "?"
    siblings = list(_schema_at(parent).keys()) if isinstance(_schema_at(parent), dict) else []
    guess = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if guess:
        return f"did you mean '{'.'.join(parent + [guess[0]])}'?"
    close = difflib.get_close_matches(".".join(path), ALL_KEYS, n=1, cutoff=0.7)
    return (f"did you mean '{close[0]}'?" if close else
            "not a key of verl v0.5.0's trainer config, whose keys minirl reads (a newer verl's key, or a recipe's "
            "own); see config.yaml for the valid keys.")


def _unknown_keys_error(paths, source):
    """One error naming every unknown key of a yaml file or override, each with its hint."""
    if len(paths) == 1:
        return ConfigError(f"unknown config key '{'.'.join(paths[0])}' (from {source}): {_unknown_key_hint(paths[0])}")
    lines = [f"  '{'.'.join(path)}': {_unknown_key_hint(path)}" for path in paths]
    return ConfigError(f"{len(paths)} unknown config keys (from {source}):\n" + "\n".join(lines))


def _merge_layer(tree, layer, source):
    """Merge one yaml file into the tree, refusing (all at once) the keys the schema does not know."""
    unknown = []
    _merge(tree, layer, [], source, unknown)
    if unknown:
        raise _unknown_keys_error(unknown, source)


def _merge(base, update, path, source, unknown):
    """Merge `update` into `base` in place; the paths of keys the schema does not know go to `unknown`."""
    for key, value in update.items():
        here = path + [key]
        schema = _schema_at(here)
        if schema is _UNKNOWN:
            unknown.append(here)
            continue
        if isinstance(schema, Key) and schema.kinds is dict and isinstance(value, dict):
            if not isinstance(base.get(key), dict):
                base[key] = {}
            _deep_update(base[key], value)
        elif isinstance(schema, dict):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{'.'.join(here)}' (from {source}) must be a mapping of keys, "
                                  f"got {_show(value)}")
            _merge(base[key], value, here, source, unknown)
        else:
            base[key] = value


def _deep_update(base, update):
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v


def _normalise_shape(raw, source):
    """Return the verl-shaped tree of a seed-shaped or verl-shaped yaml mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    raw = dict(raw)
    tree = {}
    backend = raw.pop("backend_config", None)
    if backend is not None:
        if not isinstance(backend, dict):
            raise ConfigError(f"{source}: 'backend_config' must be a mapping of verl's sections, got {_show(backend)}")
        tree.update(backend)
    for key in list(raw):
        if key in ("af_output_dir",) or key in SEED_SECTIONS:
            if key in tree and isinstance(tree[key], dict) and isinstance(raw[key], dict):
                _deep_update(tree[key], raw.pop(key))
            else:
                tree[key] = raw.pop(key)
    engine_kwargs = raw.pop("engine_kwargs", None)
    if engine_kwargs is not None:
        # the seed's position for verl's actor_rollout_ref.rollout.engine_kwargs
        if not isinstance(engine_kwargs, dict):
            raise ConfigError(f"{source}: 'engine_kwargs' must be a mapping like {{vllm: {{...}}}}")
        section = tree.setdefault("actor_rollout_ref", {})
        rollout = section.setdefault("rollout", {}) if isinstance(section, dict) else None
        if not isinstance(rollout, dict):
            raise ConfigError(f"{source}: 'actor_rollout_ref.rollout' must be a mapping of keys")
        _deep_update(rollout.setdefault("engine_kwargs", {}), engine_kwargs)
    if raw:
        raise _unknown_keys_error([[key] for key in raw], source)
    return tree


# ----------------------------------------------------------------------------------------------------------------
# Reading yaml safely: bounded size, depth and expanded size; no tags; string keys

def _cut(text, limit=200):
    return text if len(text) <= limit else text[:limit] + "..."


def _show(value, limit=60):
    return _cut(repr(value), limit)


_NEST_OPEN = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
              yaml.FlowSequenceStartToken)
_NEST_CLOSE = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key written twice in one mapping: yaml would keep the last one silently
    (a second `data:` section would replace the first whole); OmegaConf, which verl reads its yamls with, refuses
    it too."""

    source = "the yaml"

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, (list, dict)):       # `? [a, b]: 1`, or `{{ x }}` in an unquoted value
                raise ConfigError(f"{self.source}: line {line} has a mapping whose key is a "
                                  f"{type(key).__name__}; config keys are names. A value holding braces, such "
                                  f"as a Jinja chat template, must be quoted")
            if isinstance(key, str) and key in lines:
                raise ConfigError(f"{self.source}: key '{key}' is written twice in one mapping (lines {lines[key]} "
                                  f"and {line}); keep one (yaml would silently take the last)")
            lines[key] = line
        return super().construct_mapping(node, deep)


def parse_yaml(text, source):
    """yaml.safe_load(text), refusing duplicate keys, after a token scan (iterative, so it cannot recurse) that
    refuses nesting deeper than MAX_DEPTH and tags; then a bounded copy that refuses alias bombs, self-references
    and non-string keys."""
    depth = 0
    try:
        for token in yaml.scan(text):
            if isinstance(token, _NEST_OPEN):
                depth += 1
                if depth > MAX_DEPTH:
                    raise ConfigError(f"{source}: nested deeper than {MAX_DEPTH} levels; a config is a shallow tree")
            elif isinstance(token, _NEST_CLOSE):
                depth -= 1
            elif isinstance(token, yaml.TagToken):
                raise ConfigError(f"{source}: yaml tags ({''.join(filter(None, token.value))}) are not accepted; "
                                  f"write a plain value (quote it to keep it a string)")
        loader = _UniqueKeyLoader(text)
        loader.source = source
        try:
            tree = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        fix = ("indent with spaces (yaml does not allow tabs)" if "'\\t'" in problem
               else "quote values that hold yaml's special characters")
        raise ConfigError(f"{source} is not valid yaml: {problem}{where}; {fix}") from None
    return _plain_tree(tree, source, [], [MAX_VALUES], set())


def _plain_tree(tree, source, path, budget, ancestors):
    """A copy of the loaded tree with aliases expanded, bounded in size and depth, every key a string."""
    budget[0] -= 1
    where = f" at '{'.'.join(map(str, path))}'" if path else ""
    if budget[0] < 0:
        raise ConfigError(f"{source}: more than {MAX_VALUES} values once its aliases are expanded (an alias bomb?)")
    if len(path) > MAX_DEPTH:
        raise ConfigError(f"{source}: nested deeper than {MAX_DEPTH} levels{where}; a config is a shallow tree")
    if not isinstance(tree, (dict, list)):
        return tree
    if id(tree) in ancestors:
        raise ConfigError(f"{source}: a value contains itself (an alias to its own anchor){where}")
    ancestors.add(id(tree))
    if isinstance(tree, list):
        plain = [_plain_tree(item, source, path + [i], budget, ancestors) for i, item in enumerate(tree)]
    else:
        for key in tree:
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {_show(key)} ({type(key).__name__}){where} is not a name; "
                                  f"keys are verl's names (quote it if it is one)")
        plain = {key: _plain_tree(value, source, path + [key], budget, ancestors) for key, value in tree.items()}
    ancestors.discard(id(tree))
    return plain


def read_config_file(path):
    """The yaml mapping in the file at `path`; every way the file can be wrong is a ConfigError naming it."""
    source = f"config file '{_cut(str(path))}'"
    try:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{source} does not exist or is not a regular file (pass --config PATH)")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source} is {path.stat().st_size} bytes; a config is at most {MAX_CONFIG_BYTES}")
        data = path.read_bytes()[:MAX_CONFIG_BYTES + 1]
    except OSError as err:
        raise ConfigError(f"{source} cannot be read: {err.strerror or err}") from None
    if b"\0" in data:
        raise ConfigError(f"{source} is not a text file (binary, or UTF-16); save it as UTF-8 yaml")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source} is not UTF-8 text (bad byte at offset {err.start}); save it as UTF-8") from None
    raw = parse_yaml(text, source)
    if raw is None:          # verl's defaults alone would train GAE without a critic, the error naming neither
        raise ConfigError(f"{source} holds no keys (it is empty, or comments only); write the config into it, or "
                          f"leave --config out to start from verl's defaults")
    return raw


def parse_override(text):
    """One command-line override in verl's (Hydra's) forms -> (key parts, value):
    'data.train_batch_size=64', '+trainer.seed=3' (Hydra's add), 'backend_config.data.train_files=[a,b]'."""
    source = f"override '{_cut(text, 80)}'"
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ConfigError(f"{source} is {len(text)} characters long; the most is {MAX_OVERRIDE_CHARS}")
    if text.strip().startswith("~"):
        raise ConfigError(f"{source}: deleting a key (~key) is not supported; set it to its default instead")
    if "=" not in text:
        hint = f"; a config file goes after --config (--config {text})" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"{source} must look like key.path=value (e.g. data.train_batch_size=64){hint}")
    key, value = text.split("=", 1)
    key = key.strip()
    key = key.lstrip("+")
    parts = key.split(".")
    if parts[0] == "backend_config":
        parts = parts[1:]
    if parts and parts[0] == "engine_kwargs":
        parts = ["actor_rollout_ref", "rollout"] + parts
    if not all(re.fullmatch(r"[A-Za-z0-9_\-]+", part) for part in parts) or (not parts and key != "backend_config"):
        raise ConfigError(f"{source} has a malformed key '{_cut(key, 80)}'; keys look like data.train_batch_size")
    return parts, parse_yaml(value, source) if value.strip() else None


def _nest(parts, value):
    tree = value
    for part in reversed(parts):
        tree = {part: tree}
    return tree


# ----------------------------------------------------------------------------------------------------------------
# Hydra's defaults list: verl's example yamls (examples/sglang_multiturn/config/*.yaml) open with
#     hydra: {searchpath: [file://verl/trainer/config]}
#     defaults: [ppo_trainer, _self_]
# and are run as `--config-path DIR --config-name NAME`. minirl composes plain names from the defaults list; config
# groups (`group: option`, `group/name`, `name@package`) are refused by name.

VERL_BASE_CONFIG = "ppo_trainer"      # verl's trainer config: its values are minirl's defaults (verl_keys.py)


def config_layers(path, _open=()):
    """[(verl-shaped tree, source)] that the yaml at `path` contributes, in merge order: the entries of its Hydra
    defaults list, each composed the same way, with the file's own keys where `_self_` stands (last when the list
    does not name it, as Hydra 1.1+ does). A name is `<name>.yaml` beside the file or in a `file://` folder of its
    `hydra.searchpath`; `ppo_trainer` is verl's trainer config, i.e. minirl's defaults. The rest of `hydra:`
    (Hydra's own run settings) has no effect here."""
    source = f"config file '{_cut(str(path))}'"
    raw = read_config_file(path)
    if not isinstance(raw, dict) or ("defaults" not in raw and "hydra" not in raw):
        return [(_normalise_shape(raw, source), str(path))]
    raw = dict(raw)
    hydra, entries = raw.pop("hydra", None) or {}, raw.pop("defaults", None) or []
    if not isinstance(hydra, dict):
        raise ConfigError(f"{source}: 'hydra' must be a mapping (Hydra's settings), got {_show(hydra)}")
    if not isinstance(entries, list):
        raise ConfigError(f"{source}: 'defaults' must be a list (Hydra's defaults list), got {_show(entries)}")
    if entries.count("_self_") > 1:
        raise ConfigError(f"{source}: '_self_' appears {entries.count('_self_')} times in its defaults list; once")
    if "_self_" not in entries:
        entries = entries + ["_self_"]
    folders = [Path(path).parent] + _search_folders(hydra.get("searchpath"), source)
    layers = []
    for entry in entries:
        if entry == "_self_":
            layers.append((_normalise_shape(raw, source), str(path)))
        elif entry in (VERL_BASE_CONFIG, VERL_BASE_CONFIG + ".yaml"):
            layers.append((default_tree(), f"{source}'s defaults entry '{entry}' (verl's trainer config)"))
        else:
            inside = _open + (path,)
            layers.extend(config_layers(_defaults_entry_file(entry, folders, source, inside), inside))
    return layers


def _search_folders(searchpath, source):
    """The `file://` folders of Hydra's searchpath (relative ones from the current folder); `pkg://` modules are
    Python packages minirl does not import, and are skipped."""
    if searchpath is None:
        return []
    if not isinstance(searchpath, list) or not all(isinstance(p, str) for p in searchpath):
        raise ConfigError(f"{source}: 'hydra.searchpath' must be a list of strings like file://DIR, "
                          f"got {_show(searchpath)}")
    return [Path(p[len("file://"):]) for p in searchpath if p.startswith("file://")]


def _is_config_group(entry):
    """A Hydra defaults entry that selects from a config group (`group: option`, `group/name`, `name@package`,
    `override ...`), which minirl does not compose."""
    return isinstance(entry, dict) or (isinstance(entry, str) and bool(re.search(r"[/@:]|^(override|optional) ",
                                                                                  entry)))


def _defaults_entry_file(entry, folders, source, open_files):
    """The yaml file a plain defaults entry names; anything else is a ConfigError that says what minirl takes."""
    where = f"{source}: defaults entry {_show(entry)}"
    if _is_config_group(entry):
        raise ConfigError(f"{where} is a Hydra config group, which minirl does not compose; copy that file's keys "
                          f"into this one under their place in verl's tree (plain names and '_self_' work)")
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(f"{where} is not a config name; an entry is a name (a yaml file without .yaml) or _self_")
    name = entry if entry.endswith(".yaml") else entry + ".yaml"
    for folder in folders:
        candidate = folder / name
        try:
            found = candidate.is_file()
        except OSError as err:                  # e.g. a name longer than the file system allows
            raise ConfigError(f"{where}: {_cut(str(candidate))} cannot be used: {err.strerror or err}") from None
        if found:
            if any(candidate.resolve() == Path(p).resolve() for p in open_files):
                raise ConfigError(f"{where} includes a file that includes it (a cycle through {candidate})")
            return candidate
    raise ConfigError(f"{where}: no {_show(name)} in {', '.join(str(f) for f in folders)}; a name is a yaml "
                      f"beside the file or in a file:// folder of hydra.searchpath ('{VERL_BASE_CONFIG}' is minirl's "
                      f"defaults)")


def config_file_path(config=None, config_path=None, config_name=None):
    """The config file from minirl's --config or from Hydra's --config-path DIR --config-name NAME (verl's run
    scripts; NAME with or without .yaml, DIR relative to the current folder); None for minirl's defaults. The name
    `ppo_trainer` is verl's trainer config, whose values minirl's defaults are: verl's scripts pass it with
    --config-path config (verl's package folder) or a verl checkout's verl/trainer/config, where the file composes
    Hydra config groups. A DIR/ppo_trainer.yaml that composes none is a user's own flat copy, and is read."""
    if config_name is None:
        if config_path is not None:
            raise ConfigError(f"--config-path {config_path} needs --config-name NAME (the file DIR/NAME.yaml)")
        return config
    if config is not None:
        raise ConfigError(f"--config {config} and --config-name {config_name} name two files; pass one")
    name = config_name if config_name.endswith(".yaml") else config_name + ".yaml"
    path = Path(config_path or ".") / name
    if name == VERL_BASE_CONFIG + ".yaml" and (config_path is None or not _is_flat_config_file(path)):
        return None
    return str(path)


def _is_flat_config_file(path):
    """A file whose defaults list (if any) names no Hydra config group; one that cannot be read counts as flat, so
    that loading it reports why."""
    try:
        if not path.is_file():
            return False
        raw = read_config_file(path)
    except (OSError, ConfigError):
        return True
    entries = raw.get("defaults") if isinstance(raw, dict) else None
    return not (isinstance(entries, list) and any(_is_config_group(entry) for entry in entries))


def load_config(path=None, overrides=(), world_size=None, check_paths=True):
    """Defaults <- yaml at `path` (and what its defaults list names) <- overrides; then derive, validate and
    return a Config."""
    tree = default_tree()
    for layer, source in config_layers(path) if path is not None else []:
        _merge_layer(tree, layer, source)
    unknown = []                 # every override's unknown keys in one error: an old script has several
    for text in overrides:
        parts, value = parse_override(text)
        source = f"override '{_cut(text, 80)}'"
        if not parts and not isinstance(value, dict):
            raise ConfigError(f"{source}: 'backend_config' must be a mapping of verl's sections, got {_show(value)}")
        found = []
        _merge(tree, _nest(parts, value), [], source, found)
        unknown += [(path, source) for path in found]
    if len(unknown) == 1:
        raise _unknown_keys_error([unknown[0][0]], unknown[0][1])
    if unknown:
        raise _unknown_keys_error([path for path, _ in unknown], f"{len(overrides)} command-line overrides")
    resolve_interpolations(tree, f"config file '{path}' or an override" if path is not None else "the overrides")
    cfg = Config.wrap(tree)
    check_types(cfg)
    check_ranges(cfg)
    expand_home(cfg)
    derive(cfg)
    validate(cfg, world_size=world_size or int(os.environ.get("WORLD_SIZE", "0")) or None, check_paths=check_paths)
    return cfg


# The keys that name a local file or folder. A leading ~ in them is the user's home, as in a shell and in verl's
# own defaults (data.train_files: ~/data/rlhf/gsm8k/train.parquet), expanded once here so that every reader (the
# checks, the dataset, from_pretrained, the checkpoint folders) sees the same path; `key=~/x` on a command line
# reaches minirl unexpanded, since the shell expands ~ only at the start of a word.
LOCAL_PATH_KEYS = ("af_output_dir", "data.tokenizer", "data.train_files", "data.val_files",
                   "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                   "actor_rollout_ref.rollout.multi_turn.interaction_config_path", "critic.model.path",
                   "critic.model.tokenizer_path", "reward_model.model.path", "reward_model.model.input_tokenizer",
                   "custom_reward_function.path", "trainer.rollout_data_dir", "trainer.validation_data_dir",
                   "trainer.resume_from_path", "trainer.default_local_dir", "trainer.hdfs_cache_dir")


def expand_home(cfg):
    """Replace a leading ~ (or ~user) in each LOCAL_PATH_KEYS value, a path or a list of them, with that home."""
    def expanded(path):
        return os.path.expanduser(path) if path.startswith("~") else path

    for dotted in LOCAL_PATH_KEYS:
        parent, _, leaf = dotted.rpartition(".")
        section = get_dotted(cfg, parent) if parent else cfg
        value = section[leaf]
        if isinstance(value, str):
            section[leaf] = expanded(value)
        elif isinstance(value, list):
            section[leaf] = [expanded(item) for item in value]


# ----------------------------------------------------------------------------------------------------------------
# Derived values (what verl's `${...}` defaults compute, for the keys minirl's table leaves null)

def derive(cfg):
    data, arr, critic = cfg.data, cfg.actor_rollout_ref, cfg.critic
    actor, ref, rollout = arr.actor, arr.ref, arr.rollout
    if cfg.trainer.default_local_dir is None:
        cfg.trainer.default_local_dir = str(Path(cfg.af_output_dir) / "checkpoints")
    rollout.prompt_length = rollout.prompt_length or data.max_prompt_length
    rollout.response_length = rollout.response_length or data.max_response_length
    actor.clip_ratio_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    actor.clip_ratio_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    for worker in (ref, rollout):
        if worker.log_prob_use_dynamic_bsz is None:
            worker.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if worker.log_prob_max_token_len_per_gpu is None:
            worker.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    if ref.use_torch_compile is None:
        ref.use_torch_compile = actor.use_torch_compile
    if ref.ulysses_sequence_parallel_size is None:
        ref.ulysses_sequence_parallel_size = actor.ulysses_sequence_parallel_size
    critic.rollout_n = critic.rollout_n or rollout.n
    critic.ppo_mini_batch_size = critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
    critic.ppo_epochs = critic.ppo_epochs or actor.ppo_epochs
    critic.shuffle = actor.shuffle if critic.shuffle is None else critic.shuffle
    critic.loss_agg_mode = critic.loss_agg_mode or actor.loss_agg_mode
    critic.use_dynamic_bsz = actor.use_dynamic_bsz if critic.use_dynamic_bsz is None else critic.use_dynamic_bsz
    critic.forward_max_token_len_per_gpu = critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu
    critic.forward_micro_batch_size_per_gpu = (critic.forward_micro_batch_size_per_gpu
                                               or critic.ppo_micro_batch_size_per_gpu)
    critic.model.tokenizer_path = critic.model.tokenizer_path or arr.model.path
    rm = cfg.reward_model
    rm.model.input_tokenizer = rm.model.input_tokenizer or arr.model.path
    rm.use_dynamic_bsz = critic.use_dynamic_bsz if rm.use_dynamic_bsz is None else rm.use_dynamic_bsz
    rm.forward_max_token_len_per_gpu = rm.forward_max_token_len_per_gpu or critic.forward_max_token_len_per_gpu
    if critic.optim.min_lr_ratio is None:          # verl's critic default
        critic.optim.min_lr_ratio = 0.0
    if rollout.max_model_len is None:
        rollout.max_model_len = rollout.prompt_length + rollout.response_length


# ----------------------------------------------------------------------------------------------------------------
# Checks: types and ranges (read from the key table), choices, refusals, required keys, paths

def _has_kind(value, kinds):
    if isinstance(kinds, tuple):
        return any(_has_kind(value, kind) for kind in kinds)
    if isinstance(kinds, list):
        return isinstance(value, list) and all(_has_kind(item, kinds[0]) for item in value)
    if kinds is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kinds is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kinds)


def _kind_name(kinds):
    if isinstance(kinds, tuple):
        return " or ".join(_kind_name(kind) for kind in kinds)
    if isinstance(kinds, list):
        return f"a list of {_kind_name(kinds[0])}"
    return "a mapping" if kinds is dict else kinds.__name__


def check_types(cfg):
    """Every value has its key's type (int accepted for float; null where the key, or verl, allows null)."""
    for dotted, spec in leaves():
        value = get_dotted(cfg, dotted)
        if spec.kinds is float and isinstance(value, str):
            value = float_or_same(value)   # yaml reads 1e-6 (no dot) as a string
            set_dotted(cfg, dotted, value)
        if (value is None and spec.nullable) or spec.kinds is None:
            continue
        if not _has_kind(value, spec.kinds):
            null = "; yaml writes none as null" if spec.nullable and value in ("None", "none") else ""
            raise ConfigError(f"config key '{dotted}' must be {_kind_name(spec.kinds)}, got {_show(value)} "
                              f"({type(value).__name__}{null}); default is {spec.default!r}")


def float_or_same(text):
    try:
        return float(text)
    except ValueError:
        return text


def _in_range(number, valid):
    """`valid` is interval notation, e.g. '(0, 1]', '[1, inf)', '-1 or [1, inf)'."""
    for part in valid.split(" or "):
        interval = re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", part)
        if interval is None:
            if number == float(part):
                return True
            continue
        low, high = float(interval[2]), float(interval[3])
        if ((low < number or (interval[1] == "[" and number == low))
                and (number < high or (interval[4] == "]" and number == high))):
            return True
    return False


def check_ranges(cfg):
    """Every number is finite and inside its key's range (lists: each element)."""
    for dotted, spec in leaves():
        value = get_dotted(cfg, dotted)
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                continue
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(f"config key '{dotted}'={number} is not a finite number; default is "
                                  f"{spec.default!r}")
            if spec.valid and not _in_range(number, spec.valid):
                why = f" ({spec.why})" if spec.why else ""
                raise ConfigError(f"config key '{dotted}'={_show(value)} is out of range: valid is {spec.valid}"
                                  f"{why}; default is {spec.default!r}")


def _no_effect_reason(dotted):
    """NO_EFFECT's reason for a key: its own entry's, else that of the innermost subtree holding it (None: read)."""
    holders = [key for key in NO_EFFECT
               if dotted == key.rstrip(".") or (key.endswith((".", "_")) and dotted.startswith(key))]
    return NO_EFFECT[max(holders, key=len)] if holders else None


def settings_without_effect(cfg):
    """Warnings for NO_EFFECT keys set away from both minirl's and verl's default (printed at start-up)."""
    defaults = default_tree()
    found = []
    for dotted in ALL_KEYS:
        reason, value = _no_effect_reason(dotted), get_dotted(cfg, dotted)
        if reason and value != get_dotted(defaults, dotted) and value != get_dotted(VERL_DEFAULTS, dotted, None):
            found.append(f"config key '{dotted}'={_show(value)} has no effect in minirl: {reason}")
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    for key in ("tool_config_path", "interaction_config_path"):      # read by the agent loop only (verl's too)
        if multi_turn[key] and not multi_turn_on(cfg):
            found.append(f"config key 'actor_rollout_ref.rollout.multi_turn.{key}' is set but multi-turn rollouts "
                         f"are off, so it is not used: set actor_rollout_ref.rollout.multi_turn.enable=True")
    if "chat_template" in cfg.actor_rollout_ref.model.override_config:     # verl's geo3k multi-turn script sets it
        found.append("config key 'actor_rollout_ref.model.override_config.chat_template' sets an attribute of the "
                     "model's config, which the prompts are not templated with: to change the chat template, set "
                     "actor_rollout_ref.model.custom_chat_template")
    filter_groups = cfg.algorithm.filter_groups
    for key in ("metric", "max_num_gen_batches"):                    # read by dynamic sampling only (verl's too)
        dotted = f"algorithm.filter_groups.{key}"
        if not filter_groups.enable and filter_groups[key] != get_dotted(defaults, dotted):
            found.append(f"config key '{dotted}'={_show(filter_groups[key])} is set but dynamic sampling is off, so "
                         f"it is not used: set algorithm.filter_groups.enable=true")
    alg = cfg.algorithm
    for key in ("reweight_method", "weight_pow"):                    # read by PF-PPO only (verl's too)
        dotted = f"algorithm.pf_ppo.{key}"
        if not alg.use_pf_ppo and alg.pf_ppo[key] != get_dotted(defaults, dotted):
            found.append(f"config key '{dotted}'={_show(alg.pf_ppo[key])} is set but PF-PPO is off, so it is not "
                         f"used: set algorithm.use_pf_ppo=true")
    found += _settings_of_unbuilt_models(cfg, defaults)
    if alg.use_pf_ppo and alg.adv_estimator != "gae":
        found.append(f"config key 'algorithm.use_pf_ppo'=true has no effect with algorithm.adv_estimator="
                     f"{alg.adv_estimator}: PF-PPO resamples the batch after GAE only (as verl); use "
                     f"algorithm.adv_estimator=gae with a critic")
    rollout = cfg.actor_rollout_ref.rollout
    if not rollout.do_sample and rollout.n > 1 and alg.adv_estimator != "gae":     # temperature=0 is refused
        found.append(f"config key 'actor_rollout_ref.rollout.do_sample'=false decodes greedily, so the n="
                     f"{rollout.n} responses to a prompt are identical and {alg.adv_estimator}'s advantages, "
                     f"relative to the group, are all zero: nothing is learned; set do_sample=true (verl's default)")
    found += _greedy_validation_warnings(rollout.val_kwargs)
    return found


def _greedy_validation_warnings(val):
    """Validation decodes greedily unless do_sample=true with a temperature above 0 (as verl's rollouts do)."""
    section = "actor_rollout_ref.rollout.val_kwargs"
    if val.do_sample and val.temperature == 0:
        return [f"config key '{section}.do_sample'=true has no effect at {section}.temperature=0: validation "
                f"decodes greedily; set {section}.temperature (e.g. 1.0) to sample"]
    if not val.do_sample and val.n > 1:
        return [f"config key '{section}.n'={val.n} repeats a greedy validation: the {val.n} responses to a prompt "
                f"are identical; set {section}.do_sample=true and a temperature to sample them"]
    return []


UNBUILT_MODEL_KEYS = {        # settings minirl reads only while building their model
    "critic": ("critic.model.lora_rank", FSDP_SIZE_KEY["critic"]),
    "reward_model": (FSDP_SIZE_KEY["reward_model"],),
}


def _settings_of_unbuilt_models(cfg, defaults):
    """Warnings for a critic's or reward model's settings while that model is not built (verl ignores them too)."""
    unbuilt = {"critic": (cfg.algorithm.adv_estimator != "gae",
                          f"no critic is built with algorithm.adv_estimator={cfg.algorithm.adv_estimator} (it "
                          f"trains with algorithm.adv_estimator=gae)"),
               "reward_model": (not cfg.reward_model.enable,
                                "no reward model is built (set reward_model.enable=true to score with one)")}
    found = []
    for role, keys in UNBUILT_MODEL_KEYS.items():
        off, why = unbuilt[role]
        for dotted in keys:
            value = get_dotted(cfg, dotted)
            if off and value != get_dotted(defaults, dotted):
                found.append(f"config key '{dotted}'={_show(value)} is set but {why}, so it is not used")
    return found


# the folders a run writes to (runtime.check_output_folders checks them writable before any model loads)
OUTPUT_FOLDER_KEYS = ("af_output_dir", "trainer.default_local_dir", "trainer.rollout_data_dir",
                      "trainer.validation_data_dir")


def _check_outputs_are_local(cfg):
    """hdfs:// is read (models, data), never written: without this a run wrote into a local folder named 'hdfs:'.
    hdfs_cache_dir is written too (the local copies of hdfs:// paths)."""
    for key in (*OUTPUT_FOLDER_KEYS, "trainer.hdfs_cache_dir"):
        folder = get_dotted(cfg, key)
        if folder and str(folder).startswith("hdfs://"):
            raise ConfigError(f"{key}={folder!r}: minirl writes its outputs to a local folder (hdfs:// is read for "
                              f"models and data only); point it at a local folder and copy the results over")


def validate(cfg, world_size=None, check_paths=True):
    _check_choices(cfg)
    _check_outputs_are_local(cfg)
    _check_not_yet(cfg)
    _check_algorithm(cfg)
    _check_sequence_parallel(cfg)
    _check_lora(cfg)
    _check_multi_turn(cfg, check_paths)
    _check_reward_manager(cfg)
    _check_dynamic_sampling(cfg)
    check_split_keys(cfg)
    if world_size:
        check_batch(cfg, world_size)
    if check_paths:
        _check_paths(cfg)


def _check_choices(cfg):
    for dotted, choices in CHOICES.items():
        value = get_dotted(cfg, dotted)
        if value not in choices:
            guess = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{guess[0]}'?)" if guess else ""
            raise ConfigError(f"config key '{dotted}' is {_show(value)}{hint}; choose one of: {', '.join(choices)}")
    loggers = cfg.trainer.logger
    loggers = [loggers] if isinstance(loggers, str) else loggers     # verl takes `trainer.logger=console` too
    bad = [name for name in loggers if name not in LOGGERS]
    if bad:
        as_list = (f" (a list is written in brackets: trainer.logger=[{bad[0]}])" if any("," in name for name in bad)
                   else "")
        raise ConfigError(f"config key 'trainer.logger' has unknown entries {bad}{as_list}; choose from: "
                          f"{', '.join(LOGGERS)}")
    cfg.trainer.logger = list(loggers)


def multi_turn_on(cfg):
    rollout = cfg.actor_rollout_ref.rollout
    return rollout.multi_turn.enable or rollout.mode == "async"


def _check_multi_turn(cfg, check_paths=True):
    """The agent loop's settings, and the tool and interaction yamls loaded once (a bad one fails here, before any
    model loads)."""
    rollout = cfg.actor_rollout_ref.rollout
    if not multi_turn_on(cfg):
        return
    if not cfg.data.return_raw_chat:
        switch = ("actor_rollout_ref.rollout.multi_turn.enable=True" if rollout.multi_turn.enable
                  else "actor_rollout_ref.rollout.mode=async")
        raise ConfigError(f"{switch} runs the agent loop (verl's multi-turn / async rollout), which templates the "
                          f"chat messages itself: set data.return_raw_chat=True")
    if rollout.ignore_eos:
        raise ConfigError("actor_rollout_ref.rollout.ignore_eos=True cannot end an assistant turn; leave it False "
                          "with multi_turn.enable or rollout.mode=async")
    if rollout.multi_turn.tool_config_path and check_paths:
        from tools import load_tools            # tools.py imports this module
        load_tools(rollout.multi_turn.tool_config_path)
    if rollout.multi_turn.interaction_config_path and check_paths:
        from interactions import load_interactions      # so does interactions.py
        load_interactions(rollout.multi_turn.interaction_config_path)


OVERLONG_BUFFER_KEYS = {"enable": bool, "len": int, "penalty_factor": (int, float), "log": bool}
RECIPE_BUFFER = "reward_model.overlong_buffer"       # DAPO's recipe form of the buffer (verl_keys.DAPO_RECIPE)


def dapo_reward_arguments(cfg):
    """DAPORewardManager's arguments (max_resp_len, overlong_buffer_cfg) as verl hands them over, and the config
    keys they come from: main_ppo passes reward_model.reward_kwargs; DAPO's recipe (main_dapo) passes
    data.max_response_length and reward_model.overlong_buffer. minirl reads the first when it is set, else the
    second (whose buffer is off by default: the manager then adds nothing)."""
    kwargs = cfg.reward_model.reward_kwargs
    if kwargs:
        prefix = "reward_model.reward_kwargs"
        return kwargs, {name: f"{prefix}.{name}" for name in ("max_resp_len", "overlong_buffer_cfg")}
    arguments = {"max_resp_len": cfg.data.max_response_length,
                 "overlong_buffer_cfg": dict(cfg.reward_model.overlong_buffer)}
    return arguments, {"max_resp_len": "data.max_response_length", "overlong_buffer_cfg": RECIPE_BUFFER}


def _check_reward_manager(cfg):
    """The reward manager's arguments, as verl's entry points pass them (dapo_reward_arguments): naive and prime
    take none; batch hands reward_model.reward_kwargs to the (custom) function as keyword arguments; dapo (verl's
    DAPORewardManager) needs max_resp_len and overlong_buffer_cfg.enable, and with the buffer on its len,
    penalty_factor and log (what verl's constructor and __call__ read)."""
    manager, kwargs = cfg.reward_model.reward_manager, cfg.reward_model.reward_kwargs
    prefix = "reward_model.reward_kwargs"
    recipe_buffer = {key: get_dotted(cfg, f"{RECIPE_BUFFER}.{key}") for key in OVERLONG_BUFFER_KEYS}
    recipe_buffer_set = recipe_buffer != {key: DAPO_RECIPE[f"{RECIPE_BUFFER}.{key}"] for key in OVERLONG_BUFFER_KEYS}
    if manager == "batch":      # its arguments go to the reward function: any, but not DAPO's buffer
        if not cfg.custom_reward_function.path:
            raise ConfigError("reward_model.reward_manager=batch calls custom_reward_function with the whole batch "
                              "(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...], "
                              "**reward_kwargs) and the built-in scorers take one row: set "
                              "custom_reward_function.path to a file with such a function")
        if recipe_buffer_set:
            raise ConfigError(f"'{RECIPE_BUFFER}' is set, but the overlong buffer belongs to "
                              f"reward_model.reward_manager=dapo")
        return
    if manager in ("naive", "prime"):
        if kwargs or recipe_buffer_set:
            where = f"'{prefix}' has {sorted(kwargs)}" if kwargs else f"'{RECIPE_BUFFER}' is set"
            raise ConfigError(f"{where}, but reward_model.reward_manager={manager} takes no arguments; the "
                              f"overlong buffer belongs to reward_model.reward_manager=dapo")
        return
    if kwargs and recipe_buffer_set:
        raise ConfigError(f"DAPO's overlong buffer is set twice: in '{prefix}' (verl's main_ppo reads it) and in "
                          f"'{RECIPE_BUFFER}' (DAPO's recipe reads it); keep one")
    unknown = sorted(set(kwargs) - {"max_resp_len", "overlong_buffer_cfg"})
    if unknown:
        raise ConfigError(f"'{prefix}' has {unknown}; reward_model.reward_manager=dapo takes max_resp_len and "
                          f"overlong_buffer_cfg")
    arguments, names = dapo_reward_arguments(cfg)
    buffer = arguments.get("overlong_buffer_cfg")
    example = (f"+{prefix}.overlong_buffer_cfg.enable=true +{prefix}.overlong_buffer_cfg.len=512 "
               f"+{prefix}.overlong_buffer_cfg.penalty_factor=1.0 +{prefix}.overlong_buffer_cfg.log=false "
               f"+{prefix}.max_resp_len={cfg.data.max_response_length}")
    if not isinstance(buffer, dict) or "max_resp_len" not in arguments:
        raise ConfigError(f"reward_model.reward_manager=dapo needs '{prefix}.overlong_buffer_cfg' and "
                          f"'{prefix}.max_resp_len' (as DAPO's scripts set them), e.g. {example}")
    unknown = sorted(set(buffer) - set(OVERLONG_BUFFER_KEYS))
    if unknown:
        raise ConfigError(f"'{names['overlong_buffer_cfg']}' has {unknown}; it takes "
                          f"{', '.join(OVERLONG_BUFFER_KEYS)}")
    required = OVERLONG_BUFFER_KEYS if buffer.get("enable") else {"enable": bool}
    checks = [(f"{names['overlong_buffer_cfg']}.{key}", buffer.get(key), kind) for key, kind in required.items()]
    for dotted, value, kind in [(names["max_resp_len"], arguments["max_resp_len"], int)] + checks:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            got = "it is not set" if value is None else f"got {_show(value)}"
            raise ConfigError(f"'{dotted}' must be {getattr(kind, '__name__', 'a number')}, {got}; e.g. {example}")
    sizes = [(names["max_resp_len"], arguments["max_resp_len"])]
    if buffer["enable"]:                  # off, verl reads nothing else of it (DAPO's scripts then pass len=0)
        sizes.append((f"{names['overlong_buffer_cfg']}.len", buffer["len"]))
    for dotted, value in sizes:
        if value < 1:
            raise ConfigError(f"'{dotted}'={value} must be at least 1 (the penalty ramps over the last len tokens "
                              f"before max_resp_len)")


SEQUENCE_METRICS = ("seq_reward", "seq_final_reward")   # filter_groups.metric values that are not reward extras


def _check_dynamic_sampling(cfg):
    """DAPO's dynamic sampling (algorithm.filter_groups) and its generation batch (data.gen_batch_size)."""
    filter_groups, gen_batch_size = cfg.algorithm.filter_groups, cfg.data.gen_batch_size
    if not filter_groups.enable:
        if gen_batch_size not in (None, cfg.data.train_batch_size):
            raise ConfigError(f"'data.gen_batch_size'={gen_batch_size} differs from 'data.train_batch_size'="
                              f"{cfg.data.train_batch_size}, which only dynamic sampling uses: set "
                              f"algorithm.filter_groups.enable=true (and its metric), or unset data.gen_batch_size")
        return
    if not filter_groups.metric:
        raise ConfigError(f"algorithm.filter_groups.enable=true needs 'algorithm.filter_groups.metric': the value "
                          f"whose spread over a prompt's responses keeps its group, one of "
                          f"{', '.join(SEQUENCE_METRICS)} or a key of the reward function's dict result (DAPO's "
                          f"scripts use acc)")
    if cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.enable=true with 'algorithm.use_kl_in_reward'=true: the KL "
                          "penalty needs the old and reference log-probs, which are computed after the groups are "
                          "filtered (as in verl's DAPO recipe); use actor_rollout_ref.actor.use_kl_loss instead")
    if cfg.rollout.n_gpus_per_node:
        raise ConfigError("algorithm.filter_groups.enable=true is not supported on split devices: the rollout ranks "
                          "generate one batch ahead, not as many as the filter asks for; unset "
                          "'rollout.n_gpus_per_node' (colocated)")


def _check_not_yet(cfg):
    for dotted, (default, feature) in NOT_YET.items():
        if get_dotted(cfg, dotted) != default:
            raise ConfigError(f"config key '{dotted}' enables {feature}, which minirl does not implement yet "
                              f"(got {_show(get_dotted(cfg, dotted))}); leave it at {default!r}")


def _check_algorithm(cfg):
    alg = cfg.algorithm
    if alg.adv_estimator == "gae" and not cfg.critic.model.path:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic: set 'critic.model.path', or choose a "
                          "critic-free estimator such as algorithm.adv_estimator=grpo")
    if alg.adv_estimator == "grpo_passk" and cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator=grpo_passk gives each group's best response its lead over the "
                          f"second best, so it needs 'actor_rollout_ref.rollout.n' >= 2 (got "
                          f"{cfg.actor_rollout_ref.rollout.n})")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError("reward_model.enable is true but 'reward_model.model.path' is not set")
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError("config key 'actor_rollout_ref.model.path' is required (a local or hdfs:// model folder)")
    if not cfg.data.train_files:
        raise ConfigError("config key 'data.train_files' is required (a parquet path or a list of them)")
    for role in ("actor_rollout_ref.actor", "critic"):
        if len(get_dotted(cfg, role + ".optim.betas")) != 2:
            raise ConfigError(f"config key '{role}.optim.betas' must hold two numbers (Adam's beta1, beta2), got "
                              f"{get_dotted(cfg, role + '.optim.betas')}")


SEQUENCE_PARALLEL_KEYS = {       # each worker's Ulysses size -> the key that switches its packed forward on
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "actor_rollout_ref.model.use_remove_padding",
    "critic.ulysses_sequence_parallel_size": "critic.model.use_remove_padding",
}


def _check_sequence_parallel(cfg):
    """Ulysses splits the packed row, so it needs the packed forward (verl asserts the same)."""
    for dotted, packed in SEQUENCE_PARALLEL_KEYS.items():
        if dotted.startswith("critic.") and cfg.algorithm.adv_estimator != "gae":
            continue                                    # no critic is built
        sp = get_dotted(cfg, dotted)
        if sp > 1 and not get_dotted(cfg, packed):
            raise ConfigError(f"'{dotted}'={sp} (Ulysses sequence parallel) splits the packed row of a micro-batch; "
                              f"set '{packed}=true'")


def _check_lora(cfg):
    """LoRA under vLLM needs a load_format the adapter sync handles (lora_rank and lora_alpha have their ranges in
    config_keys; target modules are checked against the model by lora.check_target_modules before it loads)."""
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    if model.lora_rank > 0 and rollout.name == "vllm" and not (rollout.load_format == "safetensors"
                                                               or rollout.load_format.startswith("dummy")):
        raise ConfigError(f"config key 'actor_rollout_ref.rollout.load_format'={rollout.load_format!r} with LoRA: "
                          f"use 'safetensors' (vLLM loads the base model from model.path) or a 'dummy*' format "
                          f"(the first weight sync sends the base weights); later syncs send the adapter only")


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")        # organisation/name, as verl's example scripts pass


def _hub_hint(item):
    """For a model path that reads as a Hugging Face Hub id (verl's example scripts pass them, and verl downloads):
    how to get a local copy, since minirl reads models from a local folder or hdfs:// only."""
    if not HUB_ID.match(item):
        return ""
    return (f"; it reads as a Hugging Face Hub id, and minirl loads models from a local folder or hdfs:// (no "
            f"downloads): fetch it first, e.g. `hf download {item} --local-dir ~/models/{item.split('/')[1]}`, "
            f"and pass that folder")


def _check_paths(cfg):
    def exists(dotted, value, folder):
        for item in ([value] if isinstance(value, str) else value):
            if item.startswith("hdfs://"):
                continue
            path = Path(item)
            try:
                found, right_kind = path.exists(), path.is_dir() if folder else path.is_file()
            except OSError as err:       # e.g. a name longer than the file system allows
                raise ConfigError(f"config key '{dotted}': path '{_cut(item)}' cannot be used: "
                                  f"{err.strerror or err}") from None
            if not found:
                hint = _hub_hint(item) if folder else ""
                raise ConfigError(f"config key '{dotted}': path '{_cut(item)}' does not exist{hint}")
            if not right_kind:
                raise ConfigError(f"config key '{dotted}': '{_cut(item)}' is not a {'folder' if folder else 'file'}")

    exists("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path, folder=True)
    exists("data.train_files", cfg.data.train_files, folder=False)
    if cfg.data.val_files:
        exists("data.val_files", cfg.data.val_files, folder=False)
    if cfg.algorithm.adv_estimator == "gae":
        exists("critic.model.path", cfg.critic.model.path, folder=True)
    if cfg.reward_model.enable:
        exists("reward_model.model.path", cfg.reward_model.model.path, folder=True)
    vision.check_config(cfg)                           # from config.json: what a vision-language model cannot do
    if cfg.custom_reward_function.path:
        exists("custom_reward_function.path", cfg.custom_reward_function.path, folder=False)
    if cfg.trainer.resume_mode == "resume_path":
        if not cfg.trainer.resume_from_path:
            raise ConfigError("trainer.resume_mode=resume_path needs 'trainer.resume_from_path' "
                              "(a .../global_step_N folder)")
        exists("trainer.resume_from_path", cfg.trainer.resume_from_path, folder=True)


# ----------------------------------------------------------------------------------------------------------------
# Planning without torchrun

def planning_world_size(cfg, requested=None):
    """(world size, where it came from) for --print-config: --world-size, else torchrun's WORLD_SIZE, else
    trainer.nnodes x trainer.n_gpus_per_node when set, else 1."""
    if requested:
        return requested, "--world-size"
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE"
    if cfg.trainer.n_gpus_per_node and cfg.rollout.n_gpus_per_node:
        return (cfg.trainer.n_gpus_per_node + cfg.rollout.n_gpus_per_node,
                f"trainer.n_gpus_per_node + rollout.n_gpus_per_node = {cfg.trainer.n_gpus_per_node} + "
                f"{cfg.rollout.n_gpus_per_node}")
    if cfg.trainer.n_gpus_per_node:
        return (cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node,
                f"trainer.nnodes x trainer.n_gpus_per_node = {cfg.trainer.nnodes} x {cfg.trainer.n_gpus_per_node}")
    return 1, "neither --world-size nor trainer.n_gpus_per_node is set"
