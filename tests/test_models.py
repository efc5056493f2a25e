"""The forward pass: packed (remove padding) vs padded log-probs, the response slice, micro-batch partitions, and
the rollout batch assembly."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from batch import balanced_partitions
from conftest import padded_batch
from forward import dynamic_micro_batches, fixed_micro_batches, token_logprobs
from rollout import response_mask_from_eos, responses_to_batch


def reference_logprobs(model, batch, temperature):
    """One sequence at a time, no padding at all: the log-prob of each response token given its prefix."""
    P = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    out = torch.zeros(batch["responses"].shape)
    for i in range(batch["input_ids"].shape[0]):
        valid = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][valid].unsqueeze(0)
        logits = model(input_ids=ids).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        prompt_len = int(batch["attention_mask"][i, :P].sum())
        for t in range(int(batch["attention_mask"][i, P:].sum())):
            out[i, t] = logp[prompt_len - 1 + t, ids[0, prompt_len + t]]
    return out


@pytest.mark.parametrize("attention", ["sdpa", "minirl_varlen"])
def test_packed_and_padded_logprobs_match_an_unpadded_forward(tiny_model_dir, attention, monkeypatch):
    """Both attentions (transformers' sdpa: a block-diagonal mask; minirl's per-sequence CPU attention), with the
    LM head run in chunks of 3 tokens (HEAD_CHUNK_ELEMENTS)."""
    import attention as _registers_minirl_varlen  # noqa: F401
    import forward
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attention)
    model.eval()
    monkeypatch.setattr(forward, "HEAD_CHUNK_ELEMENTS", 3 * model.config.vocab_size)
    batch = padded_batch([6, 3, 1, 4], [5, 2, 4, 1])
    response_mask = batch["attention_mask"][:, 6:].bool()
    with torch.no_grad():
        expected = reference_logprobs(model, batch, temperature=0.7)
        packed, packed_ent = token_logprobs(model, batch, temperature=0.7, use_remove_padding=True, calc_entropy=True)
        padded, padded_ent = token_logprobs(model, batch, temperature=0.7, use_remove_padding=False, calc_entropy=True)
    assert torch.allclose(packed[response_mask], expected[response_mask], atol=1e-5)
    assert torch.allclose(padded[response_mask], expected[response_mask], atol=1e-5)
    assert torch.allclose(packed_ent[response_mask], padded_ent[response_mask], atol=1e-5)


def test_packed_gradients_match_padded(tiny_model_dir):
    """Packed through minirl's per-sequence CPU attention vs padded through sdpa."""
    import attention as _registers_minirl_varlen  # noqa: F401
    batch = padded_batch([5, 2, 6], [3, 5, 2], seed=1)
    mask = batch["attention_mask"][:, 6:].float()
    grads = []
    for rmpad in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation="minirl_varlen" if rmpad else "sdpa")
        logp, _ = token_logprobs(model, batch, use_remove_padding=rmpad)
        (logp * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_packed_cpu_attention_never_spans_sequences(tiny_model_dir, monkeypatch):
    """minirl_varlen: sequences of similar length (within 1.5x) share one sdpa call, right-padded to the longest
    of them; no call sees two sequences in one row and the model builds no mask over the packed row. Its
    log-probs equal the one-sequence-at-a-time forward."""
    import torch.nn.functional as F
    import attention
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=attention.VARLEN_CPU).eval()
    batch = padded_batch([6, 4, 1, 4], [5, 4, 4, 1])                 # lengths 11, 8, 5, 5
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def recording_sdpa(query, key, value, attn_mask=None, **kwargs):
        calls.append((tuple(key.shape[::2]), attn_mask))                  # (sequences, length)
        return real_sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad():
        packed, _ = token_logprobs(model, batch, use_remove_padding=True)
        monkeypatch.undo()
        expected = reference_logprobs(model, batch, temperature=1.0)
    assert [shape for shape, _ in calls] == [(2, 11), (2, 5)] * model.config.num_hidden_layers
    assert all(mask is None for _, mask in calls)
    response_mask = batch["attention_mask"][:, 6:].bool()
    assert torch.allclose(packed[response_mask], expected[response_mask], atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_cpu_attention_matches_each_sequence_alone_in_float64(threads):
    """minirl_varlen on one packed row of 11 sequences (1 to 700 tokens: buckets of several lengths, and long
    enough that sdpa's CPU kernel works in several query and key blocks), grouped-query heads, at 1 and 2 torch
    threads: each sequence's output is causal attention over that sequence alone computed in float64, to fp32
    rounding, and running a sequence alone through minirl_varlen changes it by rounding only."""
    import types

    import torch.nn.functional as F
    import attention
    lengths = [700, 530, 300, 257, 129, 64, 63, 33, 31, 5, 1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, sum(lengths), 32, generator=g) for heads in (4, 2, 2))   # [1, H, nnz, d]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    module = types.SimpleNamespace(training=False)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = attention.varlen_cpu_attention(module, q, k, v, None,
                                                cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32))[0][0]
        alone = [attention.varlen_cpu_attention(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None)[0][0]
                 for s, e in pieces]                                                  # each [L, Hq, d]
    finally:
        torch.set_num_threads(threads_before)
    for (s, e), single in zip(pieces, alone):
        qq, kk, vv = (x[0, :, s:e].double() for x in (q, k, v))                       # [H, L, d]
        expected = F.scaled_dot_product_attention(qq, kk.repeat_interleave(2, 0), vv.repeat_interleave(2, 0),
                                                  is_causal=True).transpose(0, 1)      # [L, Hq, d]
        torch.testing.assert_close(packed[s:e].double(), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(single, packed[s:e], atol=1e-6, rtol=0)


def grouped_batch():
    """GRPO-shaped rows: rows 0, 2 and 4 share one prompt (row 4's response is empty), rows 1 and 5 another (of
    the longest length), row 3 has its own."""
    batch = padded_batch([4, 6, 4, 3, 4, 6], [5, 2, 3, 4, 0, 5], seed=2)
    for rows in ([0, 2, 4], [1, 5]):
        batch["input_ids"][rows, :6] = batch["input_ids"][rows[0], :6]
    batch["prompts"] = batch["input_ids"][:, :6]
    return batch


def test_shared_prompt_rows_hold_each_prompt_once_and_match_an_unpadded_forward(tiny_model_dir):
    """minirl_varlen packs a group's prompt once ([prompt + response, response, ...]); log-probs, entropy and
    gradients equal a one-sequence-at-a-time forward and the padded sdpa path."""
    import attention
    import forward
    batch = grouped_batch()
    inputs, _ = forward._model_inputs(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention.VARLEN_CPU), batch, True,
        share_prompts=True)
    assert inputs["input_ids"].shape[1] == (4 + 6 + 3) + (5 + 2 + 3 + 4 + 0 + 5)
    response_mask = batch["attention_mask"][:, 6:].bool()
    results = {}
    for name, attn, rmpad in (("shared", attention.VARLEN_CPU, True), ("padded", "sdpa", False)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn)
        logp, entropy = token_logprobs(model, batch, temperature=0.7, use_remove_padding=rmpad, calc_entropy=True)
        (logp * response_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (logp.detach(), entropy.detach(), grads)
        if name == "shared":
            with torch.no_grad():
                expected = reference_logprobs(model, batch, temperature=0.7)
    shared, padded = results["shared"], results["padded"]
    assert torch.allclose(shared[0][response_mask], expected[response_mask], atol=1e-5)
    assert torch.allclose(shared[1][response_mask], padded[1][response_mask], atol=1e-5)
    assert torch.allclose(shared[2], padded[2], atol=1e-5)


@pytest.mark.parametrize("mask_elements", [2 ** 24, 0])
def test_shared_prefix_attention_matches_each_sequence_alone_in_float64(mask_elements, monkeypatch):
    """varlen_cpu_attention with shared_prefixes: a row [prompt A + response, response, prompt B + response,
    response, response] (responses of several lengths: several buckets) gives each response what causal
    attention over its own [prompt, response] gives, computed in float64; both ways of attending to the prefix
    (an additive mask, and causal attention over [prefix, response] when the mask would be over MASK_ELEMENTS)."""
    import types

    import torch.nn.functional as F
    import attention
    monkeypatch.setattr(attention, "MASK_ELEMENTS", mask_elements)
    attention.row_layout.cache_clear()
    prompt_a, prompt_b, responses_a, responses_b = 37, 5, [20, 64, 3], [50, 1, 9]
    sequences = [(prompt_a, r) for r in responses_a] + [(prompt_b, r) for r in responses_b]
    g = torch.Generator().manual_seed(0)
    qkv = [[torch.randn(heads, p + r, 32, generator=g) for heads in (4, 2, 2)] for p, r in sequences]
    for i in (1, 2, 4, 5):                                    # the repeats of a prompt: the same tokens, so q/k/v
        first = 0 if i < 3 else 3
        for x, x0 in zip(qkv[i], qkv[first]):
            x[:, :sequences[i][0]] = x0[:, :sequences[first][0]]
    row, bounds, prefixes, where = [[], [], []], [0], [], []
    for i, (p, r) in enumerate(sequences):
        first = i in (0, 3)
        start = bounds[-1]
        for part, x in zip(row, qkv[i]):
            part.append(x if first else x[:, p:])
        bounds.append(start + (p + r if first else r))
        prefixes.append((0, 0) if first else (bounds[0 if i < 3 else 3], p))
        where.append(start + (p if first else 0))             # where the response starts in the row
    q, k, v = (torch.cat(part, 1).unsqueeze(0) for part in row)
    out = attention.varlen_cpu_attention(types.SimpleNamespace(training=False), q, k, v, None,
                                         cu_seq_lens_q=torch.tensor(bounds), shared_prefixes=prefixes)[0][0]
    attention.row_layout.cache_clear()
    for (p, r), (qq, kk, vv), start in zip(sequences, qkv, where):
        expected = F.scaled_dot_product_attention(qq.double(), kk.repeat_interleave(2, 0).double(),
                                                  vv.repeat_interleave(2, 0).double(), is_causal=True)
        torch.testing.assert_close(out[start:start + r].double(), expected[:, p:].transpose(0, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device, remove_padding, flash_installed, expected", [
    ("cpu", True, False, "minirl_varlen"), ("cpu", False, False, "sdpa"),
    ("cuda", True, True, "flash_attention_2"), ("cuda", True, False, "minirl_varlen"), ("cuda", False, True, "sdpa"),
    ("npu", True, False, "flash_attention_2"), ("npu", False, False, "sdpa"),
])
def test_attention_backend_selection(device, remove_padding, flash_installed, expected):
    """Packed rows get a varlen attention on every device: flash-attn's on CUDA, torch_npu's fused attention on
    NPU (transformers routes flash_attention_2 there), the per-sequence one elsewhere."""
    from attention import attention_backend
    assert attention_backend(device, remove_padding, flash_attn_installed=flash_installed) == expected


def test_only_response_positions_reach_the_lm_head(tiny_model_dir):
    """The LM head sees one row per valid response token (the prompt's positions never reach it), packed or
    padded."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = padded_batch([6, 3, 1, 4], [5, 2, 4, 1])
    rows = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        for rmpad in (True, False):
            rows.clear()
            token_logprobs(model, batch, use_remove_padding=rmpad, calc_entropy=True)
            assert sum(r for r in rows) == 5 + 2 + 4 + 1
    handle.remove()


def test_fixed_micro_batches():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


def test_balanced_partitions_equal_size():
    # lengths 9,8,7,1,1,1 into 2 groups of 3, longest first, each to the lightest group with room:
    # 9 -> g0 (0); 8 -> g1 (0); 7 -> g1 (8 < 9): g1 = 15; 1 -> g0 (10); 1 -> g0 (11, now full); 1 -> g1 (16).
    parts = balanced_partitions([9, 8, 7, 1, 1, 1], 2, equal_size=True)
    assert parts == [[0, 3, 4], [1, 2, 5]]


def balance_batch(lengths, uids):
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return {"attention_mask": mask, "uid": uids, "row": torch.arange(len(lengths))}


@pytest.mark.parametrize("rank", [0, 1])
def test_balancing_whole_groups_keeps_a_prompts_rows_together(rank):
    """Groups (a, b, c, d) of 2 rows with token totals a 9+8=17, b 1+1=2, c 7+6=13, d 2+3=5, into 2 ranks of 2
    groups, heaviest first, each to the lighter rank: a -> r0 (17); c -> r1 (13); d -> r1 (18); b -> r0 (19).
    Groups keep their rows in order; rows alone (verl's way) split groups: the 9 and the 8 land on different
    ranks. Groups that do not divide over the ranks, or are of different sizes, fall back to rows."""
    from batch import balance_and_shard
    lengths, uids = [9, 8, 1, 1, 7, 6, 2, 3], list("aabbccdd")
    batch, mine, local, metrics = balance_and_shard(balance_batch(lengths, uids), rank, 2, whole_groups=True)
    assert batch["row"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert local["uid"] == [list("aabb"), list("ccdd")][rank] and mine == [[0, 1, 2, 3], [4, 5, 6, 7]][rank]
    assert (metrics["global_seqlen/balanced_min"], metrics["global_seqlen/balanced_max"]) == (18, 19)
    by_rows = balance_and_shard(balance_batch(lengths, uids), rank, 2)[0]["row"].tolist()
    assert (0 in by_rows[:4]) != (1 in by_rows[:4])
    for rows, groups in ((6, uids[:6]), (8, list("aaabbbcc"))):     # 3 groups over 2 ranks; groups of 3 and 2
        fallback = balance_and_shard(balance_batch(lengths[:rows], groups), rank, 2, whole_groups=True)
        assert fallback[0]["row"].tolist() == balance_and_shard(balance_batch(lengths[:rows], groups), rank, 2)[0][
            "row"].tolist()


def test_dynamic_micro_batches_respect_budget():
    lengths = [7, 3, 5, 2, 8, 1]
    parts = dynamic_micro_batches(lengths, max_tokens=10)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert all(sum(lengths[i] for i in p) <= 10 for p in parts)
    assert len(parts) == 3          # 26 tokens need at least 3 budgets of 10


def test_dynamic_micro_batches_keep_a_prompts_rows_together_under_the_packed_budget():
    """Rows 0, 2, 4 share a 4-token prompt, rows 1, 5 a 6-token one, row 3 is alone (grouped_batch): packed with
    each prompt once the groups hold 4+5+3+0=12, 6+2+5=13 and 7 tokens. Budget 13: three micro-batches, one per
    group. Budget 12: the 13-token group is split into its rows (8 and 11 tokens)."""
    from forward import shared_prompt_groups
    batch = grouped_batch()
    lengths = batch["attention_mask"].sum(-1).tolist()                 # [9, 8, 7, 7, 4, 11]
    groups = shared_prompt_groups(batch)
    assert groups == [([0, 2, 4], 12), ([1, 5], 13), ([3], 7)]
    assert sorted(dynamic_micro_batches(lengths, 13, groups=groups)) == [[0, 2, 4], [1, 5], [3]]
    parts = dynamic_micro_batches(lengths, 12, groups=groups)
    assert sorted(i for p in parts for i in p) == list(range(6)) and not any({1, 5} <= set(p) for p in parts)
    assert any({0, 2, 4} <= set(p) for p in parts)


def test_response_mask_stops_after_first_eos():
    responses = torch.tensor([[5, 6, 2, 7, 2], [2, 5, 5, 5, 5], [5, 5, 5, 5, 5]])
    assert response_mask_from_eos(responses, [2]).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_responses_to_batch_layout():
    prompts = {"input_ids": torch.tensor([[0, 0, 11, 12], [13, 14, 15, 16]]),
               "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
               "position_ids": torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]])}
    out = responses_to_batch(prompts, [[21, 2, 99], [22, 23, 24, 25, 26]], response_length=4, pad_id=0, eos_ids=[2])
    assert out["responses"].tolist() == [[21, 2, 99, 0], [22, 23, 24, 25]]      # cut to R=4, right padded
    assert out["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]       # up to and including EOS
    assert out["position_ids"][:, 4:].tolist() == [[2, 3, 4, 5], [4, 5, 6, 7]]  # continue from the last prompt pos
    assert out["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]


def test_reward_model_score_equals_a_sequence_classification_forward(tiny_rm_dir):
    """A sequence-classification RM loaded as minirl loads it (token classification, score at the last valid
    token, packed) scores each row as transformers' own Qwen2ForSequenceClassification does on the unpadded text."""
    from transformers import AutoModelForSequenceClassification
    from forward import last_token_scores
    from models import load_model
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_rm_dir, dtype=torch.float32).eval()
    loaded = load_model(tiny_rm_dir, kind="token_cls").eval()
    batch = padded_batch([6, 3, 1, 4], [5, 2, 4, 1], seed=3)
    with torch.no_grad():
        expected = torch.stack([reference(input_ids=row[m.bool()].unsqueeze(0)).logits[0, 0]
                                for row, m in zip(batch["input_ids"], batch["attention_mask"])])
        packed = last_token_scores(loaded, batch, use_remove_padding=True)
        padded = last_token_scores(loaded, batch, use_remove_padding=False)
    assert torch.allclose(packed, expected, atol=1e-5)
    assert torch.allclose(padded, expected, atol=1e-5)


def test_critic_values_are_the_head_before_each_response_token(tiny_critic_dir):
    from forward import token_values
    from models import load_model
    critic = load_model(tiny_critic_dir, kind="token_cls").eval()
    batch = padded_batch([2, 6], [3, 5], seed=4)
    with torch.no_grad():
        values = token_values(critic, batch)                               # [2, R]
        row = batch["input_ids"][0][batch["attention_mask"][0].bool()].unsqueeze(0)   # 2 prompt + 3 response
        direct = critic(input_ids=row).logits[0, :, 0]                    # one value per position
    # the value of response token t is the head's output at the position before it: positions 1, 2, 3
    assert torch.allclose(values[0, :3], direct[1:4], atol=1e-5)


def test_lr_schedule_warmup_constant_and_cosine():
    from config import Config
    from models import lr_lambda
    optim = Config(lr_warmup_steps=4, lr_warmup_steps_ratio=0.0, min_lr_ratio=0.0, num_cycles=0.5,
                   warmup_style="constant")
    constant = lr_lambda(optim, total_steps=20)
    assert [constant(s) for s in (0, 1, 2, 4, 10)] == [0.0, 0.25, 0.5, 1.0, 1.0]    # linear from 0, then 1
    cosine = lr_lambda(Config(optim, warmup_style="cosine", min_lr_ratio=0.1), total_steps=14)
    # warmup from min_lr_ratio: 0.1 + 0.9 * 2/4 = 0.55 at step 2; after warmup progress = (s-4)/10 and
    # factor = max(0.1, 0.9 * 0.5 * (1 + cos(pi * 2 * 0.5 * progress)) + 0.1): 1.0 at s=4, 0.55 at s=9, 0.1 at s=14
    assert cosine(2) == pytest.approx(0.55)
    assert [cosine(s) for s in (4, 9, 14)] == pytest.approx([1.0, 0.55, 0.1])
    ratio = lr_lambda(Config(optim, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.25), total_steps=20)
    assert ratio(2) == pytest.approx(2 / 5)                  # warmup = int(0.25 * 20) = 5 steps


def test_a_resume_keeps_its_place_in_the_schedule_and_takes_this_runs_settings():
    """Found by fuzzing: LambdaLR's state restored the checkpoint's base lr and the optimizer's state the lr its
    last step left, so a resume with another optim.lr kept the old lr, and a cosine schedule over 2 steps (warmup 1)
    resumed for 4 (warmup 2) trained step 3 at the old schedule's end, lr 0, where an uninterrupted 4-step run has
    0.001. Worker.resume_schedule uses only the optimizer and the scheduler, so a plain module stands in."""
    from types import SimpleNamespace
    from config import Config
    from models import Worker, lr_lambda

    def worker(lr, total_steps):
        optim_cfg = Config(lr=lr, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.5, min_lr_ratio=0.0, num_cycles=0.5,
                           warmup_style="cosine")
        optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=lr)
        return SimpleNamespace(optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(optim_cfg, total_steps)))

    checkpointed = worker(1e-3, total_steps=2)
    for _ in range(2):                                   # two steps: lr 0, then 0.001; the next would be 0
        checkpointed.optimizer.step()
        checkpointed.scheduler.step()
    saved = checkpointed.scheduler.state_dict()
    same = worker(1e-3, total_steps=2)
    assert Worker.resume_schedule(same, saved) == (0.0, 0.0)        # same settings: the checkpoint's lr
    longer = worker(1e-3, total_steps=4)                 # warmup 2: steps 0..3 at 0, 0.0005, 0.001, 0.0005
    assert Worker.resume_schedule(longer, saved) == (0.0, 1e-3)
    assert longer.optimizer.param_groups[0]["lr"] == longer.scheduler.get_last_lr()[0] == 1e-3
    longer.optimizer.step()
    longer.scheduler.step()
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    lower = worker(1e-5, total_steps=4)                  # another optim.lr: this run's, at the same place
    assert Worker.resume_schedule(lower, saved) == (0.0, 1e-5)
    midway = worker(1e-3, total_steps=4)                 # same settings mid-schedule: the checkpoint's lr exactly
    for _ in range(3):
        midway.optimizer.step()
        midway.scheduler.step()
    checkpoint_lr = midway.optimizer.param_groups[0]["lr"]
    assert checkpoint_lr > 0
    assert Worker.resume_schedule(worker(1e-3, total_steps=4), midway.scheduler.state_dict()) == (checkpoint_lr,
                                                                                                  checkpoint_lr)


def test_critic_or_reward_model_that_does_not_fit_is_a_clear_error(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer
    from config import ConfigError
    from demo import build_tiny_model
    from models import check_fits, load_model
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    two_labels = build_tiny_model(tokenizer, kind="seq_cls")
    two_labels.config.num_labels = 2
    two_labels.save_pretrained(tmp_path / "two")
    with pytest.raises(ConfigError, match="2-output classification head.*num_labels=1"):
        load_model(tmp_path / "two", kind="token_cls")
    model = build_tiny_model(tokenizer, kind="token_cls")
    with pytest.raises(ConfigError, match="'critic.model.path': the model's vocabulary has 512 rows but the "
                                          "tokenizer it is fed has 600 tokens"):
        check_fits(model, 600, "critic.model.path")
    check_fits(model, len(tokenizer), "critic.model.path")      # fits: no error


def test_ignore_eos_generates_max_tokens(demo_dir):
    """The warmed-up demo model answers '#### N<|im_end|>' and stops; with ignore_eos it goes on past the EOS to
    max_tokens, as vLLM's ignore_eos does: the EOS is still generated, it just does not stop anything."""
    from transformers import AutoTokenizer
    from rollout import HFRollout, Sampling
    tokenizer = AutoTokenizer.from_pretrained(f"{demo_dir}/model")
    engine = HFRollout(f"{demo_dir}/model", tokenizer, torch.device("cpu"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3? Answer with #### and the number."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    stops, _ = engine.generate([prompt] * 2, Sampling(max_tokens=12, do_sample=False), seed=0)
    runs_on, _ = engine.generate([prompt] * 2, Sampling(max_tokens=12, do_sample=False, ignore_eos=True), seed=0)
    assert all(len(tokens) < 12 and tokens[-1] in engine.eos_ids for tokens in stops)
    assert all(len(tokens) == 12 and tokens[:len(stop)] == stop for tokens, stop in zip(runs_on, stops))
    sampled, _ = engine.generate([prompt] * 64, Sampling(max_tokens=12, ignore_eos=True), seed=0)
    assert all(len(tokens) == 12 for tokens in sampled)
    assert any(set(tokens[:-1]) & set(engine.eos_ids) for tokens in sampled)      # EOS drawn, and generation went on


def test_bucketed_weight_gather_equals_the_weights_before_sharding(tmp_path):
    """full_state_dict_items with bucket_bytes (the rollout sync's path: rollout.update_weights_bucket_megabytes)
    on 3 ranks, where FSDP2 splits rows unevenly (7 rows: 3+3+1; 2 rows: 1+1+0; 1 row: 1+0+0), with a bf16 unit
    and an unsharded buffer: for every bucket size the same names in the state dict's order and the same tensors
    as the model held before sharding, and as one all-gather per tensor gives."""
    from launch import torchrun
    torchrun(3, "tests/gather_probe.py", tmp_path / "out.pt", timeout=300)
    out = torch.load(tmp_path / "out.pt")
    names = list(out["unsharded"])
    assert list(out["full"]) == names
    for size, items in out["bucketed"].items():
        assert [name for name, _ in items] == names, size
        for name, tensor in items:
            expected = out["unsharded"][name]
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (size, name)
            assert torch.equal(tensor, out["full"][name]), (size, name)
    assert [name for name, _ in out["kept"]] == [name for name in names if name != "first.bias"]
