"""flops.py: the FLOP count of a forward+backward against torch's own FLOP counter, and the peak table."""
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

import attention
import flops
from forward import token_logprobs
from conftest import padded_batch


def test_training_flops_match_torchs_flop_counter(tiny_model_dir):
    """torch's FlopCounterMode counts every matmul of a packed forward+backward (the per-sequence attention's
    sdpa is not among the ops it counts on CPU); flops.training_flops must equal that plus the causal attention
    term worked out by hand: 6 x head_dim 32 x 2 heads x 2 layers x sum(len^2)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=attention.VARLEN_CPU)
    batch = padded_batch([6, 3, 1, 4], [5, 2, 4, 1])
    with FlopCounterMode(display=False) as counter:
        logp, _ = token_logprobs(model, batch, use_remove_padding=True)
        logp.sum().backward()
    lengths = batch["attention_mask"].sum(-1).tolist()                     # [11, 5, 5, 5]
    attention_by_hand = 6 * 32 * 2 * 2 * (11 ** 2 + 3 * 5 ** 2)
    response_tokens = 5 + 2 + 4 + 1
    assert flops.training_flops(model.config, lengths, response_tokens) == \
        counter.get_total_flops() + attention_by_hand


def test_peak_flops_by_device_name():
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops("NVIDIA L40S") == 362e12 and flops.peak_flops("NVIDIA L40") == 181e12
    assert flops.peak_flops("Ascend910B2") == 354e12
    assert flops.peak_flops("some new card") is None and flops.peak_flops(None) is None
    assert flops.mfu(4e12, 2.0, 1e12, 2) == 1.0
