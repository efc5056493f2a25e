"""LoRA (lora.py, actor_rollout_ref.model.lora_rank > 0): only the adapter trains and the base stays bit-identical
to model.path; the reference is the base model (adapter disabled); vLLM (both load formats) and the hf engine
generate with the synced adapter, and a stale adapter is caught; GRPO on 2 ranks with both engines; kill + resume
equals the uninterrupted run; the exported adapter (peft) and merged model give the trained policy's log-probs;
config errors before any model loads.
"""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import lora
from config import ConfigError, load_config
from launch import ROOT, assert_resumed, torchrun, torchrun_cmd
from test_checkpoint import (data_file, hand_logprobs, kill_after_step_2_checkpoint, metric_rows,  # noqa: F401
                             probe_batch, run, run_overrides, train)
from test_config import minimal, paths, write  # noqa: F401
from test_trainer import VERL_NAMES

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed: run `bash setup.sh`")

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.actor.optim.lr=1e-2"]


def masked_max_abs(a, b, mask):
    return float((a - b)[mask.bool()].abs().max())


# ---------------------------------------------------------------------------------------------------------------
# The actor, its reference and both engines, on 2 ranks (tests/lora_sync_check.py)


@pytest.fixture(scope="module", params=[("dummy_dtensor", 2), ("safetensors", 1)], ids=["dummy-tp2", "safetensors-tp1"])
def sync_records(request, tiny_model_dir, tmp_path_factory):
    load_format, tp = request.param
    out = tmp_path_factory.mktemp(f"lora_sync_{load_format}")
    torchrun(2, "tests/lora_sync_check.py", tiny_model_dir, out / "records.pt", load_format, tp, out / "run")
    return load_format, torch.load(out / "records.pt", weights_only=False)


@needs_vllm
def test_vllm_generates_with_the_synced_adapter_and_a_stale_one_is_caught(sync_records):
    load_format, records = sync_records
    for record in records:
        # dummy: vLLM started with random weights, so the first sync had to bring the base weights too
        assert record["base_loaded_at_start"] == (load_format == "safetensors")
        for phase in ("before", "after"):
            r = record[phase]
            assert int(r["mask"].sum()) >= 8
            assert masked_max_abs(r["vllm"], r["actor"], r["mask"]) < 1e-4, phase
        # sampled after the step but before the sync: vLLM still serves the old adapter, and the check says so
        stale = record["stale"]
        assert masked_max_abs(stale["vllm"], stale["actor"], stale["mask"]) > 1e-2
        assert record["lora_id"] == 2                                   # a fresh LoRA id per sync


@needs_vllm     # the probe builds a vLLM engine too
def test_hf_engine_generates_with_the_synced_adapter(sync_records):
    _, records = sync_records
    record = records[0]
    mask = record["after"]["mask"]
    assert masked_max_abs(record["hf_after"], record["after"]["actor"], mask) < 1e-5
    # before its second sync the hf copy still held the first adapter: the pre-update actor's log-probs
    assert masked_max_abs(record["hf_stale"], record["before"]["actor"], record["before"]["mask"]) < 1e-5


@needs_vllm     # the probe builds a vLLM engine too
def test_only_the_adapter_trains_and_the_base_stays_bit_identical(sync_records):
    _, records = sync_records
    for record in records:
        assert record["base_names_match"]
        assert record["base_differs"] == []                              # torch.equal with model.safetensors
        assert record["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in record["trainable"])
        # tiny model: 2 layers x 7 linear layers (q k v o gate up down) x (A, B)
        assert len(record["adapter_names"]) == len(record["trainable"]) == record["optimized"] == 28
        assert record["adapter_changed"] == record["adapter_names"]


@needs_vllm     # the probe builds a vLLM engine too
def test_reference_is_the_base_model_exactly(sync_records):
    _, records = sync_records
    for record in records:
        assert torch.equal(record["ref"], record["frozen"])       # adapter disabled == a plain FSDP2 copy of the base
        mask = record["after"]["mask"]
        assert masked_max_abs(record["ref"], record["after"]["actor"], mask) > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# GRPO end to end: hf engine with checkpoints (the resume and export tests reuse it), vLLM


HF_LORA = [*LORA, "actor_rollout_ref.rollout.name=hf"]


@pytest.fixture(scope="module")
def lora_run(demo_dir, data_file, tmp_path_factory):  # noqa: F811
    """5 GRPO steps with LoRA on 2 ranks, hf engine, KL loss (so a reference), checkpoints at 2, 4, 5."""
    out = tmp_path_factory.mktemp("lora_run")
    result = train(demo_dir, data_file, out, *HF_LORA)
    return {"dir": out, "stdout": result.stdout}


def test_grpo_with_lora_on_the_hf_engine(lora_run, demo_dir):
    rows = metric_rows(lora_run["dir"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        missing = [name for name in VERL_NAMES if name not in row and not name.startswith(("timing", "perf"))]
        assert not missing, missing
    assert lora_run["stdout"].count("16,384 trainable of 123,456 parameters") == 1      # logged once, by rank 0
    step = lora_run["dir"] / "checkpoints" / "global_step_5"
    adapter = load_file(step / "actor" / "lora_adapter" / "adapter_model.safetensors")
    assert len(adapter) == 28
    assert json.loads((step / "actor" / "lora_adapter" / "adapter_config.json").read_text())["r"] == 8
    # the optimizer holds the adapter's parameters only
    optim = torch.load(step / "actor" / "optim_world_size_2_rank_0.pt", weights_only=False)["state_dict"]
    assert sum(len(group["params"]) for group in optim["param_groups"]) == len(adapter)
    # after 5 steps the base weights in the checkpoint are still model.path's, bit for bit
    full = checkpoint.consolidate(step)
    on_disk = load_file(demo_dir / "model" / "model.safetensors")
    base = {lora.base_weight_name(k): v for k, v in full.items() if not lora.is_adapter_name(k)}
    assert all(torch.equal(base[name], tensor) for name, tensor in on_disk.items())


def test_lora_sigkill_then_auto_resume_matches_the_uninterrupted_run(lora_run, demo_dir, data_file,  # noqa: F811
                                                                     tmp_path):
    kill_after_step_2_checkpoint(demo_dir, data_file, tmp_path, *HF_LORA)
    assert_resumed(train(demo_dir, data_file, tmp_path, *HF_LORA), 2)
    rows = metric_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2:] == metric_rows(lora_run["dir"] / "metrics.jsonl")[2:]


@pytest.fixture(scope="module")
def exports(lora_run, tmp_path_factory):
    """--export of the step-5 checkpoint: the adapter, and the merged model."""
    out = tmp_path_factory.mktemp("lora_export")
    step5 = lora_run["dir"] / "checkpoints" / "global_step_5"
    run([sys.executable, "minirl.py", "--export", step5, out / "adapter"])
    run([sys.executable, "minirl.py", "--export", step5 / "actor", out / "merged", "--merge-adapter"])
    return {"adapter": out / "adapter", "merged": out / "merged", "step5": step5}


def test_exported_adapter_and_merged_model_give_the_trained_policys_logprobs(  # noqa: F811
        lora_run, exports, demo_dir, data_file, probe_batch, tmp_path):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "probe.pt"
    run(torchrun_cmd(2, ROOT / "tests" / "checkpoint_launcher.py", "logprobs", probe_batch, out,
                     *run_overrides(demo_dir, data_file, tmp_path, *HF_LORA, "trainer.resume_mode=resume_path",
                                    f"trainer.resume_from_path={exports['step5']}")))
    fsdp = torch.load(out)["logp"]                    # the resumed FSDP LoRA actor
    batch = torch.load(probe_batch)
    mask = batch["response_mask"].bool()

    def base():
        return AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32)

    assert sorted(p.name for p in exports["adapter"].iterdir() if p.name.startswith("adapter")) == \
        ["adapter_config.json", "adapter_model.safetensors"]
    AutoTokenizer.from_pretrained(exports["adapter"])
    candidates = {
        "peft adapter": PeftModel.from_pretrained(base(), exports["adapter"]),
        "transformers adapter": AutoModelForCausalLM.from_pretrained(exports["adapter"], dtype=torch.float32),
        "merged": AutoModelForCausalLM.from_pretrained(exports["merged"], dtype=torch.float32),
        "hf_model in the checkpoint": AutoModelForCausalLM.from_pretrained(exports["step5"] / "actor" / "huggingface",
                                                                            dtype=torch.float32),
    }
    for name, model in candidates.items():
        assert torch.allclose(hand_logprobs(model, batch)[mask], fsdp[mask], atol=1e-5), name
    assert not torch.allclose(hand_logprobs(base(), batch)[mask], fsdp[mask], atol=1e-3), "the adapter did nothing"


@needs_vllm
def test_grpo_with_lora_on_vllm_from_the_merged_export(exports, demo_dir, tmp_path):
    """3 GRPO steps, vLLM with load_format=safetensors: the base (here the merged export, which vLLM must load)
    comes from model.path once, each sync sends the adapter; vLLM's log-probs match the actor's every step."""
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *LORA,
             f"actor_rollout_ref.model.path={exports['merged']}", f"data.train_files={demo_dir}/data/train.parquet",
             "data.val_files=null", f"af_output_dir={tmp_path}", "actor_rollout_ref.rollout.name=vllm",
             "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.dtype=float32",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "trainer.total_training_steps=3",
             "trainer.save_freq=-1", "trainer.logger=[console]", "data.train_batch_size=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert "actor/kl_loss" in row
        assert 0 <= row["training/rollout_probs_diff_mean"] <= row["training/rollout_probs_diff_max"] < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Errors before any model loads, and verl's LoRA command line


@pytest.mark.parametrize("overrides, pattern", [
    (["actor_rollout_ref.model.lora_rank=-1"], r"'actor_rollout_ref.model.lora_rank'=-1 is out of range: valid is "
                                               r"\[0, inf\)"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"],
     r"'actor_rollout_ref.model.lora_alpha'=0 is out of range: valid is \(0, inf\)"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=vllm",
      "actor_rollout_ref.rollout.load_format=auto"], r"load_format'='auto' with LoRA: use 'safetensors'"),
    (["critic.model.lora_rank=-1"], r"'critic.model.lora_rank'=-1 is out of range: valid is \[0, inf\)"),
    (["critic.model.lora_rank=8", "critic.model.lora_alpha=0"],
     r"'critic.model.lora_alpha'=0 is out of range: valid is \(0, inf\)"),
])
def test_bad_lora_settings_are_refused(paths, overrides, pattern):  # noqa: F811
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(paths, minimal(paths)), overrides, world_size=2)


def test_lora_settings_that_load(paths):  # noqa: F811
    cfg = load_config(write(paths, minimal(paths)), ["actor_rollout_ref.model.lora_rank=8",
                                                     "actor_rollout_ref.model.lora_alpha=32.5",
                                                     "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
                                                     "actor_rollout_ref.rollout.name=hf",
                                                     "actor_rollout_ref.rollout.load_format=auto"], world_size=2)
    assert cfg.actor_rollout_ref.model.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("targets, exclude", [("[qkv]", "null"), ("[q_proj]", "[q_proj]"), ("'.*attn\\.qkv'", "null")])
def test_target_modules_matching_nothing_name_the_layers_that_exist(tiny_model_dir, targets, exclude):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=unused",
                             "algorithm.adv_estimator=grpo",
                             "actor_rollout_ref.model.lora_rank=8", f"actor_rollout_ref.model.target_modules={targets}",
                             f"actor_rollout_ref.model.exclude_modules={exclude}"], check_paths=False)
    with pytest.raises(ConfigError, match=r"matches no layer of .*named down_proj, gate_proj, k_proj, o_proj, q_proj, "
                                          r"up_proj, v_proj \(or use all-linear\)"):
        lora.check_target_modules(cfg.actor_rollout_ref.model)
    cfg.actor_rollout_ref.model.exclude_modules = None
    cfg.actor_rollout_ref.model.target_modules = ["q_proj", "v_proj"]
    lora.check_target_modules(cfg.actor_rollout_ref.model)             # a list that matches passes


def test_a_misspelt_all_linear_is_named(tiny_model_dir):
    """Found typing target_modules=all_linear: peft reads any string as a regex, so it matched nothing."""
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=unused",
                             "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.lora_rank=8",
                             "actor_rollout_ref.model.target_modules=all_linear"], check_paths=False)
    with pytest.raises(ConfigError, match=r"'all_linear' .* matches no layer of .*: did you mean 'all-linear'\?"):
        lora.check_target_modules(cfg.actor_rollout_ref.model)


def test_a_critic_target_that_matches_nothing_names_the_critics_key(tiny_model_dir):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=unused",
                             f"critic.model.path={tiny_model_dir}", "critic.model.lora_rank=8",
                             "critic.model.target_modules=[qproj]"], check_paths=False)
    with pytest.raises(ConfigError, match=r"'critic.model.target_modules'=\['qproj'\] \(exclude_modules=None\) "
                                          r"matches no layer"):
        lora.check_target_modules(cfg.critic.model, "critic.model")


def test_verl_lora_example_passes_print_config(paths):  # noqa: F811
    """verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh (v0.5.0) with its LoRA keys."""
    verl_lora = ["algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=512",
                 "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=error",
                 "data.prompt_key=messages", "data.shuffle=False", "actor_rollout_ref.model.use_shm=True",
                 "actor_rollout_ref.model.lora_rank=64",
                 "actor_rollout_ref.model.lora_alpha=32", "actor_rollout_ref.model.target_modules=all-linear",
                 "actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.model.use_remove_padding=True",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=256",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
                 "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
                 "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
                 "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                 "actor_rollout_ref.actor.fsdp_config.param_offload=False",
                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
                 "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
                 "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
                 "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.layered_summon=True",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
                 "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
                 "trainer.critic_warmup=0", "trainer.logger=['console','wandb']",
                 "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen2_5_3b_grpo_lora",
                 "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
                 "trainer.total_epochs=15"]
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(write(paths, minimal(paths))),
                          "--print-config", "--world-size", "8", *verl_lora], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "lora_rank: 64" in out.stdout and "load_format: safetensors" in out.stdout


def test_a_saved_adapter_names_its_base_by_an_absolute_path(tiny_model_dir, tmp_path, monkeypatch):
    """Found exporting a run started with model.path=demo/model: the adapter named its base "demo/model", so
    from_pretrained(OUT) worked only from the training folder and elsewhere looked for a Hub model."""
    from transformers import AutoModelForCausalLM
    monkeypatch.chdir(tiny_model_dir.parent)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir.name}", "data.train_files=unused",
                             "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.lora_rank=4"],
                      check_paths=False)
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir.name), cfg.actor_rollout_ref.model)
    saved = lora.adapter_from_full_state(model, model.state_dict()).save(tmp_path / "adapter")
    monkeypatch.chdir(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(saved)                         # base + adapter, found from here
    assert json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tiny_model_dir.resolve())
    assert loaded.peft_config["default"].r == 4
