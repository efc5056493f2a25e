"""PPO: a learned critic with GAE, a reward model, and KL in the reward, through the real trainer (torchrun)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

import checkpoint
import losses
from demo import build_tiny_model
from conftest import OFFLOAD_SWITCHES
from launch import ROOT, assert_resumed, torchrun


@pytest.fixture(scope="module")
def ppo_models(demo_dir, tmp_path_factory):
    """A critic (token classification) and a reward model (sequence classification) on the demo's tokenizer; the
    RM's tokenizer carries a different chat template, so the trainer must re-template conversations for it."""
    root = tmp_path_factory.mktemp("ppo_models")
    tokenizer = AutoTokenizer.from_pretrained(f"{demo_dir}/model")
    build_tiny_model(tokenizer, kind="token_cls", seed=1).save_pretrained(root / "critic")
    tokenizer.save_pretrained(root / "critic")
    build_tiny_model(tokenizer, kind="seq_cls", seed=2).save_pretrained(root / "rm")
    tokenizer.chat_template = ("{%- for m in messages %}{{- 'RM ' + m['role'] + ': ' + m['content'] + '\\n' }}"
                               "{%- endfor %}")
    tokenizer.save_pretrained(root / "rm")
    return root


def base_overrides(demo_dir, out, steps):
    return [f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={demo_dir}/data/train.parquet",
            f"data.val_files={demo_dir}/data/test.parquet", f"af_output_dir={out}",
            f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=gae",
            "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=1e-3", "algorithm.lam=0.95",
            "actor_rollout_ref.actor.use_kl_loss=false"]


@pytest.fixture(scope="module")
def ppo_two_ranks(demo_dir, ppo_models, tmp_path_factory):
    """GAE with a critic and adaptive in-reward KL, 2 ranks, 3 steps."""
    out = tmp_path_factory.mktemp("ppo2")
    torchrun(2, "tests/ppo_probe.py", out / "probe.pt", *base_overrides(demo_dir, out, 3),
             f"critic.model.path={ppo_models}/critic", "algorithm.use_kl_in_reward=true",
             "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=1e-6", "algorithm.kl_ctrl.horizon=100",
             "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_penalty=abs")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "probe": torch.load(out / "probe.pt", weights_only=False)}


@pytest.fixture(scope="module")
def ppo_one_rank(demo_dir, ppo_models, tmp_path_factory):
    """GAE with a critic, a reward model (its own chat template) and fixed in-reward KL, 1 rank, 1 step."""
    out = tmp_path_factory.mktemp("ppo1")
    torchrun(1, "tests/ppo_probe.py", out / "probe.pt", *base_overrides(demo_dir, out, 1),
             f"critic.model.path={ppo_models}/critic", "reward_model.enable=true",
             f"reward_model.model.path={ppo_models}/rm", "reward_model.micro_batch_size_per_gpu=3",
             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_penalty=kl",
             "trainer.balance_batch=false")
    return torch.load(out / "probe.pt", weights_only=False)


CRITIC_METRICS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
                  "critic/grad_norm", "critic/lr", "critic/values/mean", "critic/values/max", "critic/returns/mean",
                  "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"]


def test_ppo_end_to_end_trains_the_critic(ppo_two_ranks):
    rows, probe = ppo_two_ranks["rows"], ppo_two_ranks["probe"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        missing = [m for m in CRITIC_METRICS if m not in row]
        assert not missing, missing
    assert probe["critic_changed"] == probe["critic_names"]


def test_adaptive_kl_coefficient_grows_when_kl_is_above_target(ppo_two_ranks):
    """beta *= 1 + clip(kl/target - 1, -0.2, 0.2) * B / horizon after each step (B = 8 responses, horizon 100).
    Step 1: the actor IS the reference, kl = 0, err = -0.2: beta shrinks by 1 - 0.016. Step 2: the actor has
    moved, kl >> target_kl = 1e-6, err = +0.2: beta grows by 1 + 0.016. The coefficient logged is the one used."""
    rows = ppo_two_ranks["rows"]
    assert rows[0]["actor/reward_kl_penalty"] == 0.0 and rows[1]["actor/reward_kl_penalty"] > 1e-6
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    assert coeffs == pytest.approx([0.05, 0.05 * 0.984, 0.05 * 0.984 * 1.016], rel=1e-6)


def test_trainer_advantages_equal_gae_on_the_same_tensors(ppo_one_rank):
    call = ppo_one_rank["compute_advantages"]
    kw = call["kwargs"]
    assert call["args"] == ("gae",)
    expected_adv, expected_ret = losses.gae_advantages(token_rewards=kw["token_rewards"], values=kw["values"],
                                                       mask=kw["mask"], gamma=1.0, lam=0.95)
    adv, ret = call["result"]
    assert torch.allclose(adv, expected_adv, atol=1e-6) and torch.allclose(ret, expected_ret, atol=1e-6)
    # the values are the critic's, computed before any update, zero outside the response mask
    values_call = ppo_one_rank["compute_values"]
    assert torch.equal(kw["values"], values_call["result"])
    assert torch.all(kw["values"][kw["mask"] == 0] == 0)


def test_in_reward_kl_changes_rewards_as_the_formula_says(ppo_one_rank):
    """token_rewards = token_scores - beta * (logp_old - logp_ref) * mask, with beta = kl_coef = 0.1."""
    kl_call = ppo_one_rank["apply_kl_penalty"]
    scores, logp, ref, mask = kl_call["args"][:4]
    expected = scores - 0.1 * (logp - ref) * mask
    rewards, metrics = kl_call["result"]
    assert torch.allclose(rewards, expected, atol=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert torch.equal(ppo_one_rank["compute_advantages"]["kwargs"]["token_rewards"], rewards)


def test_reward_model_scores_equal_a_direct_forward_on_the_same_text(ppo_one_rank, ppo_models):
    """The RM's own template differs from the actor's, so each conversation is re-templated; its score equals
    transformers' Qwen2ForSequenceClassification on that text, and it is the score the trainer used."""
    call = ppo_one_rank["score"]
    batch = call["args"][0]
    tokenizer = AutoTokenizer.from_pretrained(ppo_models / "rm")
    actor_tokenizer = AutoTokenizer.from_pretrained(ppo_models / "critic")
    rm = AutoModelForSequenceClassification.from_pretrained(ppo_models / "rm", dtype=torch.float32).eval()
    expected = []
    for prompt, response, mask in zip(batch["raw_prompt"], batch["responses"], batch["response_mask"]):
        text = actor_tokenizer.decode(response[mask.bool()].tolist(), skip_special_tokens=True)
        rendered = "".join(f"RM {m['role']}: {m['content']}\n" for m in list(prompt) + [
            {"role": "assistant", "content": text}])
        ids = tokenizer(rendered, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            expected.append(rm(input_ids=ids).logits[0, 0])
    assert torch.allclose(call["result"], torch.stack(expected), atol=1e-5)
    # the model score replaces the rule score, on the last response token (before the KL penalty)
    token_scores = ppo_one_rank["apply_kl_penalty"]["args"][0]
    assert torch.allclose(token_scores.sum(-1), call["result"], atol=1e-6)


WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/")


def metric_rows(path):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows}


def test_ppo_checkpoint_resumes_critic_and_kl_controller_exactly(demo_dir, ppo_models, tmp_path):
    """A 3-step PPO run (critic, adaptive in-reward KL) vs 2 steps + a checkpoint + resume for the 3rd: step 3's
    metrics are identical, so the critic's weights/optimizer and the KL coefficient came back exactly."""
    def ppo(out, steps, *extra):
        return torchrun(1, "minirl.py", "--config", ROOT / "config.yaml", *base_overrides(demo_dir, out, steps),
                 f"critic.model.path={ppo_models}/critic", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01", "trainer.logger=[console]",
                 *extra)
    ppo(tmp_path / "straight", 3)
    ppo(tmp_path / "resumed", 2, "trainer.save_freq=2")
    assert (tmp_path / "resumed" / "checkpoints" / "global_step_2" / "critic").is_dir()
    assert_resumed(ppo(tmp_path / "resumed", 3, "trainer.save_freq=2", "trainer.resume_mode=auto"), 2)
    straight, resumed = metric_rows(tmp_path / "straight" / "metrics.jsonl"), metric_rows(
        tmp_path / "resumed" / "metrics.jsonl")
    assert resumed[3] == straight[3]
    assert "critic/vf_loss" in resumed[3] and resumed[3]["actor/reward_kl_penalty_coeff"] != 0.001


def test_critic_from_a_causal_lm_checkpoint_saves_and_exports_as_hugging_face(demo_dir, tmp_path):
    """verl's usual setup: critic.model.path is the causal-LM base model, which gets a fresh value head. Its
    hf_model checkpoint and --export must reload as a token-classification model holding the trained weights."""
    from transformers import AutoModelForTokenClassification

    import checkpoint
    out = tmp_path / "run"
    torchrun(1, "minirl.py", "--config", ROOT / "config.yaml", *base_overrides(demo_dir, out, 1),
             f"critic.model.path={demo_dir}/model", "trainer.save_freq=1", "trainer.logger=[console]",
             "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    step = out / "checkpoints" / "global_step_1"
    trained = checkpoint.consolidate(step, "critic")
    subprocess.run([sys.executable, "minirl.py", "--export", step / "critic", tmp_path / "export"], cwd=ROOT,
                   check=True, capture_output=True)
    for folder in (step / "critic" / "huggingface", tmp_path / "export"):
        model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32)
        assert model.config.num_labels == 1
        reloaded = model.state_dict()
        assert set(trained) <= set(reloaded), folder
        for name, tensor in trained.items():
            assert torch.equal(reloaded[name], tensor), (folder, name)


# each critic-free estimator's formula, named here (not looked up in losses.ADVANTAGE_ESTIMATORS, the table the
# trainer dispatches through)
CRITIC_FREE_FORMULAS = {
    "grpo": losses.grpo_advantages, "rloo": losses.rloo_advantages,
    "reinforce_plus_plus": losses.reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": losses.reinforce_pp_baseline_advantages, "remax": losses.remax_advantages,
    "opo": losses.opo_advantages, "grpo_passk": losses.grpo_passk_advantages, "gpg": losses.gpg_advantages,
}


@pytest.mark.parametrize("estimator", list(CRITIC_FREE_FORMULAS))
def test_every_critic_free_estimator_trains(demo_dir, tmp_path, estimator):
    """One step with each critic-free estimator through the real trainer (ReMax adds its greedy gen_max pass).
    The advantages the step computed and logged are the estimator's formula on the tensors the run recorded, and
    (for every estimator but GRPO) they differ from GRPO's on the same tensors, so a trainer that silently fell
    back to GRPO fails here."""
    out = tmp_path / estimator
    overrides = [o for o in base_overrides(demo_dir, out, 1) if not o.startswith(("algorithm.adv_estimator",
                                                                                  "critic."))]
    torchrun(1, "tests/ppo_probe.py", out / "probe.pt", *overrides, "actor_rollout_ref.rollout.n=4",
             f"algorithm.adv_estimator={estimator}", "trainer.logger=[console]")
    call = torch.load(out / "probe.pt", weights_only=False)["compute_advantages"]
    assert call["args"] == (estimator,)
    inputs, (adv, ret) = call["kwargs"], call["result"]
    expected_adv, expected_ret = CRITIC_FREE_FORMULAS[estimator](**inputs)
    assert torch.allclose(adv, expected_adv, atol=1e-6) and torch.allclose(ret, expected_ret, atol=1e-6)
    if estimator != "grpo":
        assert not torch.allclose(adv, losses.grpo_advantages(**inputs)[0], atol=1e-3)
    row = metric_rows(out / "metrics.jsonl")[1]
    assert row["critic/advantages/mean"] == pytest.approx(float(adv[inputs["mask"].bool()].mean()), abs=1e-6)
    assert "actor/pg_loss" in row and "actor/grad_norm" in row
    timings = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert ("timing_s/gen_max" in timings) == (estimator == "remax")
    # no KL loss and no KL in the reward: no reference model is built, no critic either
    assert "timing_s/ref" not in timings and "timing_s/values" not in timings


def test_critic_warmup_holds_the_actor_back(demo_dir, ppo_models, tmp_path):
    """verl's rule: the actor updates once critic_warmup <= global step; with 2, step 1 trains the critic only."""
    torchrun(1, "minirl.py", "--config", ROOT / "config.yaml", *base_overrides(demo_dir, tmp_path, 2),
             f"critic.model.path={ppo_models}/critic", "trainer.critic_warmup=2", "trainer.logger=[console]")
    rows = metric_rows(tmp_path / "metrics.jsonl")
    assert "critic/vf_loss" in rows[1] and "actor/pg_loss" not in rows[1]
    assert "critic/vf_loss" in rows[2] and "actor/pg_loss" in rows[2]


def test_offloaded_workers_are_used_only_on_the_device_and_train_as_without_offload(demo_dir, ppo_models, tmp_path):
    """verl's offload switches on every worker (actor with its optimizer, reference, critic with its optimizer,
    reward model), 2 ranks, 2 PPO steps with a checkpoint after each. On CPU the moves cannot show in the numbers,
    so the probe checks the structure: no forward, optimizer step, weight gather or checkpoint read/write of a
    worker outside its phase, and a last offload (to meta) leaves no parameter, gradient, buffer or optimizer
    state behind. The metrics equal those of the same run without offload, and a resume from the offloaded run's
    step-1 checkpoint (offload on) gives step 2's again."""
    common = [*base_overrides(demo_dir, tmp_path, 2), f"critic.model.path={ppo_models}/critic",
              "reward_model.enable=true", f"reward_model.model.path={ppo_models}/rm",
              "reward_model.micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=true",
              "trainer.logger=[console]", "actor_rollout_ref.rollout.name=hf"]

    def offloaded_run(name, *extra):
        out = torchrun(2, "tests/offload_probe.py", tmp_path / f"{name}.json", *common, *OFFLOAD_SWITCHES,
                       f"af_output_dir={tmp_path / name}", *extra)
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["offloads"] == {"actor": [True, True], "ref": [True, False], "critic": [True, True],
                                      "reward_model": [True, False]}
        assert report["uses_outside_a_phase"] == []
        assert set(report["phases"]) == {"actor", "ref", "critic", "reward_model"}
        assert report["gradients"]["actor"] > 0 and report["gradients"]["critic"] > 0
        assert report["left_on_the_device"] == {"actor": [], "ref": [], "critic": [], "reward_model": []}
        return out

    offloaded_run("offload", "trainer.save_freq=1")
    step1 = tmp_path / "offload" / "checkpoints" / "global_step_1"
    assert_resumed(offloaded_run("resumed", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step1}"), 1)
    torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *common, f"af_output_dir={tmp_path / 'plain'}")
    offloaded, plain, resumed = (metric_rows(tmp_path / name / "metrics.jsonl")
                                 for name in ("offload", "plain", "resumed"))
    assert {"critic/vf_loss", "actor/kl_loss", "critic/score/mean"} <= set(plain[2])
    assert offloaded == plain
    assert resumed[2] == plain[2]


SPREAD_REWARD = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(sum(map(ord, solution_str)) % 5 - 2), "length": len(solution_str)}
"""


def test_pf_ppo_trains_on_rows_drawn_from_the_batch_by_score(demo_dir, ppo_models, tmp_path):
    """PF-PPO with max_min (verl: only the batch's highest- and lowest-scored responses can be drawn), 2 ranks, a
    reward that spreads the scores. A run without PF-PPO generates the same step-1 batch (same weights and seeds),
    so its dump is the batch PF-PPO drew from: the PF-PPO run's step-1 dump holds as many rows, each a row of that
    batch with its extras, all with its max or min score, and its score metric is their mean. A resume from the
    step-1 checkpoint draws step 2 alike."""
    reward = tmp_path / "spread.py"
    reward.write_text(SPREAD_REWARD)

    def run(name, steps, *extra):
        return torchrun(2, "minirl.py", "--config", ROOT / "config.yaml",
                        *base_overrides(demo_dir, tmp_path / name, steps), f"critic.model.path={ppo_models}/critic",
                        f"custom_reward_function.path={reward}", "trainer.logger=[console]",
                        f"trainer.rollout_data_dir={tmp_path / name / 'dump'}", *extra)

    def dump(name, step):
        return [json.loads(line) for line in (tmp_path / name / "dump" / f"{step}.jsonl").read_text().splitlines()]

    pf_ppo = ("algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min")
    run("plain", 1)
    run("pf", 2, *pf_ppo, "trainer.save_freq=1")
    step1 = tmp_path / "pf" / "checkpoints" / "global_step_1"
    assert_resumed(run("resumed", 2, *pf_ppo, "trainer.resume_mode=resume_path",
                       f"trainer.resume_from_path={step1}"), 1)

    batch = {(row["input"], row["output"]): row for row in dump("plain", 1)}
    scores = [row["score"] for row in batch.values()]
    extremes = {max(scores), min(scores)}
    assert len(extremes) == 2 and set(scores) - extremes, scores        # else every row could be drawn
    drawn = dump("pf", 1)
    assert len(drawn) == 8
    for row in drawn:
        assert row == batch[(row["input"], row["output"])]
        assert row["score"] in extremes and row["length"] == len(row["output"])
    metrics = metric_rows(tmp_path / "pf" / "metrics.jsonl")
    resumed = metric_rows(tmp_path / "resumed" / "metrics.jsonl")
    assert metrics[1]["critic/score/mean"] == pytest.approx(sum(row["score"] for row in drawn) / len(drawn))
    assert resumed[2] == metrics[2] and dump("resumed", 2) == dump("pf", 2)


HSDP = [f"{key}=2" for key in ("actor_rollout_ref.actor.fsdp_config.fsdp_size", "critic.model.fsdp_config.fsdp_size",
                               "reward_model.model.fsdp_config.fsdp_size")]


def test_hsdp_groups_train_as_one_sharded_copy_and_resume(demo_dir, ppo_models, tmp_path):
    """verl's fsdp_size=2 on 4 ranks (HSDP: each pair of ranks shards a copy of the model, the pairs replicate it)
    for the actor (and the reference, which shares its mesh, as verl's), the critic and the reward model, with
    vLLM: the metrics equal those of sharding over all 4 ranks (fp32 rounding), vLLM generates with the actor's
    weights (the per-step check), each rank's checkpoint shard holds half of a model, the checkpoint exports the
    same weights, a resume from step 1 gives step 2 again, and resuming with another fsdp_size is refused."""
    common = [*base_overrides(demo_dir, tmp_path, 2), "data.train_batch_size=8",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              f"critic.model.path={ppo_models}/critic", "reward_model.enable=true",
              f"reward_model.model.path={ppo_models}/rm", "reward_model.micro_batch_size_per_gpu=2",
              "actor_rollout_ref.actor.use_kl_loss=true", "trainer.logger=[console]", "trainer.save_freq=1",
              "actor_rollout_ref.rollout.name=vllm"]

    def run(name, *extra, expect_ok=True):
        return torchrun(4, "minirl.py", "--config", ROOT / "config.yaml", *common,
                        f"af_output_dir={tmp_path / name}", *extra, expect_ok=expect_ok)

    run("full")
    run("hsdp", *HSDP)
    step1 = tmp_path / "hsdp" / "checkpoints" / "global_step_1"
    assert_resumed(run("resumed", *HSDP, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step1}"), 1)
    full, hsdp, resumed = (metric_rows(tmp_path / name / "metrics.jsonl") for name in ("full", "hsdp", "resumed"))
    assert {"critic/vf_loss", "actor/kl_loss", "training/rollout_probs_diff_max"} <= set(hsdp[2])
    for step in (1, 2):
        assert hsdp[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6)
        assert hsdp[step]["training/rollout_probs_diff_max"] < 1e-4
    assert resumed[2] == hsdp[2]

    step2 = {name: tmp_path / name / "checkpoints" / "global_step_2" for name in ("full", "hsdp")}
    for role in ("actor", "critic"):
        weights = {name: checkpoint.consolidate(folder, role) for name, folder in step2.items()}
        assert weights["hsdp"].keys() == weights["full"].keys()
        for key, tensor in weights["full"].items():
            torch.testing.assert_close(weights["hsdp"][key], tensor, rtol=1e-5, atol=1e-6)
        shards = [torch.load(step2["hsdp"] / role / f"model_world_size_4_rank_{rank}.pt", weights_only=True)
                  for rank in range(4)]
        whole = sum(t.numel() for t in weights["full"].values())
        assert sum(t.numel() for shard in shards[:2] for t in shard.values()) == whole      # ranks 0, 1: one copy
        for rank in (0, 1):                                                                 # ranks 2, 3: its replica
            assert all(torch.equal(shards[rank][key], shards[rank + 2][key]) for key in shards[rank])

    other = run("regrouped", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step1}", expect_ok=False)
    assert other.returncode != 0
    assert ("shards its actor model over groups of 2 ranks and this run over 4 (actor_rollout_ref.actor.fsdp_config."
            "fsdp_size): its shards only load with the same grouping. Resume with actor_rollout_ref.actor.fsdp_config."
            "fsdp_size=2, or export") in other.stderr


def test_critic_lora_trains_its_adapters_and_value_head_and_exports_and_resumes(demo_dir, ppo_models, tmp_path):
    """critic.model.lora_rank=4, 2 ranks, 2 PPO steps: the critic's base weights stay those of critic.model.path,
    its adapters and its value head train, the checkpoint's adapter folder (peft's format) holds the trained head,
    the hf_model export (adapter merged in) gives the values of the unmerged peft model built from the base and
    that folder, and a resume from step 1 gives step 2 again."""
    common = [*base_overrides(demo_dir, tmp_path, 2), f"critic.model.path={ppo_models}/critic",
              "critic.model.lora_rank=4", "trainer.logger=[console]", "trainer.save_freq=1",
              "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
    run = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *common, f"af_output_dir={tmp_path / 'run'}")
    assert "critic LoRA rank 4, alpha 16, target_modules all-linear" in run.stdout + run.stderr
    step1 = tmp_path / "run" / "checkpoints" / "global_step_1"
    assert_resumed(torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", *common,
                            f"af_output_dir={tmp_path / 'resumed'}", "trainer.resume_mode=resume_path",
                            f"trainer.resume_from_path={step1}"), 1)
    straight, resumed = (metric_rows(tmp_path / name / "metrics.jsonl") for name in ("run", "resumed"))
    assert "critic/vf_loss" in straight[2] and resumed[2] == straight[2]

    folder = tmp_path / "run" / "checkpoints" / "global_step_2" / "critic"
    trained = checkpoint.consolidate(folder.parent, "critic")
    base = AutoModelForTokenClassification.from_pretrained(ppo_models / "critic").state_dict()
    prefix = "base_model.model."
    for name, tensor in base.items():                          # frozen: the base as it was loaded
        module, leaf = name.rsplit(".", 1)           # peft keeps a wrapped layer's own weights under a sub-module
        inner = "original_module" if module == "score" else "base_layer" if module.endswith("_proj") else None
        key = prefix + (f"{module}.{inner}.{leaf}" if inner else name)
        assert torch.equal(trained[key], tensor), key
    lora_b = [key for key in trained if ".lora_B." in key]
    assert len(lora_b) == 14 and all(trained[key].abs().sum() > 0 for key in lora_b)     # B starts at zero
    head = trained[prefix + "score.modules_to_save.default.weight"]
    assert not torch.equal(head, base["score.weight"])                                 # the head trained

    from peft import PeftModel
    from safetensors.torch import load_file
    assert torch.equal(load_file(folder / "lora_adapter" / "adapter_model.safetensors")[prefix + "score.weight"],
                       head)
    peft_critic = PeftModel.from_pretrained(AutoModelForTokenClassification.from_pretrained(ppo_models / "critic"),
                                            folder / "lora_adapter").eval()
    merged = AutoModelForTokenClassification.from_pretrained(folder / "huggingface").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft_critic(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)
        plain = AutoModelForTokenClassification.from_pretrained(ppo_models / "critic").eval()
        assert not torch.allclose(plain(input_ids=ids).logits, merged(input_ids=ids).logits)
