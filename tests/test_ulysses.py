"""Ulysses sequence parallelism (ulysses.py): on 2 CPU ranks (gloo), sp=2 gives the same log-probs, entropy,
gradients and weights after one update as sp=1, with packed rows of odd lengths (so padding to a multiple of sp
runs), for the text model and for the tiny Qwen2.5-VL on image prompts; the trainer runs GRPO and PPO (reference
and critic) with sp=2, and GRPO on images with vLLM; and bad settings are clear errors."""
import importlib.util
import json
import random

import pytest
import torch
from transformers import Qwen2Config

from config import ConfigError, load_config
from launch import ROOT, assert_resumed, torchrun

SP2 = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2,actor_rollout_ref.model.use_remove_padding=true"
VARIANTS = {
    # the reference: 2 ranks, data parallel only
    "sp1": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4,actor_rollout_ref.model.use_remove_padding=true",
    # one response per forward (packed lengths 11, 5, 5, ...: odd, so each row is padded by one token); the
    # log-prob pass packs 3 rows (21, 20, 15 tokens)
    "sp2_micro1": f"{SP2},actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1,"
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
    # the same with the parameters gathered through the mini-batch and, on CPU, the gradients reduced once
    "sp2_micro1_gathered": f"{SP2},actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1,"
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3,"
                           "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
    # a token budget (16 per device: 32 per sp group)
    "sp2_dynamic": f"{SP2},actor_rollout_ref.actor.use_dynamic_bsz=true,"
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16",
    # recomputed activations (the all-to-alls run again in backward) and compiled log-prob/entropy kernels
    "sp2_checkpointing_compiled": f"{SP2},actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2,"
                                  "actor_rollout_ref.model.enable_gradient_checkpointing=true,"
                                  "actor_rollout_ref.actor.use_torch_compile=true",
}


@pytest.fixture(scope="module")
def sp_results(fixed_batch, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ulysses") / "results.pt"
    torchrun(2, "tests/oracle_step.py", fixed_batch, out, tiny_model_dir,
             *[f"{name}:{overrides}" for name, overrides in VARIANTS.items()])
    return torch.load(out)


def assert_matches_data_parallel(base, other, batch_path, variant):
    mask = torch.load(batch_path, weights_only=False)["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        assert torch.allclose(other[key][mask], base[key][mask], atol=1e-5, rtol=1e-5), f"{variant}: {key}"
    for name, grad in base["grads"].items():
        assert torch.allclose(other["grads"][name], grad, atol=1e-6, rtol=1e-4), f"{variant}: grad of {name}"
        signal = grad.abs() > 1e-6             # AdamW's first step: where |g| is round-off, the sign is noise
        assert torch.allclose(other["weights"][name][signal], base["weights"][name][signal], atol=1e-6), \
            f"{variant}: weights of {name}"
    assert other["metrics"]["actor/pg_loss"] == pytest.approx(base["metrics"]["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert other["metrics"]["actor/kl_loss"] == pytest.approx(base["metrics"]["actor/kl_loss"], rel=1e-4, abs=1e-6)
    assert other["metrics"]["actor/grad_norm"] == pytest.approx(base["metrics"]["actor/grad_norm"], rel=1e-4)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "sp1"])
def test_sequence_parallel_matches_data_parallel(sp_results, fixed_batch, variant):
    """The tiny model has 2 query heads and 1 KV head: sp=2 splits the query heads and repeats the KV head."""
    assert_matches_data_parallel(sp_results["sp1"], sp_results[variant], fixed_batch, variant)


# ---------------------------------------------------------------------------------------------------------------
# A vision-language model: the image features land in whichever rank's slice holds their placeholders

needs_torchvision = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                       reason="torchvision is not installed: re-run `bash setup.sh`")
VL_VARIANTS = {key: VARIANTS[key] for key in ("sp1", "sp2_micro1", "sp2_checkpointing_compiled")}


@pytest.fixture(scope="module")
def fixed_vl_batch(tiny_vl_dir, tmp_path_factory):
    """8 responses (4 prompts x n=2) of the tiny Qwen2.5-VL: prompts with one image, none, two of different sizes,
    one; random responses of 1-5 tokens (packed rows of odd and even lengths); old and reference log-probs near
    the model's, random advantages (as fixed_batch)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    import vision
    from data import RLHFDataset, collate
    from demo_vl import COLOURS, VL_PROMPT, render_square
    from forward import token_logprobs
    from models import load_model
    from rollout import responses_to_batch

    def wide(colour):
        out = io.BytesIO()
        Image.new("RGB", (112, 56), COLOURS[colour]).save(out, format="PNG")
        return out.getvalue()

    rng, g = random.Random(0), torch.Generator().manual_seed(1)
    images = [[render_square("red", rng)], [], [render_square("green", rng), wide("blue")],
              [render_square("blue", rng)]]
    prompts = [VL_PROMPT, "Say hi.", "<image> and <image>: which is red?", VL_PROMPT]
    out = tmp_path_factory.mktemp("ulysses_vl")
    pq.write_table(pa.table({"data_source": ["minirl/colour"] * 4,
                             "prompt": [[{"role": "user", "content": p}] for p in prompts],
                             "reward_model": [{"style": "rule", "ground_truth": "red"}] * 4,
                             "images": [[{"bytes": b, "path": None} for b in row] for row in images]}),
                   out / "rows.parquet")
    processor = vision.load_processor(tiny_vl_dir)
    dataset = RLHFDataset(out / "rows.parquet", processor.tokenizer, max_prompt_length=64, processor=processor)
    batch = collate([dataset[i // 2] for i in range(8)])
    responses = [torch.randint(10, 200, (n,), generator=g).tolist() for n in (5, 2, 4, 1, 3, 5, 2, 4)]
    batch = {**batch, **responses_to_batch(batch, responses, 5, processor.tokenizer.pad_token_id,
                                           [processor.tokenizer.eos_token_id])}
    model = load_model(tiny_vl_dir).eval()
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.9, use_remove_padding=False)
    b, R = batch["responses"].shape
    batch["old_log_probs"] = logp + 0.3 * torch.randn(b, R, generator=g)
    batch["ref_log_prob"] = logp + 0.5 * torch.randn(b, R, generator=g)
    batch["advantages"] = torch.randn(b, R, generator=g) * batch["response_mask"]
    batch["uid"] = [str(i // 2) for i in range(b)]
    keep = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) or k in ("uid", "multi_modal_inputs")}
    torch.save(keep, out / "batch.pt")         # without the rows' PIL images (the rollout's), as oracle_step loads it
    return out / "batch.pt"


@needs_torchvision
def test_sequence_parallel_on_image_prompts_matches_data_parallel(fixed_vl_batch, tiny_vl_dir, tmp_path):
    """sp=2 against sp=1 on the tiny Qwen2.5-VL: each rank runs the vision tower on all the group's images and
    keeps its slice of the decoder's inputs, so an image's tokens may fall on either rank; the vision tower's
    gradient must still be the whole batch's."""
    out = tmp_path / "results.pt"
    torchrun(2, "tests/oracle_step.py", fixed_vl_batch, out, tiny_vl_dir,
             *[f"{name}:{overrides}" for name, overrides in VL_VARIANTS.items()])
    results = torch.load(out)
    assert any(".visual." in name and grad.abs().max() > 0 for name, grad in results["sp1"]["grads"].items())
    for variant in VL_VARIANTS:
        if variant != "sp1":
            assert_matches_data_parallel(results["sp1"], results[variant], fixed_vl_batch, variant)


# ---------------------------------------------------------------------------------------------------------------
# The trainer with sp=2


def run_trainer(demo_dir, out, *overrides, resumed_at=None):
    """A short run of the demo config on 2 ranks; returns its metrics rows. resumed_at: the checkpoint step it
    must have resumed from (launch.assert_resumed)."""
    run = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml",
                   f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={demo_dir}/data/train.parquet",
                   f"data.val_files={demo_dir}/data/test.parquet", f"af_output_dir={out}",
                   "trainer.val_before_train=false", "trainer.test_freq=-1", "data.train_batch_size=4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides)
    if resumed_at is not None:
        assert_resumed(run, resumed_at)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_trains(rows, keys):
    for row in rows:
        for key in keys:
            assert torch.isfinite(torch.tensor(row[key])), (row["step"], key)
        assert row["actor/grad_norm"] > 0


def test_grpo_with_sequence_parallel_then_resume_without(demo_dir, tmp_path):
    """GRPO with the KL loss (actor and reference sp=2) for two steps, checkpointed; the checkpoint then resumes
    with sp=1 (FSDP shards over all ranks whatever sp is, so checkpoints do not depend on it)."""
    rows = run_trainer(demo_dir, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2",
                       "trainer.save_freq=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    assert [r["step"] for r in rows] == [1, 2]
    assert_trains(rows, ("actor/pg_loss", "actor/kl_loss", "actor/entropy"))
    rows = run_trainer(demo_dir, tmp_path, "algorithm.adv_estimator=grpo", "trainer.total_training_steps=3",
                       "trainer.save_freq=-1", "trainer.resume_mode=auto", resumed_at=2)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_trains(rows[2:], ("actor/pg_loss", "actor/kl_loss"))


def test_sequence_parallel_resume_is_exact(demo_dir, tmp_path):
    """sp=2: 2 steps + a checkpoint, then a resume for step 3, gives step 3 of an uninterrupted 3-step run exactly
    (timing aside). (Checked by hand with SIGKILL, mid-checkpoint too, for GRPO and PPO with a sp=2 critic.)"""
    sp2 = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
    straight = run_trainer(demo_dir, tmp_path / "straight", *sp2, "trainer.total_training_steps=3",
                           "trainer.save_freq=-1")
    run_trainer(demo_dir, tmp_path / "resumed", *sp2, "trainer.total_training_steps=2", "trainer.save_freq=2")
    resumed = run_trainer(demo_dir, tmp_path / "resumed", *sp2, "trainer.total_training_steps=3",
                          "trainer.save_freq=-1", "trainer.resume_mode=auto", resumed_at=2)
    wall_clock = ("timing_s/", "timing_per_token_ms/", "perf/")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [{k: v for k, v in row.items() if not k.startswith(wall_clock)} for row in resumed] == \
        [{k: v for k, v in row.items() if not k.startswith(wall_clock)} for row in straight]


def test_ppo_with_sequence_parallel_actor_reference_and_critic(demo_dir, tmp_path):
    """PPO (GAE) with sp=2 for the actor, the reference (inherited) and the critic: both models train. One
    mini-batch per step, so the update's own log-probs stand in for the old ones (minirl.update_is_on_policy)."""
    rows = run_trainer(demo_dir, tmp_path, "algorithm.adv_estimator=gae", "trainer.total_training_steps=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "trainer.save_freq=-1", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                       f"critic.model.path={demo_dir}/model", "critic.ppo_micro_batch_size_per_gpu=2",
                       "critic.model.use_remove_padding=true", "critic.ulysses_sequence_parallel_size=2")
    assert [r["step"] for r in rows] == [1, 2]
    assert_trains(rows, ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/entropy"))
    assert all(row["critic/grad_norm"] > 0 for row in rows)


@needs_torchvision
def test_grpo_on_image_prompts_with_vllm_and_sequence_parallel_equals_data_parallel(tiny_vl_dir, tmp_path):
    """The tiny Qwen2.5-VL trained with GRPO on the colour task for 3 steps, vLLM generating: the run with the
    actor and reference at sp=2 logs the losses, gradient norms and entropy of the run at sp=1 (fp32 rounding),
    and vLLM's log-probs follow the sp=2 actor's after every sync."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from demo_vl import vl_demo_rows
    for split, count in (("train", 8), ("test", 4)):
        pq.write_table(pa.Table.from_pylist(vl_demo_rows(split, count)), tmp_path / f"{split}.parquet")
    runs = {}
    for sp in (1, 2):
        out = tmp_path / f"sp{sp}"
        torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={tiny_vl_dir}",
                 f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/test.parquet",
                 f"af_output_dir={out}", "actor_rollout_ref.rollout.name=vllm",
                 "actor_rollout_ref.rollout.dtype=float32",
                 "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.save_freq=-1", "trainer.logger=[console]", "data.train_batch_size=4",
                 "data.max_prompt_length=64", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
                 # one response per update forward, three per reference forward: the rows (prompt + response,
                 # 65 tokens each here) are padded and split mid-sequence, not at a sequence boundary
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.optim.lr=1e-3",
                 "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}")
        runs[sp] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs[2]] == [1, 2, 3]
    for one, two in zip(runs[1], runs[2]):
        assert two["training/rollout_probs_diff_max"] < 1e-4
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (two["step"], key)
    assert runs[2][-1]["actor/grad_norm"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Errors


BASE = ["algorithm.adv_estimator=grpo", "data.train_files=unused", "actor_rollout_ref.model.path=unused",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]


@pytest.mark.parametrize("overrides, world, message", [
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"],
     2, "set 'actor_rollout_ref.model.use_remove_padding=true'"),
    (["algorithm.adv_estimator=gae", "critic.model.path=unused", "critic.ppo_micro_batch_size_per_gpu=2",
      "critic.ulysses_sequence_parallel_size=2"], 2, "set 'critic.model.use_remove_padding=true'"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true"],
     3, "'actor_rollout_ref.actor.ulysses_sequence_parallel_size'=2 must divide the world size 3"),
    (["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4"],
     2, "'actor_rollout_ref.ref.ulysses_sequence_parallel_size'=4 must divide the world size 2"),
])
def test_sequence_parallel_config_errors(overrides, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, BASE + overrides, world_size=world, check_paths=False)


def test_batch_plan_is_data_parallel_over_sp_groups():
    """verl's arithmetic with sp: 4 ranks, sp=2 -> dp=2; the mini-batch per dp rank is 4*2/2 = 4 responses."""
    cfg = load_config(None, BASE + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                    "actor_rollout_ref.model.use_remove_padding=true"], world_size=4,
                      check_paths=False)
    from batch_plan import batch_plan
    plan = batch_plan(cfg, 4)
    assert (plan["dp"], plan["sp"], plan["responses_per_mini_batch_per_rank"]) == (2, 2, 4)


@pytest.mark.parametrize("heads, kv_heads, sp, message", [
    (6, 6, 4, "must divide the model's 6 attention heads"),
    (4, 3, 2, "the model's 3 key/value heads: one must divide the other"),
])
def test_heads_that_cannot_be_split_are_a_clear_error(tiny_tokenizer_dir, heads, kv_heads, sp, message):
    """Checked when the model loads (before any collective), naming the key and the numbers."""
    import ulysses
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=heads * 8, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads))
    with pytest.raises(ConfigError, match=message) as err:
        ulysses.enable(model, sp, group=None, key="actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    assert "actor_rollout_ref.actor.ulysses_sequence_parallel_size" in str(err.value)


def test_kv_heads_are_repeated_when_fewer_than_sp():
    import ulysses
    assert ulysses.kv_repeats(2, 1, 2, "k") == 2 and ulysses.kv_repeats(8, 4, 2, "k") == 1
    assert ulysses.kv_repeats(8, 2, 4, "k") == 2


def test_heads_sp_cannot_split_are_refused_before_weights_load(demo_dir, tmp_path):
    """Found running the trainer with sp=2 on a 3-head model: the error came after the weights had loaded. The
    model folder here has a config.json (3 heads), a tokenizer and a weights file that holds no weights, so the run
    can only end with the heads error if it is raised from the config alone."""
    from transformers import AutoConfig, AutoTokenizer
    model = tmp_path / "model_3_heads"
    config = AutoConfig.from_pretrained(demo_dir / "model")
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 96, 3, 3, 32
    config.save_pretrained(model)
    AutoTokenizer.from_pretrained(demo_dir / "model").save_pretrained(model)
    from safetensors.torch import save_file
    save_file({}, model / "model.safetensors")      # a whole file (models.check_model_folders) that holds no weights
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={model}",
                   f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null", f"af_output_dir={tmp_path}",
                   "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", expect_ok=False)
    assert out.returncode != 0
    assert ("config error: 'actor_rollout_ref.actor.ulysses_sequence_parallel_size'=2 must divide the model's 3 "
            "attention heads") in out.stderr, out.stderr[-3000:]
