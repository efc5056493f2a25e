"""minirl's configuration: verl's key tree, its defaults, loading, overrides and every check that can run
before a model is loaded.

Two yaml shapes load:
  * the seed's shape:  af_output_dir + backend_config.{data, actor_rollout_ref, critic, reward_model, algorithm,
                       trainer, rollout} (+ engine_kwargs.vllm.* at the top level)
  * verl's shape:      data, actor_rollout_ref, ... at the top level (af_output_dir optional)
Merge order: DEFAULTS, then the yaml, then CLI overrides `a.b.c=value` (with or without `backend_config.`).

    cfg = load_config("config.yaml", ["data.train_batch_size=64"], world_size=2)
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size   # attribute access, verl's names

Every error names the key and the fix, and is raised as ConfigError before any model loads. The valid choices
of algorithm keys come from losses.py (and truncation from data.py), so the two never disagree.
"""
from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path

import yaml

from data import TRUNCATION_MODES
from losses import ADVANTAGE_ESTIMATORS, KL_PENALTY_KINDS, LOSS_AGG_MODES

ANY = object()  # marks a free-form dict: any keys pass through (e.g. engine_kwargs.vllm)

_FSDP_CONFIG = {"param_offload": False, "optimizer_offload": False, "offload_policy": False,
                "reshard_after_forward": True, "fsdp_size": -1, "forward_prefetch": False,
                "wrap_policy": {"min_num_params": 0}, "model_dtype": None, "mixed_precision": None}
_OPTIM = {"lr": 1e-6, "betas": [0.9, 0.999], "weight_decay": 0.01, "lr_warmup_steps": -1,
          "lr_warmup_steps_ratio": 0.0, "warmup_style": "constant", "min_lr_ratio": 0.0, "num_cycles": 0.5,
          "total_training_steps": -1}

# verl v0.5.0's defaults (verl-semantics.md section 6) for every key minirl reads. A yaml key missing here is an
# error (with a suggestion); keys of dicts marked ANY pass through untouched.
DEFAULTS = {
    "af_output_dir": "outputs",
    "data": {
        "tokenizer": None, "use_shm": False, "train_files": None, "val_files": None, "prompt_key": "prompt",
        "reward_fn_key": "data_source", "max_prompt_length": 512, "max_response_length": 512,
        "train_batch_size": 1024, "val_batch_size": None, "return_raw_input_ids": False, "return_raw_chat": False,
        "return_full_prompt": False, "shuffle": True, "seed": 1, "dataloader_num_workers": 0,
        "validation_shuffle": False, "filter_overlong_prompts": False, "filter_overlong_prompts_workers": 1,
        "truncation": "error", "image_key": "images", "video_key": "videos", "trust_remote_code": False,
        "custom_cls": {"path": None, "name": None},
    },
    "actor_rollout_ref": {
        "hybrid_engine": True,
        "model": {
            "path": None, "custom_chat_template": None, "use_shm": False, "external_lib": None,
            "override_config": ANY, "enable_gradient_checkpointing": True, "enable_activation_offload": False,
            "use_remove_padding": False, "lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear",
            "exclude_modules": None, "use_liger": False, "use_fused_kernels": False, "trust_remote_code": False,
        },
        "actor": {
            "strategy": "fsdp2", "ppo_mini_batch_size": 256, "ppo_micro_batch_size": None,
            "ppo_micro_batch_size_per_gpu": None, "use_dynamic_bsz": False, "ppo_max_token_len_per_gpu": 16384,
            "clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
            "policy_loss": {"loss_mode": "vanilla"}, "loss_agg_mode": "token-mean", "entropy_coeff": 0.0,
            "use_kl_loss": False, "use_torch_compile": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl",
            "ppo_epochs": 1, "shuffle": False, "ulysses_sequence_parallel_size": 1, "grad_clip": 1.0,
            "entropy_from_logits_with_chunking": False, "entropy_checkpointing": False,
            "checkpoint": {"save_contents": ["model", "optimizer", "extra"],
                           "load_contents": ["model", "optimizer", "extra"]},
            "optim": dict(_OPTIM), "fsdp_config": dict(_FSDP_CONFIG),
        },
        "ref": {
            "strategy": "fsdp2", "use_torch_compile": None, "log_prob_micro_batch_size": None,
            "log_prob_micro_batch_size_per_gpu": None, "log_prob_use_dynamic_bsz": None,
            "log_prob_max_token_len_per_gpu": None, "ulysses_sequence_parallel_size": None,
            "fsdp_config": dict(_FSDP_CONFIG),
        },
        "rollout": {
            "name": "vllm", "mode": "sync", "temperature": 1.0, "top_k": -1, "top_p": 1.0, "do_sample": True,
            "n": 1, "prompt_length": None, "response_length": None, "dtype": "bfloat16",
            "gpu_memory_utilization": 0.5, "ignore_eos": False, "enforce_eager": True, "free_cache_engine": True,
            "load_format": "dummy_dtensor", "layered_summon": False, "tensor_model_parallel_size": 2,
            "max_num_batched_tokens": 8192, "max_model_len": None, "max_num_seqs": 1024,
            "enable_chunked_prefill": True, "log_prob_micro_batch_size": None,
            "log_prob_micro_batch_size_per_gpu": None, "log_prob_use_dynamic_bsz": None,
            "log_prob_max_token_len_per_gpu": None, "disable_log_stats": True, "calculate_log_probs": False,
            "update_weights_bucket_megabytes": 512,
            "engine_kwargs": {"vllm": ANY, "sglang": ANY},
            "val_kwargs": {"top_k": -1, "top_p": 1.0, "temperature": 0.0, "n": 1, "do_sample": False},
            "multi_turn": {
                "enable": False, "max_assistant_turns": None, "tool_config_path": None, "max_user_turns": None,
                "max_parallel_calls": 1, "max_tool_response_length": 256, "tool_response_truncate_side": "middle",
                "interaction_config_path": None, "use_inference_chat_template": False,
                "tokenization_sanity_check_mode": "strict", "format": "hermes",
            },
        },
    },
    "critic": {
        "rollout_n": None, "strategy": "fsdp2", "optim": dict(_OPTIM, lr=1e-5),
        "model": {"path": None, "tokenizer_path": None, "override_config": ANY,
                  "enable_gradient_checkpointing": True, "use_remove_padding": False, "trust_remote_code": False,
                  "fsdp_config": dict(_FSDP_CONFIG), "lora_rank": 0, "lora_alpha": 16,
                  "target_modules": "all-linear"},
        "ppo_mini_batch_size": None, "ppo_micro_batch_size": None, "ppo_micro_batch_size_per_gpu": None,
        "forward_micro_batch_size": None, "forward_micro_batch_size_per_gpu": None, "use_dynamic_bsz": None,
        "ppo_max_token_len_per_gpu": 32768, "forward_max_token_len_per_gpu": None, "ulysses_sequence_parallel_size": 1,
        "ppo_epochs": None, "shuffle": None, "grad_clip": 1.0, "cliprange_value": 0.5, "loss_agg_mode": None,
        "checkpoint": {"save_contents": ["model", "optimizer", "extra"],
                       "load_contents": ["model", "optimizer", "extra"]},
    },
    "reward_model": {
        "enable": False, "strategy": "fsdp2",
        "model": {"input_tokenizer": None, "path": None, "use_remove_padding": False, "trust_remote_code": False,
                  "fsdp_config": dict(_FSDP_CONFIG)},
        "micro_batch_size": None, "micro_batch_size_per_gpu": None, "max_length": None, "use_dynamic_bsz": None,
        "forward_max_token_len_per_gpu": None, "reward_manager": "naive", "launch_reward_fn_async": False,
    },
    "custom_reward_function": {"path": None, "name": "compute_score"},
    "algorithm": {
        "gamma": 1.0, "lam": 1.0, "adv_estimator": "gae", "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": False, "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.001, "horizon": 10000, "target_kl": 0.1},
    },
    "trainer": {
        "balance_batch": True, "total_epochs": 30, "total_training_steps": None, "project_name": "minirl",
        "experiment_name": "demo", "logger": ["console"], "log_val_generations": 0, "rollout_data_dir": None,
        "validation_data_dir": None, "nnodes": 1, "n_gpus_per_node": None, "save_freq": -1,
        "resume_mode": "auto", "resume_from_path": None, "val_before_train": True, "val_only": False,
        "test_freq": -1, "critic_warmup": 0, "default_hdfs_dir": None, "del_local_ckpt_after_load": False,
        "default_local_dir": None, "max_actor_ckpt_to_keep": None, "max_critic_ckpt_to_keep": None,
        "device": "auto", "seed": 1, "hdfs_cache_dir": None,
    },
    # one-step-off-policy's separate rollout pool (verl's top-level `rollout:` section)
    "rollout": {"nnodes": 1, "n_gpus_per_node": None},
}

# Keys whose default is None, and what they hold when set.
OPTIONAL_TYPES = {
    "data.train_files": (str, list), "data.val_files": (str, list), "data.val_batch_size": int,
    "data.tokenizer": str, "actor_rollout_ref.model.path": str, "actor_rollout_ref.model.custom_chat_template": str,
    "actor_rollout_ref.model.external_lib": str, "actor_rollout_ref.model.exclude_modules": (str, list),
    "actor_rollout_ref.actor.ppo_micro_batch_size": int, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": int,
    **{f"actor_rollout_ref.{worker}.{key}": kind for worker in ("ref", "rollout") for key, kind in (
        ("log_prob_micro_batch_size", int), ("log_prob_micro_batch_size_per_gpu", int),
        ("log_prob_use_dynamic_bsz", bool), ("log_prob_max_token_len_per_gpu", int))},
    "actor_rollout_ref.ref.use_torch_compile": bool, "actor_rollout_ref.ref.ulysses_sequence_parallel_size": int,
    "actor_rollout_ref.rollout.prompt_length": int, "actor_rollout_ref.rollout.response_length": int,
    **{f"critic.{key}": int for key in ("rollout_n", "ppo_mini_batch_size", "ppo_micro_batch_size",
                                        "ppo_micro_batch_size_per_gpu", "forward_micro_batch_size",
                                        "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu",
                                        "ppo_epochs")},
    "critic.use_dynamic_bsz": bool, "critic.shuffle": bool, "critic.loss_agg_mode": str,
    "critic.model.tokenizer_path": str, "reward_model.model.input_tokenizer": str,
    **{f"reward_model.{key}": int for key in ("micro_batch_size", "micro_batch_size_per_gpu", "max_length",
                                              "forward_max_token_len_per_gpu")},
    "reward_model.use_dynamic_bsz": bool, "trainer.rollout_data_dir": str, "trainer.validation_data_dir": str,
    "trainer.hdfs_cache_dir": str,
    "actor_rollout_ref.actor.clip_ratio_low": float, "actor_rollout_ref.actor.clip_ratio_high": float,
    "trainer.total_training_steps": int, "trainer.resume_from_path": str, "trainer.default_local_dir": str,
    "trainer.max_actor_ckpt_to_keep": int, "trainer.max_critic_ckpt_to_keep": int, "trainer.n_gpus_per_node": int,
    "rollout.n_gpus_per_node": int, "critic.model.path": str, "reward_model.model.path": str,
    "custom_reward_function.path": str, "actor_rollout_ref.rollout.multi_turn.tool_config_path": str,
    "actor_rollout_ref.rollout.max_model_len": int,
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": int,
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": int,
}

CHOICES = {
    "data.truncation": TRUNCATION_MODES,
    "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor_rollout_ref.actor.kl_loss_type": KL_PENALTY_KINDS,
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("vanilla",),
    "actor_rollout_ref.actor.optim.warmup_style": ("constant", "cosine"),
    "actor_rollout_ref.rollout.name": ("hf", "vllm"),
    "actor_rollout_ref.rollout.mode": ("sync", "async"),
    "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS),
    "algorithm.kl_penalty": KL_PENALTY_KINDS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.device": ("auto", "cpu", "cuda", "npu"),
    "reward_model.reward_manager": ("naive",),
}
LOGGERS = ("console", "tensorboard", "wandb")

# Accepted so verl configs load, but the feature behind them is not built yet: setting them is an error.
NOT_YET = {
    "actor_rollout_ref.model.lora_rank": (0, "LoRA"),
    "actor_rollout_ref.rollout.multi_turn.enable": (False, "multi-turn tool calling"),
    "actor_rollout_ref.rollout.mode": ("sync", "async rollout"),
    "actor_rollout_ref.hybrid_engine": (True, "one-step-off-policy on split devices"),
    "rollout.n_gpus_per_node": (None, "one-step-off-policy on split devices"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": (False, "parameter offload"),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": (False, "optimizer offload"),
    "trainer.nnodes": (1, "multi-node training (minirl runs on one host)"),
    "rollout.nnodes": (1, "multi-node rollout (minirl runs on one host)"),
}

# verl keys that load (so verl configs work) but change nothing in minirl: set to anything but their default, they
# earn a warning naming them. Prefixes end with '.'.
NO_EFFECT = {
    "data.use_shm": "files are read from their local path",
    "data.val_batch_size": "validation generates the whole set at once (verl's default)",
    "data.return_raw_input_ids": "the raw prompt ids always travel with the batch",
    "data.return_full_prompt": "not returned",
    "data.dataloader_num_workers": "prompts are loaded in the trainer process",
    "data.validation_shuffle": "validation keeps the file order",
    "data.filter_overlong_prompts_workers": "filtering runs in the trainer process",
    "data.video_key": "videos are not supported yet",
    "data.custom_cls.": "the dataset class is fixed",
    "actor_rollout_ref.model.use_shm": "models are read from their local path",
    "actor_rollout_ref.model.external_lib": "not imported",
    "actor_rollout_ref.model.enable_activation_offload": "activations stay on the device",
    "actor_rollout_ref.model.use_liger": "no Liger kernels",
    "actor_rollout_ref.model.use_fused_kernels": "no fused log-prob kernels",
    "actor_rollout_ref.actor.entropy_checkpointing": "entropy is not checkpointed",
    "actor_rollout_ref.actor.shuffle": "mini-batches keep their order (verl ignores it too)",
    "actor_rollout_ref.actor.fsdp_config.": "FSDP2 shards every decoder layer and the root, fp32 master weights",
    "actor_rollout_ref.ref.fsdp_config.": "FSDP2 shards every decoder layer and the root",
    "critic.model.fsdp_config.": "FSDP2 shards every decoder layer and the root, fp32 master weights",
    "critic.model.lora_rank": "the critic is fully fine-tuned",
    "reward_model.model.fsdp_config.": "FSDP2 shards every decoder layer and the root",
    "reward_model.launch_reward_fn_async": "rewards are computed in the step",
    "actor_rollout_ref.rollout.layered_summon": "weights are gathered one tensor at a time",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": "weights are sent one tensor at a time",
    "actor_rollout_ref.rollout.calculate_log_probs": "vLLM's log-probs are always compared (rollout_probs_diff)",
    "trainer.log_val_generations": "validation generations are not logged",
    "trainer.default_hdfs_dir": "checkpoints are written locally",
    "trainer.del_local_ckpt_after_load": "checkpoints are kept",
}

SEED_SECTIONS = ("data", "actor_rollout_ref", "critic", "reward_model", "algorithm", "trainer", "rollout",
                 "custom_reward_function")


class ConfigError(ValueError):
    """A config problem, found before any model loads; the message names the key and the fix."""


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


# ----------------------------------------------------------------------------------------------------------------
# Loading and merging

def _defaults():
    def fresh(tree):
        if tree is ANY:
            return {}
        if isinstance(tree, dict):
            return {k: fresh(v) for k, v in tree.items()}
        return copy.deepcopy(tree)
    return fresh(DEFAULTS)


_UNKNOWN = object()


def _schema_at(path):
    """The default at `path` (ANY inside free-form dicts), or _UNKNOWN."""
    node = DEFAULTS
    for part in path:
        if node is ANY:
            return ANY
        if not isinstance(node, dict) or part not in node:
            return _UNKNOWN
        node = node[part]
    return node


def _unknown_key_error(path, source):
    parent, key = path[:-1], path[-1]
    siblings = list(_schema_at(parent).keys()) if isinstance(_schema_at(parent), dict) else []
    everywhere = _all_dotted_keys()
    guess = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if guess:
        hint = f"did you mean '{'.'.join(parent + [guess[0]])}'?"
    else:
        # the key may exist in another section (e.g. 'ppo_epochs' under 'data')
        same = [k for k in everywhere if k.endswith("." + key)]
        close = same or difflib.get_close_matches(".".join(path), everywhere, n=1, cutoff=0.7)
        hint = f"did you mean '{close[0]}'?" if close else "see config.yaml for the valid keys."
    return ConfigError(f"unknown config key '{'.'.join(path)}' (from {source}): {hint}")


def _all_dotted_keys(node=DEFAULTS, prefix=""):
    keys = []
    for k, v in node.items():
        dotted = prefix + k
        if isinstance(v, dict):
            keys += _all_dotted_keys(v, dotted + ".")
        else:
            keys.append(dotted)
    return keys


def _merge(base, update, path, source):
    """Merge `update` into `base` in place, refusing keys the schema does not know."""
    for key, value in update.items():
        here = path + [str(key)]
        schema = _schema_at(here)
        if schema is _UNKNOWN:
            raise _unknown_key_error(here, source)
        if schema is ANY or _schema_at(path) is ANY:
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                _deep_update(base[key], value)
            else:
                base[key] = value
        elif isinstance(schema, dict):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{'.'.join(here)}' (from {source}) must be a mapping of keys, "
                                  f"got {value!r}")
            _merge(base[key], value, here, source)
        else:
            base[key] = value


def _normalise_shape(raw, source):
    """Return the verl-shaped tree of a seed-shaped or verl-shaped yaml mapping."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    tree = {}
    backend = raw.pop("backend_config", None)
    if backend is not None:
        if not isinstance(backend, dict):
            raise ConfigError(f"{source}: 'backend_config' must be a mapping")
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
        rollout = tree.setdefault("actor_rollout_ref", {}).setdefault("rollout", {})
        _deep_update(rollout.setdefault("engine_kwargs", {}), engine_kwargs)
    if raw:
        key = next(iter(raw))
        raise _unknown_key_error([key], source)
    return tree


def _deep_update(base, update):
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v)
        else:
            base[k] = v


def parse_override(text):
    """'backend_config.data.train_batch_size=64' -> (['data', 'train_batch_size'], 64)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.path=value (e.g. data.train_batch_size=64)")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("+")
    parts = key.split(".")
    if parts[0] == "backend_config":
        parts = parts[1:]
    if parts[0] == "engine_kwargs":
        parts = ["actor_rollout_ref", "rollout"] + parts
    if not parts or not all(parts):
        raise ConfigError(f"override '{text}' has an empty key")
    return parts, yaml.safe_load(value) if value.strip() else None


def _nest(parts, value):
    tree = value
    for part in reversed(parts):
        tree = {part: tree}
    return tree


def load_config(path=None, overrides=(), world_size=None, check_paths=True):
    """Defaults <- yaml at `path` <- overrides; then derive, validate and return a Config."""
    tree = _defaults()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist (pass --config PATH)")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file '{path}' is not valid yaml: {err}") from err
        _merge(tree, _normalise_shape(raw, str(path)), [], str(path))
    for text in overrides:
        parts, value = parse_override(text)
        _merge(tree, _nest(parts, value), [], f"override '{text}'")
    cfg = Config.wrap(tree)
    check_types(cfg)
    derive(cfg)
    validate(cfg, world_size=world_size or int(os.environ.get("WORLD_SIZE", "0")) or None, check_paths=check_paths)
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# Derived values (verl's ${...} interpolations and "inherit from actor" defaults)

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
    if rollout.max_model_len is None:
        rollout.max_model_len = rollout.prompt_length + rollout.response_length


# ----------------------------------------------------------------------------------------------------------------
# Checks

def _get(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_types(cfg, node=DEFAULTS, prefix=""):
    """Every value has the type of its default (int accepted for float, null for optional keys)."""
    for key, default in node.items():
        dotted = prefix + key
        if default is ANY:
            if not isinstance(_get(cfg, dotted), dict):
                raise ConfigError(f"config key '{dotted}' must be a mapping")
            continue
        if isinstance(default, dict):
            check_types(cfg, default, dotted + ".")
            continue
        value = _get(cfg, dotted)
        want = OPTIONAL_TYPES.get(dotted) if default is None else type(default)
        if want is float and isinstance(value, str):
            value = _float_or_same(value)   # yaml reads 1e-6 (no dot) as a string
            _set(cfg, dotted, value)
        if want is None or (value is None and default is None):
            continue
        wants = want if isinstance(want, tuple) else (want,)
        ok = any(_is_type(value, w) for w in wants)
        if not ok:
            names = " or ".join(w.__name__ for w in wants)
            raise ConfigError(f"config key '{dotted}' must be {names}, got {value!r} ({type(value).__name__}); "
                              f"default is {default!r}")


def _float_or_same(text):
    try:
        return float(text)
    except ValueError:
        return text


def _set(cfg, dotted, value):
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[last] = value


def _is_type(value, want):
    if want is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)


def settings_without_effect(cfg):
    """Warnings for NO_EFFECT keys set away from their defaults (printed by minirl.py at start-up)."""
    defaults = Config.wrap(_defaults())
    found = []
    for dotted in _all_dotted_keys():
        reason = next((why for key, why in NO_EFFECT.items() if dotted == key or
                       (key.endswith(".") and dotted.startswith(key))), None)
        if reason and _get(cfg, dotted) != _get(defaults, dotted):
            found.append(f"config key '{dotted}'={_get(cfg, dotted)!r} has no effect in minirl: {reason}")
    return found


def validate(cfg, world_size=None, check_paths=True):
    _check_choices(cfg)
    _check_not_yet(cfg)
    _check_algorithm(cfg)
    _check_sequence_parallel(cfg)
    if world_size:
        batch_plan(cfg, world_size)  # raises on batch arithmetic that does not divide
    if check_paths:
        _check_paths(cfg)


def _check_choices(cfg):
    for dotted, choices in CHOICES.items():
        value = _get(cfg, dotted)
        if value not in choices:
            guess = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{guess[0]}'?)" if guess else ""
            raise ConfigError(f"config key '{dotted}' is {value!r}{hint}; choose one of: {', '.join(choices)}")
    loggers = cfg.trainer.logger
    loggers = [loggers] if isinstance(loggers, str) else loggers
    bad = [name for name in loggers if name not in LOGGERS]
    if bad:
        raise ConfigError(f"config key 'trainer.logger' has unknown entries {bad}; choose from: {', '.join(LOGGERS)}")
    cfg.trainer.logger = list(loggers)


def _check_not_yet(cfg):
    for dotted, (default, feature) in NOT_YET.items():
        if _get(cfg, dotted) != default:
            raise ConfigError(f"config key '{dotted}' enables {feature}, which minirl does not implement yet; "
                              f"leave it at {default!r}")


def _check_algorithm(cfg):
    actor, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    if actor.clip_ratio_c <= 1.0:
        raise ConfigError(f"config key 'actor_rollout_ref.actor.clip_ratio_c' must be > 1 (dual clip), "
                          f"got {actor.clip_ratio_c}")
    if alg.kl_ctrl.type == "adaptive" and alg.kl_ctrl.horizon <= 0:
        raise ConfigError("config key 'algorithm.kl_ctrl.horizon' must be > 0 for the adaptive KL controller")
    if alg.adv_estimator == "gae" and not cfg.critic.model.path:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic: set 'critic.model.path', or choose a "
                          "critic-free estimator such as algorithm.adv_estimator=grpo")
    if cfg.reward_model.enable and not cfg.reward_model.model.path:
        raise ConfigError("reward_model.enable is true but 'reward_model.model.path' is not set")
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError("config key 'actor_rollout_ref.model.path' is required (a local or hdfs:// model folder)")
    if not cfg.data.train_files:
        raise ConfigError("config key 'data.train_files' is required (a parquet path or a list of them)")
    for dotted in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                   "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n",
                   "actor_rollout_ref.actor.ppo_epochs"):
        if _get(cfg, dotted) <= 0:
            raise ConfigError(f"config key '{dotted}' must be positive, got {_get(cfg, dotted)}")


SEQUENCE_PARALLEL_KEYS = {       # each worker's Ulysses size -> the key that switches its packed forward on
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "actor_rollout_ref.model.use_remove_padding",
    "critic.ulysses_sequence_parallel_size": "critic.model.use_remove_padding",
}


def _check_sequence_parallel(cfg):
    """Ulysses splits the packed row, so it needs the packed forward (verl asserts the same)."""
    for dotted, packed in SEQUENCE_PARALLEL_KEYS.items():
        sp = _get(cfg, dotted)
        if dotted.startswith("critic.") and cfg.algorithm.adv_estimator != "gae":
            continue                                    # no critic is built
        if sp < 1:
            raise ConfigError(f"config key '{dotted}' must be >= 1, got {sp}")
        if sp > 1 and not _get(cfg, packed):
            raise ConfigError(f"'{dotted}'={sp} (Ulysses sequence parallel) splits the packed row of a micro-batch; "
                              f"set '{packed}=true'")


def _check_paths(cfg):
    def exists(dotted, value):
        for item in ([value] if isinstance(value, str) else value):
            if isinstance(item, str) and not item.startswith("hdfs://") and not Path(item).expanduser().exists():
                raise ConfigError(f"config key '{dotted}': path '{item}' does not exist")

    exists("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    exists("data.train_files", cfg.data.train_files)
    if cfg.data.val_files:
        exists("data.val_files", cfg.data.val_files)
    if cfg.algorithm.adv_estimator == "gae":
        exists("critic.model.path", cfg.critic.model.path)
    if cfg.reward_model.enable:
        exists("reward_model.model.path", cfg.reward_model.model.path)
    if cfg.custom_reward_function.path:
        exists("custom_reward_function.path", cfg.custom_reward_function.path)
    if cfg.trainer.resume_mode == "resume_path":
        if not cfg.trainer.resume_from_path:
            raise ConfigError("trainer.resume_mode=resume_path needs 'trainer.resume_from_path' "
                              "(a .../global_step_N folder)")
        exists("trainer.resume_from_path", cfg.trainer.resume_from_path)


# ----------------------------------------------------------------------------------------------------------------
# Batch arithmetic (verl-semantics.md section 3.1)

def _micro_per_gpu(per_gpu, global_size, dp, dotted):
    if per_gpu is not None and global_size is not None:
        raise ConfigError(f"set only one of '{dotted}_per_gpu' and the deprecated '{dotted}'")
    if per_gpu is None and global_size is not None:
        if global_size % dp:
            raise ConfigError(f"'{dotted}'={global_size} must be divisible by the {dp} data-parallel ranks; "
                              f"prefer '{dotted}_per_gpu'")
        return global_size // dp
    return per_gpu


def batch_plan(cfg, world_size):
    """The step's batch arithmetic for `world_size` ranks; raises ConfigError where it does not divide."""
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    n = rollout.n
    dp, ref_dp = (_data_parallel(cfg, world_size, f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size")
                  for role in ("actor", "ref"))
    if cfg.trainer.n_gpus_per_node not in (None, world_size):
        raise ConfigError(f"'trainer.n_gpus_per_node'={cfg.trainer.n_gpus_per_node} but {world_size} processes "
                          f"were started; set it to {world_size} or null (torchrun's --nproc_per_node decides)")
    if rollout.name == "vllm" and world_size % rollout.tensor_model_parallel_size:
        raise ConfigError(f"'actor_rollout_ref.rollout.tensor_model_parallel_size'="
                          f"{rollout.tensor_model_parallel_size} does not divide the world size {world_size}")
    responses = data.train_batch_size * n
    if responses % world_size:
        raise ConfigError(f"data.train_batch_size * rollout.n = {data.train_batch_size}*{n} = {responses} responses "
                          f"must be divisible by the world size {world_size}; change 'data.train_batch_size'")
    if data.train_batch_size < actor.ppo_mini_batch_size:
        raise ConfigError(f"'data.train_batch_size'={data.train_batch_size} must be >= "
                          f"'actor_rollout_ref.actor.ppo_mini_batch_size'={actor.ppo_mini_batch_size}")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(f"'data.train_batch_size'={data.train_batch_size} must be a multiple of "
                          f"'actor_rollout_ref.actor.ppo_mini_batch_size'={actor.ppo_mini_batch_size}")
    if (actor.ppo_mini_batch_size * n) % dp:
        raise ConfigError(f"ppo_mini_batch_size * rollout.n = {actor.ppo_mini_batch_size * n} responses must be "
                          f"divisible by the {dp} data-parallel ranks")
    mini_per_rank = actor.ppo_mini_batch_size * n // dp
    micro = _micro_per_gpu(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size, dp,
                           "actor_rollout_ref.actor.ppo_micro_batch_size")
    if not actor.use_dynamic_bsz:
        if micro is None:
            raise ConfigError("set 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu' "
                              "(or use_dynamic_bsz=true with ppo_max_token_len_per_gpu)")
        if micro <= 0 or mini_per_rank % micro:
            raise ConfigError(f"the mini-batch per rank is ppo_mini_batch_size*n/dp = "
                              f"{actor.ppo_mini_batch_size}*{n}/{dp} = {mini_per_rank} responses, which "
                              f"'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu'={micro} must divide")
    max_len = data.max_prompt_length + data.max_response_length
    sp = world_size // dp
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu * sp < max_len:   # the budget covers sp devices
        raise ConfigError(f"'actor_rollout_ref.actor.ppo_max_token_len_per_gpu'={actor.ppo_max_token_len_per_gpu} "
                          f"(x ulysses_sequence_parallel_size {sp}) must be at least "
                          f"max_prompt_length + max_response_length = {max_len}")
    log_prob_micro = {}
    for worker, prefix, worker_dp in ((rollout, "actor_rollout_ref.rollout", dp),
                                      (ref, "actor_rollout_ref.ref", ref_dp)):
        size = _micro_per_gpu(worker.log_prob_micro_batch_size_per_gpu, worker.log_prob_micro_batch_size, worker_dp,
                              prefix + ".log_prob_micro_batch_size")
        if size is None and not worker.log_prob_use_dynamic_bsz:
            raise ConfigError(f"set '{prefix}.log_prob_micro_batch_size_per_gpu' (or log_prob_use_dynamic_bsz)")
        log_prob_micro[prefix] = size
    mini_batches = data.train_batch_size // actor.ppo_mini_batch_size
    plan = {
        "world_size": world_size, "dp": dp, "sp": sp, "responses_per_step": responses,
        "responses_per_rank": responses // dp, "mini_batches_per_step": mini_batches,
        "responses_per_mini_batch_per_rank": mini_per_rank,
        "micro_batch_per_rank": "dynamic" if actor.use_dynamic_bsz else micro,
        "micro_batches_per_mini_batch": "dynamic" if actor.use_dynamic_bsz else mini_per_rank // micro,
        "optimizer_steps_per_step": actor.ppo_epochs * mini_batches,
        "old_log_prob_micro_batch": log_prob_micro["actor_rollout_ref.rollout"],
        "ref_log_prob_micro_batch": log_prob_micro["actor_rollout_ref.ref"],
    }
    if cfg.algorithm.adv_estimator == "gae":
        plan.update(_critic_plan(cfg, _data_parallel(cfg, world_size, "critic.ulysses_sequence_parallel_size")))
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        # the reward model runs without sequence parallelism: data parallel over all ranks
        plan["reward_model_micro_batch"] = _micro_per_gpu(rm.micro_batch_size_per_gpu, rm.micro_batch_size, world_size,
                                                          "reward_model.micro_batch_size")
        if plan["reward_model_micro_batch"] is None and not rm.use_dynamic_bsz:
            raise ConfigError("set 'reward_model.micro_batch_size_per_gpu' (or reward_model.use_dynamic_bsz)")
    return plan


def _data_parallel(cfg, world_size, sp_key):
    """A worker's data-parallel size: world / its ulysses_sequence_parallel_size (verl's dp with sp)."""
    sp = _get(cfg, sp_key)
    if world_size % sp:
        raise ConfigError(f"'{sp_key}'={sp} must divide the world size {world_size} (groups of sp consecutive "
                          f"ranks share one data-parallel share of the batch)")
    return world_size // sp


def _critic_plan(cfg, dp):
    """The critic's own mini/micro batches: ppo_mini_batch_size prompts x critic.rollout_n responses."""
    critic = cfg.critic
    mini = critic.ppo_mini_batch_size * critic.rollout_n
    if mini % dp:
        raise ConfigError(f"critic.ppo_mini_batch_size * rollout.n = {mini} responses must be divisible by the "
                          f"{dp} data-parallel ranks")
    if cfg.data.train_batch_size % critic.ppo_mini_batch_size:
        raise ConfigError(f"'data.train_batch_size'={cfg.data.train_batch_size} must be a multiple of "
                          f"'critic.ppo_mini_batch_size'={critic.ppo_mini_batch_size}")
    micro = _micro_per_gpu(critic.ppo_micro_batch_size_per_gpu, critic.ppo_micro_batch_size, dp,
                           "critic.ppo_micro_batch_size")
    if not critic.use_dynamic_bsz and (micro is None or micro <= 0 or (mini // dp) % micro):
        raise ConfigError(f"the critic's mini-batch per rank is {mini // dp} responses; set "
                          f"'critic.ppo_micro_batch_size_per_gpu' to a divisor of it (or critic.use_dynamic_bsz)")
    forward = critic.forward_micro_batch_size_per_gpu or micro
    return {"critic_dp": dp, "critic_responses_per_mini_batch_per_rank": mini // dp, "critic_micro_batch": micro,
            "critic_forward_micro_batch": forward}


def total_training_steps(cfg, batches_per_epoch):
    """verl: len(dataloader) * total_epochs, unless trainer.total_training_steps is set."""
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    return batches_per_epoch * cfg.trainer.total_epochs


def format_plan(plan, steps=None):
    lines = ["batch plan:",
             f"  world size {plan['world_size']} (data-parallel {plan['dp']} x sequence-parallel {plan['sp']})",
             f"  responses per step {plan['responses_per_step']} (train_batch_size x n), "
             f"per rank {plan['responses_per_rank']}",
             f"  mini-batches per step {plan['mini_batches_per_step']}, "
             f"{plan['responses_per_mini_batch_per_rank']} responses per rank each",
             f"  micro-batches per mini-batch {plan['micro_batches_per_mini_batch']} "
             f"(micro batch {plan['micro_batch_per_rank']} per rank)",
             f"  optimizer steps per training step {plan['optimizer_steps_per_step']} (ppo_epochs x mini-batches)"]
    if steps is not None:
        lines.append(f"  training steps {steps}, optimizer steps in total {steps * plan['optimizer_steps_per_step']}")
    return "\n".join(lines)

