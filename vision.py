"""Vision-language models (Qwen2-VL, Qwen2.5-VL): images from the parquet to the model and the rollout engines.

What happens to a row's images, in the order the trainer meets them (verl v0.5.0: rl_dataset.py RLHFDataset,
dp_actor.py `_forward_micro_batch`, vllm_rollout_spmd.py):
  1. data: the images under data.image_key ({"bytes", "path"} structs as Hugging Face datasets writes them, raw
     bytes, or paths relative to the parquet) are decoded with Pillow and checked when the dataset loads; the
     `<image>` markers split each message's text into typed parts ({"type": "image"} / {"type": "text"}).
  2. the model's own processor: chat template, then processor(text, images) -> input_ids with each image's tokens
     expanded (what prompt-length checks count), pixel_values [patches, C*T*p*p] and image_grid_thw [images, 3],
     kept per row as `multi_modal_inputs`. `raw_prompt_ids` (the rollout input) keep one image token per image.
  3. rollout: hf generates from the expanded ids plus the pixel inputs; vLLM gets the raw ids plus the PIL images
     and runs the same processor itself. Multi-turn (agent.py): every turn's request carries the prompt's images.
  4. training forward (forward.token_logprobs): a micro-batch's multi_modal_inputs are concatenated in row order,
     and Qwen2-VL's 3-row rope positions (temporal, height, width) come from the model's own `get_rope_index`;
     the packed path prepends the 1-D text positions as a fourth row, which transformers reads as the sequence
     boundaries. A VL critic runs the same forward: the model with a value head in place of its LM head
     (with_value_head).
Leaves out: a VL reward model (config.py refuses it: verl cannot load one), videos (a row with videos is an error),
image resizing of our own (the processor decides).
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch

from config_keys import ConfigError

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"


# ----------------------------------------------------------------------------------------------------------------
# Models and processors


def is_vision_language(config):
    """A checkpoint with a vision tower: its config nests a vision_config (Qwen2-VL, Qwen2.5-VL, ...)."""
    return getattr(config, "vision_config", None) is not None


def folder_is_vision_language(path):
    """is_vision_language from a checkpoint folder's config.json alone (no transformers, no weights): what the
    config checks use before anything loads. False when there is no readable config.json (other checks say so)."""
    try:
        return "vision_config" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def check_config(cfg):
    """ConfigError, before any model loads, for what a vision-language checkpoint (seen in its config.json) cannot
    do here: be the reward model, or save its critic as a Hugging Face model."""
    if cfg.reward_model.enable:
        check_reward_model_is_text(cfg.reward_model.model.path)
    if (cfg.algorithm.adv_estimator == "gae" and "hf_model" in cfg.critic.checkpoint.save_contents
            and folder_is_vision_language(cfg.critic.model.path)):
        raise ConfigError(f"'critic.checkpoint.save_contents' has hf_model, but 'critic.model.path'="
                          f"{cfg.critic.model.path} is a vision-language model, whose value head (with_value_head) "
                          f"has no Hugging Face class to save as; drop hf_model (the checkpoint still resumes exactly)")


def check_reward_model_is_text(path):
    """verl v0.5.0's reward model worker (fsdp_workers.py RewardModelWorker._build_model) loads
    AutoModelForTokenClassification, which no vision-language model has, and feeds it no pixels: refused."""
    if folder_is_vision_language(path):
        raise ConfigError(f"'reward_model.model.path'={path} is a vision-language model; a model-based reward needs "
                          f"a text token-classification checkpoint (as in verl), or use a rule reward "
                          f"(reward_model.enable=false)")


def causal_lm_class(config):
    """The Auto class that loads a generating model for `config`: image-text-to-text for a vision-language
    checkpoint (it picks the model's own class, e.g. Qwen2_5_VLForConditionalGeneration), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def with_value_head(model):
    """A vision-language critic: the model's own class with its LM head swapped for a fresh one-output linear head
    (values instead of logits), so the whole VL forward (images, rope positions, packing) is the actor's.
    transformers has no token-classification class for these models; verl v0.5.0 (utils/model.py
    load_valuehead_model) falls back to trl's value head on the image-text-to-text model, trained in full.
    The head starts like transformers' classification heads (normal(0, initializer_range), zero bias) from torch's
    seeded generator, so every rank builds the same one."""
    text_config = model.config.get_text_config()
    head = torch.nn.Linear(model.get_output_embeddings().in_features, 1, bias=True,
                           dtype=model.get_output_embeddings().weight.dtype)
    torch.nn.init.normal_(head.weight, std=text_config.initializer_range)
    torch.nn.init.zeros_(head.bias)
    model.set_output_embeddings(head)
    # the LM head was tied to the input embeddings; the value head is not (and must never be re-tied to them)
    model.config.tie_word_embeddings = text_config.tie_word_embeddings = False
    model.config.num_labels = 1
    return model


def load_processor(path, trust_remote_code=False):
    """The checkpoint's AutoProcessor when it is a vision-language model, else None (text models use the
    tokenizer alone)."""
    from transformers import AutoConfig, AutoProcessor
    if not is_vision_language(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)):
        return None
    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


def special_token_ids(config):
    """A vision-language model's image/video placeholder and boundary tokens ([] for a text model). The rollout
    ends a response at any of them, like at EOS: a generated placeholder would claim image features that do not
    exist in the training forward (and mean nothing in a response)."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if not is_vision_language(config):
        return []
    return [getattr(config, name) for name in names if getattr(config, name, None) is not None]


def vision_blocks(model):
    """The vision tower's transformer blocks (FSDP2 shards them one by one, like the decoder layers); [] for a
    text model."""
    base = getattr(model, model.base_model_prefix, model)
    visual = getattr(base, "visual", None)
    return list(visual.blocks) if visual is not None else []


def language_model(model):
    """The text decoder inside a vision-language model (which holds .layers), or the base model of a text one."""
    base = getattr(model, model.base_model_prefix, model)
    return getattr(base, "language_model", base)


# ----------------------------------------------------------------------------------------------------------------
# Data: images and markers


class ImageError(ValueError):
    """A row whose images cannot be used; the message names the file, the row and the fix."""


def split_markers(messages):
    """verl's RLHFDataset._build_messages: each message's text split on `<image>`/`<video>` into typed parts."""
    out = []
    for message in messages:
        parts = []
        for segment in re.split(f"({IMAGE_MARKER}|{VIDEO_MARKER})", message["content"]):
            if segment == IMAGE_MARKER:
                parts.append({"type": "image"})
            elif segment == VIDEO_MARKER:
                parts.append({"type": "video"})
            elif segment:
                parts.append({"type": "text", "text": segment})
        out.append({**message, "content": parts})
    return out


def count_markers(messages, marker=IMAGE_MARKER):
    return sum(m["content"].count(marker) for m in messages)


def decode_image(value, base_dir):
    """One image as a PIL RGB image. value: {"bytes", "path"} (bytes win when present), raw bytes, or a path
    (relative paths resolve against `base_dir`, the parquet's folder). Raises ValueError/OSError with the cause."""
    from PIL import Image
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path") or value.get("bytes")     # b"" without a path stays b""
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise ValueError("the image's bytes are empty (0 bytes); store the encoded image (PNG, JPEG, ...)")
        source = io.BytesIO(value)
    elif isinstance(value, str) and value:
        source = Path(value) if Path(value).is_absolute() else Path(base_dir) / value
        if not source.is_file():
            raise FileNotFoundError(f"image file {source} " + ("is not a file" if source.exists() else
                                                                "does not exist"))
    else:
        raise ValueError(f"expected image bytes, a path or a {{'bytes', 'path'}} struct, got {value!r:.80}")
    try:
        with Image.open(source) as image:
            image.load()                  # decode now: a truncated or corrupt file fails here, not in the rollout
            return image.convert("RGB")
    except Image.DecompressionBombError as err:       # not an OSError: it would escape the row's message
        raise ValueError(f"{err} Pillow refuses an image that large; downscale it") from None


def row_images(row, image_key, base_dir, where):
    """The decoded images of a row (possibly []), checked against the row's `<image>` markers."""
    values = row.get(image_key)
    values = [] if values is None else list(values) if isinstance(values, (list, tuple)) else [values]
    images = []
    for k, value in enumerate(values):
        try:
            images.append(decode_image(value, base_dir))
        except (OSError, ValueError) as err:
            raise ImageError(f"{where}, column {image_key!r}, image {k}: cannot read the image ({err}); fix or "
                             f"drop the row") from err
    return images


def check_image_shape(image, where):
    """Qwen2-VL's resize rule (its image processor's and vLLM's) run on the image's size alone, before any step:
    it refuses an aspect ratio over 200 (a 5000 x 20 strip), which otherwise stopped the run at the row's turn."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    try:
        smart_resize(image.height, image.width)
    except ValueError as err:
        raise ImageError(f"{where}: the image is {image.width} x {image.height} pixels, which Qwen2-VL's image "
                         f"processor refuses ({err}); pad or crop it, or drop the row") from None


def check_row(row, prompt_key, image_key, video_key, base_dir, where):
    """Fail early on a row a vision-language model cannot take: videos, an image the processor's resize refuses,
    or `<image>` markers that do not match the images. Returns the decoded images."""
    if row.get(video_key):
        raise ImageError(f"{where}, column {video_key!r}: the row has videos, which minirl does not support yet; "
                         f"drop the column or the row")
    images = row_images(row, image_key, base_dir, where)
    for k, image in enumerate(images):
        check_image_shape(image, f"{where}, column {image_key!r}, image {k}")
    markers = count_markers(row[prompt_key])
    if markers != len(images):
        raise ImageError(f"{where}: the prompt has {markers} {IMAGE_MARKER} marker(s) but column {image_key!r} "
                         f"holds {len(images)} image(s); each image needs one {IMAGE_MARKER} where it belongs "
                         f"in the text")
    return images


def encode_prompt(processor, messages, images, chat_template=None, tools=None):
    """The processor's view of one prompt: (input_ids with the image tokens expanded, raw ids with one image
    token per image (the vLLM input), multi_modal_inputs {pixel_values, image_grid_thw} or {} without images).
    `tools`: the tool schemas a multi-turn run's template lists (as for a text model)."""
    typed = split_markers(messages)
    text = processor.apply_chat_template(typed, chat_template=chat_template, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    raw_ids = processor.tokenizer.encode(text, add_special_tokens=False)
    if not images:
        return raw_ids, raw_ids, {}
    out = processor(text=[text], images=images, return_tensors="pt")
    inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    return out["input_ids"][0].tolist(), raw_ids, inputs


# ----------------------------------------------------------------------------------------------------------------
# Forward pass: pixel inputs and rope positions for a micro-batch


def concat_inputs(multi_modal_inputs):
    """A micro-batch's per-row {pixel_values, image_grid_thw} concatenated in row order (the order the model
    meets the image tokens); {} when no row has an image."""
    rows = [m for m in multi_modal_inputs if m]
    if not rows:
        return {}
    return {key: torch.cat([m[key] for m in rows]) for key in ("pixel_values", "image_grid_thw")}


def token_types(config, input_ids):
    """0 for text, 1 for image tokens, 2 for video tokens: what get_rope_index groups positions by."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == getattr(config, "video_token_id", -1)] = 2
    return types


def rope_positions(model, input_ids, attention_mask, image_grid_thw):
    """Qwen2-VL's 3-row positions [3, b, L] from the model's own get_rope_index: text tokens count up by one, an
    image's tokens take (t, h, w) grid coordinates; padding gets 0."""
    base = getattr(model, model.base_model_prefix)
    positions, _ = base.get_rope_index(input_ids, mm_token_type_ids=token_types(model.config, input_ids),
                                       image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return positions                                                     # [3, b, L]


def forward_kwargs(model, batch, packed_indices=None, packed_positions=None):
    """Model arguments for a vision-language micro-batch ({} for a text model), overriding the text ones:
    pixel_values, image_grid_thw, input_ids (response_placeholders_masked) and the rope positions. Padded:
    position_ids [3, b, L]. Packed (packed_indices [nnz] into the flattened [b*L], packed_positions [1, nnz] the
    1-D positions that restart per sequence): [4, 1, nnz], the 1-D row first (transformers builds the
    per-sequence attention mask from it)."""
    if not is_vision_language(model.config):
        return {}
    inputs = concat_inputs(batch.get("multi_modal_inputs") or [])
    input_ids = response_placeholders_masked(model.config, batch["input_ids"], batch["responses"].shape[1])
    inputs = {k: v.to(input_ids.device) for k, v in inputs.items()}
    positions = rope_positions(model, input_ids, batch["attention_mask"], inputs.get("image_grid_thw"))   # [3, b, L]
    if packed_indices is not None:
        positions = positions.reshape(3, -1)[:, packed_indices].unsqueeze(1)     # [3, 1, nnz]
        positions = torch.cat([packed_positions.unsqueeze(0), positions])         # [4, 1, nnz]
        input_ids = input_ids.reshape(-1)[packed_indices].unsqueeze(0)            # [1, nnz]
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(next(model.parameters()).dtype)
    return {**inputs, "input_ids": input_ids, "position_ids": positions}


def response_placeholders_masked(config, input_ids, response_len):
    """input_ids [b, L] with image/video placeholders in the response replaced by a text token. The rollout ends a
    response at one (special_token_ids), so it is the last token: its log-prob is read from the position before,
    and no later position sees its embedding; left as is, the model would look for image features for it."""
    response = input_ids[:, input_ids.shape[1] - response_len:]
    placeholder = torch.isin(response, torch.tensor(special_token_ids(config), device=input_ids.device))
    if not placeholder.any():
        return input_ids
    out = input_ids.clone()
    out[:, input_ids.shape[1] - response_len:] = response.masked_fill(placeholder, 0)
    return out


def generate_kwargs(model, input_ids, multi_modal_inputs):
    """Pixel inputs for HF generate on left-padded input_ids [b, P], plus the token types the model needs to
    build its rope positions (without them it falls back to 1-D positions)."""
    inputs = concat_inputs(multi_modal_inputs)
    if not inputs:
        return {}
    return {**{k: v.to(input_ids.device) for k, v in inputs.items()},
            "mm_token_type_ids": token_types(model.config, input_ids)}


# ----------------------------------------------------------------------------------------------------------------
# Rollout


def rollout_inputs(batch, rows):
    """What the engines need besides the raw prompt ids, for `rows` of a prompt batch, or None when no row has an
    image: per row {"images": PIL list (vLLM runs its processor on them), "prompt_ids": the expanded prompt ids
    and "inputs": multi_modal_inputs (hf generates from these)}."""
    data = batch.get("multi_modal_data")
    if not data or not any(data[i] for i in rows):
        return None
    out = []
    for i in rows:
        mask = batch["attention_mask"][i].bool()
        out.append({"images": (data[i] or {}).get("image", []), "prompt_ids": batch["input_ids"][i][mask].tolist(),
                    "inputs": batch["multi_modal_inputs"][i] or {}})
    return out
