"""verl v0.5.0's own trainer config (tests/data/verl, copied unchanged from the release) through minirl's loader,
and verl's `${...}` interpolations resolved as OmegaConf resolves them (hand-worked cases)."""
import copy
import hashlib
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config import ConfigError, load_config, settings_without_effect
from to_verl import to_verl
from interpolation import resolve_interpolations
from test_config import ROOT, _parse_verl_line, minimal, paths, write  # noqa: F401  (paths is a fixture)
from verl_keys import VERL_DEFAULTS

VERL_YAML = ROOT / "tests" / "data" / "verl" / "_generated_ppo_trainer.yaml"
VERL_YAML_SHA256 = "2038dd7a3a264d3f66176dbdc277a71ced22e3e7da474392807daf1ab8e4cb2f"   # tests/data/verl/README.md


def _leaves(tree, prefix=""):
    """{dotted key: value} for every leaf (an empty mapping is a leaf)."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            found.update(_leaves(value, f"{prefix}{key}."))
        else:
            found[prefix + key] = value
    return found


def test_the_shipped_file_is_verls_unchanged():
    assert hashlib.sha256(VERL_YAML.read_bytes()).hexdigest() == VERL_YAML_SHA256


def test_verl_keys_holds_exactly_the_keys_and_defaults_of_verls_file():
    raw = yaml.safe_load(VERL_YAML.read_text())
    assert raw["critic"]["rollout_n"] == "${oc.select:actor_rollout_ref.rollout.n,1}"      # shipped unresolved
    resolved = _leaves(resolve_interpolations(copy.deepcopy(raw)))
    ours = _leaves(VERL_DEFAULTS)
    assert sorted(set(resolved) - set(ours)) == [] and sorted(set(ours) - set(resolved)) == []
    assert {key: value for key, value in resolved.items() if ours[key] != value} == {}
    # a few resolved by hand from the file's text
    assert resolved["trainer.default_local_dir"] == "checkpoints/verl_examples/gsm8k"
    assert resolved["critic.model.tokenizer_path"] == "~/models/deepseek-llm-7b-chat"
    assert resolved["reward_model.forward_max_token_len_per_gpu"] == 32768    # -> critic's -> critic.ppo_max_...
    assert resolved["actor_rollout_ref.actor.checkpoint.load_contents"] == ["model", "optimizer", "extra"]


def _user_overrides(paths):
    """What a verl user adds to the file on the command line: their model and data, micro-batches (verl's file
    leaves them null), and a few values the file's interpolations must follow."""
    return [f"actor_rollout_ref.model.path={paths['model']}", f"critic.model.path={paths['model']}",
            f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=128", "data.max_prompt_length=256",
            "trainer.project_name=p", "actor_rollout_ref.actor.use_dynamic_bsz=true"]


def test_verls_file_loads_unchanged_and_plans_for_its_8_ranks(paths):
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(VERL_YAML), "--print-config",
                          *_user_overrides(paths)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout.split("\nplanning for")[0])
    arr, critic, rm = printed["actor_rollout_ref"], printed["critic"], printed["reward_model"]
    # the file's interpolations, resolved after the overrides (as OmegaConf resolves them, lazily)
    assert critic["ppo_mini_batch_size"] == 128 and arr["rollout"]["prompt_length"] == 256
    assert critic["model"]["tokenizer_path"] == paths["model"] == rm["model"]["input_tokenizer"]
    assert critic["use_dynamic_bsz"] is True and rm["use_dynamic_bsz"] is True           # -> critic's -> actor's
    assert arr["ref"]["log_prob_use_dynamic_bsz"] is True and arr["rollout"]["log_prob_use_dynamic_bsz"] is True
    assert printed["trainer"]["default_local_dir"] == "checkpoints/p/gsm8k"
    assert critic["forward_max_token_len_per_gpu"] == 32768 and arr["ref"]["strategy"] == "fsdp"
    assert "planning for world size 8 (trainer.nnodes x trainer.n_gpus_per_node = 1 x 8)" in out.stdout
    # 1024 prompts x n=1 over 8 ranks = 128 per rank; mini-batch 128 / 8 = 16 per rank -> 8 mini-batches per step
    assert "responses per step 1024 (train_batch_size x n), per rank 128" in out.stdout
    assert "mini-batches per step 8, 16 responses per rank each" in out.stdout


def test_verls_defaults_warn_about_nothing(paths):
    cfg = load_config(VERL_YAML, _user_overrides(paths), world_size=8)
    assert settings_without_effect(cfg) == []


def test_to_verl_round_trips_verls_own_file(paths):
    original = load_config(VERL_YAML, _user_overrides(paths), world_size=8)
    verl_args, minirl_only = _parse_verl_line(to_verl(original))
    assert load_config(None, verl_args + minirl_only, world_size=8) == original


# ----------------------------------------------------------------------------------------------------------------
# Interpolations, by hand

def test_interpolation_forms():
    tree = {"a": {"x": 3, "n": None, "s": "text", "l": [1, 2], "missing": "???",
                  "absolute": "${a.x}", "relative": "${.x}", "up": "${..b.y}", "in_text": "run-${a.x}-${.s}/${a.n}",
                  "select": "${oc.select:a.x,7}", "select_absent": "${oc.select:a.nope,7}",
                  "select_null": "${oc.select:a.n,7}", "select_missing": "${oc.select:a.missing,7}",
                  "select_no_default": "${oc.select:a.nope}", "select_quoted": '${oc.select:a.nope,"x,y"}',
                  "select_list": "${oc.select:a.nope,[]}", "select_bool": "${oc.select:a.nope,false}",
                  "select_word": "${oc.select:a.nope,token-mean}", "select_relative": "${oc.select:.x,0}",
                  "chain": "${a.absolute}", "list": "${.l}"},
            "b": {"y": "${a.chain}", "items": ["${a.x}", 5], "section": "${a.l}"}}
    resolve_interpolations(tree)
    a = tree["a"]
    assert (a["absolute"], a["relative"], a["up"], a["chain"], tree["b"]["y"]) == (3, 3, 3, 3, 3)
    assert a["in_text"] == "run-3-text/None"                 # text around interpolations: str() of each value
    assert (a["select"], a["select_absent"], a["select_null"], a["select_missing"]) == (3, 7, None, 7)
    assert (a["select_no_default"], a["select_quoted"], a["select_list"]) == (None, "x,y", [])
    assert (a["select_bool"], a["select_word"], a["select_relative"]) == (False, "token-mean", 3)
    assert tree["b"]["items"] == [3, 5]
    a["list"].append(9)                                      # a copy, not the same list
    assert a["l"] == [1, 2] and tree["b"]["section"] == [1, 2]


@pytest.mark.parametrize("value, message", [
    ("${a.nope}", r"config key 'b.bad' = '\$\{a.nope\}' \(the test\): 'a.nope' is not a key of the config"),
    ("${oc.env:HOME}", r"'b.bad' .*the resolver 'oc.env' is not one minirl resolves"),
    ("${oc.select:a.x,${a.x}}", r"'b.bad' .*nested in one another"),
    ("x ${a.x", r"'b.bad' .*left unclosed"),
    ("${...x}", r"'b.bad' .*'...x' goes up past the top of the config"),
    ("${a x}", r"'b.bad' .*'a x' is not a key like a.b.c"),
    ("${oc.select:a.nope,{k: 1}}", r"'b.bad' .*nested in one another"),
    ("x\\${a.x}", r"'b.bad' .*escaped interpolations"),
])
def test_interpolation_errors_name_the_key_and_the_expression(value, message):
    with pytest.raises(ConfigError, match=message):
        resolve_interpolations({"a": {"x": 1}, "b": {"bad": value}}, "the test")


def test_interpolations_that_refer_to_each_other_are_an_error():
    with pytest.raises(ConfigError, match=r"refer to each other: a.p -> b.q -> a.p"):
        resolve_interpolations({"a": {"p": "${b.q}"}, "b": {"q": "${a.p}"}})
    with pytest.raises(ConfigError, match=r"refer to each other: a.p -> a.p"):
        resolve_interpolations({"a": {"p": "${.p}"}})


def test_interpolation_bombs_are_refused():
    """Each level refers to the one below ten times: 10^6 values (or characters) from a few lines of yaml."""
    lists, texts = {"l0": list(range(10))}, {"t0": "x" * 10}
    for level in range(1, 7):
        lists[f"l{level}"] = [f"${{l{level - 1}}}"] * 10
        texts[f"t{level}"] = f"${{t{level - 1}}}" * 10
    with pytest.raises(ConfigError, match=r"more than 100000 values once its interpolations are resolved"):
        resolve_interpolations(lists)
    with pytest.raises(ConfigError, match=r"config key 't6' .* resolves to more than 1048576 characters"):
        resolve_interpolations(texts)


def test_interpolations_follow_overrides_and_are_type_checked(paths):
    select = "${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}"
    tree = minimal(paths, critic={"ppo_mini_batch_size": select},
                   trainer={"experiment_name": "${trainer.project_name}-grpo"},
                   actor_rollout_ref__rollout__response_length="${backend_config.data.max_response_length}")
    cfg = load_config(write(paths, tree), ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.project_name=p",
                                           "data.max_response_length=64"], world_size=2)
    assert cfg.critic.ppo_mini_batch_size == 8                # the override, not the yaml's 4
    assert cfg.trainer.experiment_name == "p-grpo" and cfg.actor_rollout_ref.rollout.response_length == 64
    cfg = load_config(write(paths, minimal(paths)), ["+trainer.experiment_name=${data.train_batch_size}x"],
                      world_size=2)
    assert cfg.trainer.experiment_name == "8x"               # an override may hold one too
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.ppo_epochs' must be int, got '/"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.ppo_epochs=${data.train_files}"])


# verl's Ascend GRPO example (examples/grpo_trainer/run_qwen3-8b_npu.sh): its overrides as typed, paths replaced
VERL_NPU_EXAMPLE = (
    "algorithm.adv_estimator=grpo data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 "
    "data.filter_overlong_prompts=True data.truncation='error' actor_rollout_ref.actor.optim.lr=1e-6 "
    "actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=64 "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10 actor_rollout_ref.actor.use_kl_loss=True "
    "actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl "
    "actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.use_torch_compile=False "
    "actor_rollout_ref.ref.use_torch_compile=False actor_rollout_ref.model.enable_gradient_checkpointing=True "
    "actor_rollout_ref.actor.fsdp_config.param_offload=False "
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 "
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2 "
    "actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 "
    "actor_rollout_ref.rollout.n=5 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 "
    "actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0 "
    "trainer.logger='[\"console\",\"wandb\"]' trainer.project_name=\"GRPO\" "
    "trainer.experiment_name=\"GRPO-Qwen3-8B-npu\" "
    "trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.device=npu trainer.resume_mode=auto "
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True actor_rollout_ref.ref.fsdp_config.forward_prefetch=True "
    "++actor_rollout_ref.actor.entropy_from_logits_with_chunking=True "
    "++actor_rollout_ref.ref.entropy_from_logits_with_chunking=True trainer.val_before_train=True trainer.save_freq=5 "
    "trainer.test_freq=5 trainer.total_epochs=15")


def print_config_through_a_shell(arguments):
    """`python minirl.py <arguments> --print-config` as a shell reads the line (its quoting): (stdout, config)."""
    command = f"{shlex.quote(sys.executable)} minirl.py --print-config {arguments}"
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout, yaml.safe_load(out.stdout.split("\nplanning for")[0])


def test_verls_ascend_example_line_on_verls_file_through_a_shell(paths):
    """Hydra's `++` (force-add), quoted lists and strings, trainer.device=npu, on top of verl's own file."""
    mine = (f"actor_rollout_ref.model.path={paths['model']} data.train_files={paths['train']} "
            f"data.val_files={paths['val']}")
    stdout, printed = print_config_through_a_shell(f"--config {shlex.quote(str(VERL_YAML))} {VERL_NPU_EXAMPLE} "
                                                   f"{mine}")
    arr = printed["actor_rollout_ref"]
    assert arr["actor"]["entropy_from_logits_with_chunking"] is True and arr["ref"]["use_torch_compile"] is False
    assert printed["trainer"]["logger"] == ["console", "wandb"] and printed["trainer"]["device"] == "npu"
    assert printed["trainer"]["default_local_dir"] == "checkpoints/GRPO/GRPO-Qwen3-8B-npu"   # the file's ${...}
    assert printed["critic"]["rollout_n"] == 5 and arr["rollout"]["response_length"] == 1024
    # 256 prompts x 5 = 1280 responses over 8 ranks = 160 each; mini-batch 64 x 5 / 8 = 40 per rank, micro 10 -> 4
    assert "planning for world size 8 (trainer.nnodes x trainer.n_gpus_per_node = 1 x 8)" in stdout
    assert "responses per step 1280 (train_batch_size x n), per rank 160" in stdout
    assert "micro-batches per mini-batch 4 (micro batch 10 per rank)" in stdout


def test_fsdp_keys_follow_verls_roles(paths):
    """verl's ref and reward model have no optimizer (nor, for ref, fsdp_size): those keys are unknown there, as in
    verl; model_dtype and mixed_precision (a mapping), which verl's workers read undeclared, load and go to verl
    with Hydra's '+'."""
    for key in ("actor_rollout_ref.ref.fsdp_config.optimizer_offload", "actor_rollout_ref.ref.fsdp_config.fsdp_size",
                "reward_model.model.fsdp_config.offload_policy"):
        with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
            load_config(write(paths, minimal(paths)), [f"{key}=true"], world_size=2)
    mixed = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
    overrides = [f"+{mixed}.param_dtype=fp32", "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32"]
    cfg = load_config(write(paths, minimal(paths)), overrides, world_size=2)
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision == {"param_dtype": "fp32"}
    verl_args, minirl_only = _parse_verl_line(to_verl(cfg))
    assert f"+{mixed}={{param_dtype: fp32}}" in verl_args
    assert "+actor_rollout_ref.ref.fsdp_config.model_dtype=fp32" in verl_args
    assert load_config(None, verl_args + minirl_only, world_size=2) == cfg


def config_folder(paths, **yamls):
    """A --config-path folder holding yaml files ({file stem: text})."""
    folder = paths["dir"] / "config"
    folder.mkdir()
    for stem, text in yamls.items():
        (folder / f"{stem}.yaml").write_text(text)
    return folder


# the micro-batch sizes the example runs below are scaled to (2 ranks, the tiny model)
SCALED_MICRO_BATCHES = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 "
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 "
                        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8")


# The Hydra settings and defaults list that verl's example and recipe yamls open with
VERL_YAML_HEADER = """\
hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_
"""


# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml, verbatim (not pinned to v0.5.0): Hydra's
# settings and defaults list, then the values it changes
VERL_MULTITURN_YAML = VERL_YAML_HEADER + """
data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""


# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo_w_interaction.yaml, verbatim (not pinned to v0.5.0)
VERL_INTERACTION_YAML = VERL_MULTITURN_YAML.replace("      max_assistant_turns: 5\n", """\
      max_user_turns: 5
      format: qwen
      # tool_config_path: "./config/tool_config/gsm8k_tool_config.yaml"
""")


def test_verls_interaction_yaml_and_run_script_keys_load(paths):
    """verl's run_qwen2.5-3b_gsm8k_multiturn_w_interaction.sh on its w_interaction yaml (SGLang's `format: qwen`,
    max_user_turns) with verl's gsm8k interaction yaml: the config loads, the interaction yaml is checked; with the
    interaction class misspelt it is a config error naming the key."""
    from test_agent import VERL_GSM8K_INTERACTION_YAML
    folder = config_folder(paths, gsm8k_multiturn_grpo_w_interaction=VERL_INTERACTION_YAML,
                           gsm8k_interaction_config=VERL_GSM8K_INTERACTION_YAML)
    script = (f"algorithm.adv_estimator=grpo data.train_batch_size=512 data.max_prompt_length=1024 "
              f"data.max_response_length=$((1024 * 3)) data.filter_overlong_prompts=True data.truncation='error' "
              f"data.return_raw_chat=True actor_rollout_ref.model.path={paths['model']} "
              f"actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=512 "
              f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=True "
              f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.name=vllm "
              f"actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.n=8 "
              f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 trainer.n_gpus_per_node=8 "
              f"data.train_files={paths['train']} data.val_files={paths['val']} "
              f"actor_rollout_ref.rollout.multi_turn.interaction_config_path="
              f"\"{folder}/gsm8k_interaction_config.yaml\"")
    _, printed = print_config_through_a_shell(
        f"--config-path=\"{folder}\" --config-name='gsm8k_multiturn_grpo_w_interaction' {script}")
    multi_turn = printed["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert (multi_turn["enable"], multi_turn["format"], multi_turn["max_user_turns"]) == (True, "qwen", 5)
    assert multi_turn["interaction_config_path"] == f"{folder}/gsm8k_interaction_config.yaml"
    (folder / "gsm8k_interaction_config.yaml").write_text(VERL_GSM8K_INTERACTION_YAML.replace("Gsm8kInteraction",
                                                                                              "Gsm8kInteractoin"))
    bad = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} minirl.py --print-config --config-path="
                          f"\"{folder}\" --config-name=gsm8k_multiturn_grpo_w_interaction {script}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and "config error: actor_rollout_ref.rollout.multi_turn.interaction_config_path" in \
        bad.stderr and "Gsm8kInteractoin" in bad.stderr, bad.stderr


# verl's examples/sglang_multiturn/config/geo3k_multiturn_grpo.yaml, verbatim (not pinned to v0.5.0): the gsm8k one
# with longer lengths and `max_turns`, which is not a key of verl v0.5.0's tree (Hydra's composition loads it anyway)
VERL_GEO3K_MULTITURN_YAML = VERL_MULTITURN_YAML.replace(": 1024", ": 2048").replace("      max_assistant_turns: 5\n", """\
      max_turns: 5
      # tool_config_path: "./config/tool_config/gsm8k_tool_config.yaml"
""")


def test_verls_geo3k_multiturn_yaml_and_run_script_keys_load_with_what_has_no_effect_named(paths):
    """verl's run_qwen2.5-3b_geo3k_multiturn.sh on its yaml and verl's geo3k tool yaml, the engine swapped: the
    yaml's `max_turns` loads, as verl loads it, and the script's chat template (quoted as the script quotes it,
    shortened), which goes to `override_config` (the model's config, not the prompts' template), loads; each is
    named in a warning, and the turn limits stay verl's."""
    from test_vision import VERL_GEO3K_TOOL_YAML
    folder = config_folder(paths, geo3k_multiturn_grpo=VERL_GEO3K_MULTITURN_YAML,
                           geo3k_tool_config=VERL_GEO3K_TOOL_YAML)
    template = ("'+actor_rollout_ref.model.override_config.chat_template="
                "\"{%- if tools %}{{- \\\"<|im_start|>system\\\\n\\\" }}{%- endif %}\"'")
    script = (f"algorithm.adv_estimator=grpo data.train_batch_size=256 data.max_prompt_length=2048 "
              f"data.max_response_length=2048 data.filter_overlong_prompts=True data.truncation='error' "
              f"data.return_raw_chat=True actor_rollout_ref.model.path={paths['model']} {template} "
              f"actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True "
              f"actor_rollout_ref.actor.ppo_mini_batch_size=256 "
              f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 "
              f"actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_type=low_var_kl "
              f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.name=vllm "
              f"actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.n=16 "
              f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 trainer.n_gpus_per_node=8 "
              f"data.train_files={paths['train']} data.val_files={paths['val']} "
              f"actor_rollout_ref.rollout.multi_turn.tool_config_path=\"{folder}/geo3k_tool_config.yaml\"")
    out = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} minirl.py --print-config --config-path="
                          f"\"{folder}\" --config-name='geo3k_multiturn_grpo' {script}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout.split("\nplanning for")[0])
    multi_turn = printed["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert (multi_turn["max_turns"], multi_turn["max_assistant_turns"], multi_turn["max_user_turns"]) == (5, None, None)
    assert "{{- \"<|im_start|>system" in printed["actor_rollout_ref"]["model"]["override_config"]["chat_template"]
    assert "'actor_rollout_ref.rollout.multi_turn.max_turns'=5 has no effect in minirl" in out.stderr
    assert "'actor_rollout_ref.model.override_config.chat_template' sets an attribute of the model's config" in \
        out.stderr and "set actor_rollout_ref.model.custom_chat_template" in out.stderr


def test_verls_multiturn_yaml_through_config_path_and_name_as_its_run_script_passes_them(paths):
    """verl's run script: `main_ppo --config-path="$CONFIG_PATH" --config-name='gsm8k_multiturn_grpo' ...`. The
    file's values land on verl's defaults; the command line still overrides the file (sglang -> vllm)."""
    folder = config_folder(paths, gsm8k_multiturn_grpo=VERL_MULTITURN_YAML)
    mine = (f"algorithm.adv_estimator=grpo actor_rollout_ref.rollout.name=vllm "
            f"actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.model.path={paths['model']} "
            f"data.train_files={paths['train']} data.val_files={paths['val']} {SCALED_MICRO_BATCHES}")
    _, printed = print_config_through_a_shell(f"--config-path=\"{folder}\" --config-name='gsm8k_multiturn_grpo' {mine}")
    assert printed["data"]["train_batch_size"] == 256 and printed["data"]["return_raw_chat"] is True
    assert printed["actor_rollout_ref"]["rollout"]["multi_turn"]["max_assistant_turns"] == 5
    assert printed["actor_rollout_ref"]["rollout"]["name"] == "vllm"                      # the override won
    assert printed["actor_rollout_ref"]["actor"]["kl_loss_coef"] == VERL_DEFAULTS["actor_rollout_ref"]["actor"][
        "kl_loss_coef"]                                                                     # verl's, untouched
    assert "hydra" not in printed and "defaults" not in printed
    # the same through Hydra's short flags, with the extension; and the file's own sglang without the override
    bad = subprocess.run([sys.executable, "minirl.py", "-cp", str(folder), "-cn", "gsm8k_multiturn_grpo.yaml",
                          "--print-config", *mine.replace("rollout.name=vllm", "rollout.n=5").split()],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert bad.returncode == 2 and "'actor_rollout_ref.rollout.name' is 'sglang'" in bad.stderr


def test_defaults_list_order_is_hydras(paths):
    """Later layers win; the file's own keys stand where `_self_` does, last when it is not listed; a name is a
    yaml beside the file or in a file:// search folder; `ppo_trainer` is verl's trainer config (the defaults)."""
    (paths["dir"] / "base.yaml").write_text(yaml.safe_dump(
        {"data": {"train_batch_size": 16, "max_prompt_length": 300}, "trainer": {"seed": 7}}))
    shared = paths["dir"] / "shared"
    shared.mkdir()
    (shared / "seeds.yaml").write_text(yaml.safe_dump({"defaults": ["_self_"], "trainer": {"seed": 9}}))
    tree = minimal(paths)["backend_config"]                              # train_batch_size 8 in the file itself

    def load(defaults, **hydra):
        return load_config(write(paths, {**({"hydra": hydra} if hydra else {}), "defaults": defaults, **tree}),
                           world_size=2)
    cfg = load(["base", "_self_"])
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.trainer.seed) == (8, 300, 7)
    cfg = load(["_self_", "base"])
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length) == (16, 300)
    cfg = load(["base"])                                                  # _self_ implied last
    assert cfg.data.train_batch_size == 8
    cfg = load(["base", "seeds", "_self_"], searchpath=[f"file://{shared}", "pkg://verl.trainer.config"])
    assert (cfg.trainer.seed, cfg.data.max_prompt_length) == (9, 300)
    with pytest.raises(ConfigError, match="adv_estimator=gae needs a critic"):
        load(["_self_", "ppo_trainer"])             # verl's defaults over the file: its grpo back to verl's gae


@pytest.mark.parametrize("defaults, hydra, message", [
    (["actor@actor_rollout_ref.actor: dp_actor"], None, "is a Hydra config group"),
    ([{"rollout@actor_rollout_ref.rollout": "rollout"}], None, "is a Hydra config group"),
    (["override data: legacy_data"], None, "is a Hydra config group"),
    (["nowhere", "_self_"], None, "no 'nowhere.yaml' in"),
    (["x" * 1000], None, "cannot be used: File name too long"),
    ([3], None, "defaults entry 3 is not a config name"),
    (["_self_", "_self_"], None, "'_self_' appears 2 times"),
    ("ppo_trainer", None, "'defaults' must be a list"),
    (["_self_"], {"searchpath": "file://x"}, "'hydra.searchpath' must be a list"),
    (["loop"], None, "a cycle through"),
    (["cfg"], None, "defaults entry 'cfg' includes a file that includes it"),          # the file itself
])
def test_defaults_list_errors_name_the_entry(paths, defaults, hydra, message):
    (paths["dir"] / "loop.yaml").write_text(yaml.safe_dump({"defaults": ["cfg"]}))      # cfg.yaml is the file below
    tree = {**({"hydra": hydra} if hydra else {}), "defaults": defaults, **minimal(paths)["backend_config"]}
    with pytest.raises(ConfigError, match=message):
        load_config(write(paths, tree), world_size=2)


def test_config_path_and_name_flags(paths):
    from config import config_file_path
    assert config_file_path(None, "conf", "run") == str(Path("conf") / "run.yaml")
    assert config_file_path(None, None, "run.yaml") == "run.yaml"
    assert config_file_path(None, "anywhere", "ppo_trainer") is None                 # verl's trainer config
    with pytest.raises(ConfigError, match="needs --config-name"):
        config_file_path(None, "conf", None)
    with pytest.raises(ConfigError, match="name two files"):
        config_file_path("a.yaml", "conf", "run")


def test_config_name_ppo_trainer_reads_a_flat_copy_not_verls_composed_file(paths):
    """--config-path DIR --config-name ppo_trainer: verl's own trainer config there (it composes Hydra config
    groups) means minirl's defaults, as before; a user's flat copy of it, edited, is read (it was ignored)."""
    from config import config_file_path
    verls, users = paths["dir"] / "verl_config", paths["dir"] / "my_config"
    verls.mkdir()
    users.mkdir()
    (verls / "ppo_trainer.yaml").write_text(yaml.safe_dump(
        {"defaults": [{"actor@actor_rollout_ref.actor": "dp_actor"}, "_self_"], "data": {"max_prompt_length": 77}}))
    assert config_file_path(None, str(verls), "ppo_trainer") is None
    edited = minimal(paths)["backend_config"]
    edited["data"]["max_prompt_length"] = 77
    (users / "ppo_trainer.yaml").write_text(yaml.safe_dump(edited))
    path = config_file_path(None, str(users), "ppo_trainer")
    assert path == str(users / "ppo_trainer.yaml")
    assert load_config(path, world_size=2).data.max_prompt_length == 77


# verl v0.5.0's recipe/dapo/config/dapo_trainer.yaml (Apache-2.0, tests/data/verl/LICENSE), which main_dapo loads
DAPO_RECIPE_YAML = "\n" + VERL_YAML_HEADER + """
data:
  gen_batch_size: ${data.train_batch_size}

reward_model:
  reward_manager: dapo
  overlong_buffer:
    enable: False # We try to avoid forgetting to set enable
    len: 0
    penalty_factor: 0.0
    log: False

algorithm:
  filter_groups:
    _target_: verl.trainer.config.FilterGroupsConfig
    enable: False # We try to avoid forgetting to set enable
    metric: null # acc / score / seq_reward / seq_final_reward / ...
    max_num_gen_batches: 0 # Non-positive values mean no upper limit

trainer:
  project_name: verl-dapo
"""


def test_dapos_recipe_yaml_and_run_script_keys_load_as_main_dapo_reads_them(paths):
    """DAPO's run scripts: `main_dapo` (its yaml composed over verl's trainer config) with data.gen_batch_size,
    algorithm.filter_groups.* and reward_model.overlong_buffer.* set on the command line; gen_batch_size follows
    train_batch_size through the file's interpolation when not set. The scripts' `offload=True` goes to the actor's
    and the reference's offload switches, which load and are read."""
    folder = config_folder(paths, dapo_trainer=DAPO_RECIPE_YAML)
    mine = (f"actor_rollout_ref.model.path={paths['model']} data.train_files={paths['train']} "
            f"data.val_files={paths['val']} algorithm.adv_estimator=grpo data.train_batch_size=8 "
            f"actor_rollout_ref.rollout.n=2 actor_rollout_ref.actor.ppo_mini_batch_size=4 {SCALED_MICRO_BATCHES} "
            f"trainer.n_gpus_per_node=2")
    _, printed = print_config_through_a_shell(f"--config-path={folder} --config-name=dapo_trainer {mine}")
    assert printed["data"]["gen_batch_size"] == 8 and printed["reward_model"]["reward_manager"] == "dapo"
    assert printed["algorithm"]["filter_groups"]["enable"] is False
    script = ("data.gen_batch_size=24 algorithm.filter_groups.enable=True algorithm.filter_groups.metric=acc "
              "algorithm.filter_groups.max_num_gen_batches=10 reward_model.overlong_buffer.enable=True "
              "reward_model.overlong_buffer.len=128 reward_model.overlong_buffer.penalty_factor=1.0 "
              "actor_rollout_ref.actor.fsdp_config.param_offload=True "
              "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True "
              "actor_rollout_ref.ref.fsdp_config.param_offload=True")
    stdout, printed = print_config_through_a_shell(f"--config-path={folder} --config-name=dapo_trainer {mine} {script}")
    assert printed["reward_model"]["overlong_buffer"] == {"enable": True, "len": 128, "penalty_factor": 1.0,
                                                          "log": False}
    actor = printed["actor_rollout_ref"]["actor"]["fsdp_config"]
    assert actor["param_offload"] is actor["optimizer_offload"] is True
    assert printed["actor_rollout_ref"]["ref"]["fsdp_config"]["param_offload"] is True
    assert "dynamic sampling: batches of 24 prompts (data.gen_batch_size) until 8 prompts' responses differ" in stdout
