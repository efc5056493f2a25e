"""FLOPs of a training forward+backward, and model FLOP/s utilisation (verl's perf/mfu/actor).

The count is the matmul work minirl's forward and backward actually do (backward = 2x forward):
  * the decoder's linear layers: 6 x (their parameters) per token;
  * causal attention scores and values: per sequence of length s, 2 matmuls of s^2/2 x head_dim x heads
    (causal kernels skip the upper triangle), so 6 x head_dim x heads x layers x s^2 per sequence fwd+bwd;
  * the LM head: 6 x hidden x vocab per *response* token (only those reach the head: models.py).
verl's FlopsCounter counts the full s^2 square and the head on every token; the difference is work that minirl
does not do. Embedding lookups, norms and activations are not counted (not matmuls).

Peak FLOP/s per device: the dense bf16 figure of the vendor's data sheet (minirl's accelerator path runs in
bf16 mixed precision). A CPU has no such figure: perf/mfu/actor is left out there, and bench/step.py measures the
cores' fp32 matmul peak instead.

Left out: MoE, multimodal towers, sliding-window attention (counted as full causal).
"""
from __future__ import annotations

# dense bf16 peak FLOP/s by a substring of the device name (first match wins; more specific names first)
PEAK_FLOPS = (
    ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("H20", 148e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12), ("L20", 119.5e12), ("4090", 165e12),
    ("MI300X", 1307e12), ("910B", 354e12),
)


def peak_flops(device_name):
    """The table's bf16 peak for a device name (e.g. torch.cuda.get_device_name()), or None when unknown."""
    for key, flops in PEAK_FLOPS:
        if key in (device_name or ""):
            return flops
    return None


def device_name(device):
    """The accelerator's marketing name for a torch.device (None on CPU)."""
    if device.type == "cpu":
        return None
    import torch
    return getattr(torch, device.type).get_device_name(device)


def decoder_linear_shapes(config):
    """(in, out) of each linear layer of one decoder block of a Hugging Face config: q, k, v, o, gate, up, down."""
    hidden, inner = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim),
            (heads * head_dim, hidden), (hidden, inner), (hidden, inner), (inner, hidden)]


def training_flops(config, sequence_lengths, response_tokens):
    """Matmul FLOPs of one forward+backward of a decoder-only LM (a Hugging Face config) over sequences of
    `sequence_lengths` tokens, of which `response_tokens` (in all) reach the LM head."""
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    linear = sum(fan_in * fan_out for fan_in, fan_out in decoder_linear_shapes(config))   # parameters per block
    dense = 6 * linear * layers * sum(sequence_lengths)
    attention = 6 * head_dim * heads * layers * sum(s * s for s in sequence_lengths)
    head = 6 * hidden * config.vocab_size * response_tokens
    return dense + attention + head


def mfu(flops, seconds, peak, world_size):
    """Model FLOP/s utilisation: the work of all ranks over `seconds`, against world_size x peak."""
    return flops / (seconds * peak * world_size)
