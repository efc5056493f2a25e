"""The vision-language demo: a tiny random Qwen2.5-VL with a locally built processor, and a visual task (which
colour is the square?) rendered with Pillow, with a short supervised warm-up so RL starts with a signal.

    python data.py demo-vl --out demo-vl     # DIR/model, DIR/data/{train,test}.parquet (verl format, images kept)
From python: build_vl_processor(out_dir), build_tiny_vl_model(processor), make_vl_demo_assets(out_dir).
Tests build their tiny VL models here too. Leaves out: any real model or image data; sizes are chosen for CPU tests
(head_dim 32 in both towers; 56x56 images become 4 image tokens).
"""

import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from demo import TURN_END, TURN_START, build_tokenizer, default_tokenizer_corpus, teacher_forcing_batch, warm_up
from rewards import minirl_colour_compute_score
from vision import IMAGE_MARKER, encode_prompt, generate_kwargs

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's chat template, cut down: a message's content is a string or a list of typed parts
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
IMAGE_SIZE = 56                  # pixels a side: 2x2 merged patches of 28 px, i.e. 4 image tokens
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
VL_PROMPT = f"{IMAGE_MARKER}What colour is the square? Answer with #### and the colour."
VL_DATA_SOURCE = "minirl/colour"


# ------------------------------------------------------------------------------------------------------------
# Tiny processor and model
# ------------------------------------------------------------------------------------------------------------
def build_vl_processor(out_dir):
    """Qwen2.5-VL's processor from local parts: its image (and video) processor at demo image sizes, the demo
    tokenizer with the vision special tokens, and a chat template that places an image's tokens. Saved to
    out_dir."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    corpus = default_tokenizer_corpus() + [
        f"{TURN_START}user\n{VL_PROMPT}{TURN_END}\n{TURN_START}assistant\n#### {colour}{TURN_END}\n"
        for colour in COLOURS]
    tokenizer = build_tokenizer(out_dir, corpus=corpus, extra_special_tokens=VISION_TOKENS,
                                chat_template=VL_CHAT_TEMPLATE)
    pixels = IMAGE_SIZE * IMAGE_SIZE
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=4 * pixels),
                                    tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(),
                                    chat_template=VL_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    return processor


def build_tiny_vl_model(processor, seed=0):
    """A randomly initialised fp32 Qwen2.5-VL: text hidden 64, 2 layers, 2 query heads and 1 KV head (head_dim
    32); vision tower of depth 2, hidden 64, 2 heads (head_dim 32), 14-px patches merged 2x2."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 6, 6]},   # halves of head_dim 32 per t/h/w
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        tie_word_embeddings=True, **ids)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


# ------------------------------------------------------------------------------------------------------------
# The task: which colour is the square?
# ------------------------------------------------------------------------------------------------------------
def render_square(colour, rng):
    """PNG bytes: a square of `colour` (random size and place) on a grey background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (128, 128, 128))
    side = rng.randint(14, 36)
    x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def vl_demo_rows(split, count, seed=0):
    """verl-format rows: the prompt with its `<image>` marker, the image as a {bytes, path} struct (what Hugging
    Face datasets stores for an Image feature), the colour as ground truth."""
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for index in range(count):
        colour = rng.choice(sorted(COLOURS))
        rows.append({
            "data_source": VL_DATA_SOURCE,
            "prompt": [{"role": "user", "content": VL_PROMPT}],
            "images": [{"bytes": render_square(colour, rng), "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": colour},
            "extra_info": {"split": split, "index": index, "answer": colour},
        })
    return rows


def _encoded(processor, rows):
    """(expanded prompt ids, multi_modal_inputs) per row."""
    from vision import decode_image
    out = []
    for row in rows:
        images = [decode_image(v, ".") for v in row["images"]]
        ids, _, inputs = encode_prompt(processor, row["prompt"], images)
        out.append((ids, inputs))
    return out


@torch.no_grad()
def vl_accuracy(model, processor, rows, encoded=None, max_new_tokens=6):
    """Greedy HF generate on the rows (left-padded, with their pixel inputs) -> (format rate, accuracy)."""
    tokenizer = processor.tokenizer
    encoded = encoded or _encoded(processor, rows)
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)        # [N, P]
    attention_mask = torch.zeros_like(input_ids)                                                  # [N, P]
    for i, (ids, _) in enumerate(encoded):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    was_training = model.training
    model.eval()
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                            max_new_tokens=max_new_tokens,
                            **generate_kwargs(model, input_ids, [inputs for _, inputs in encoded]))
    model.train(was_training)
    texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    scores = [minirl_colour_compute_score(t, row["reward_model"]["ground_truth"]) for t, row in zip(texts, rows)]
    return sum(s > 0 for s in scores) / len(rows), sum(s == 1.0 for s in scores) / len(rows)


def warm_up_vl_model(model, processor, train_rows, eval_rows, *, seed=0, label_noise=0.4, lr=2e-3, batch_size=32,
                     check_every=5, target_accuracy=0.4, max_steps=300):
    """Supervised warm-up (demo.warm_up) on '#### <colour><|im_end|>' with noisy labels, until greedy accuracy on
    eval_rows reaches target_accuracy (with the format learnt): a policy that looks at the image but is often
    wrong. Returns {"steps", "format", "accuracy"}."""
    tokenizer = processor.tokenizer
    rng = random.Random(seed)
    train, evaluation = _encoded(processor, train_rows), _encoded(processor, eval_rows)

    def batches(step):
        picks = rng.sample(range(len(train_rows)), batch_size)
        examples = []
        for i in picks:
            answer = train_rows[i]["reward_model"]["ground_truth"]
            if rng.random() < label_noise:
                answer = rng.choice(sorted(COLOURS))
            response = tokenizer.encode(f"#### {answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
            examples.append((train[i][0], response, train[i][1]))
        return _teacher_forcing_batch(model, examples, tokenizer.pad_token_id)

    def evaluate():
        fmt, accuracy = vl_accuracy(model, processor, eval_rows, evaluation)
        return {"format": fmt, "accuracy": accuracy}

    return warm_up(model, batches, evaluate, lambda m: m["format"] >= 0.9 and m["accuracy"] >= target_accuracy,
                   seed=seed, lr=lr, check_every=check_every, max_steps=max_steps)


def _teacher_forcing_batch(model, examples, pad_token_id):
    """(prompt ids, response ids, pixel inputs) examples -> model kwargs with labels (-100 outside the response)
    and the pixel inputs."""
    batch = teacher_forcing_batch([(prompt + response, [-100] * len(prompt) + response)
                                   for prompt, response, _ in examples], pad_token_id)
    return dict(batch, **generate_kwargs(model, batch["input_ids"], [inputs for _, _, inputs in examples]))


def make_vl_demo_assets(out_dir, train_count=512, test_count=64):
    """Write out_dir/model (warmed-up tiny Qwen2.5-VL + processor) and out_dir/data/{train,test}.parquet.
    Returns {"model", "train", "test", "warmup"} paths; warmup.json holds the measured format/accuracy."""
    out_dir = Path(out_dir)
    model_dir, data_dir = out_dir / "model", out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = {"train": vl_demo_rows("train", train_count), "test": vl_demo_rows("test", test_count)}
    for split, split_rows in rows.items():
        pq.write_table(pa.Table.from_pylist(split_rows), data_dir / f"{split}.parquet")
    processor = build_vl_processor(model_dir)
    model = build_tiny_vl_model(processor)
    warmup = warm_up_vl_model(model, processor, rows["train"], rows["test"])
    model.save_pretrained(model_dir)
    (out_dir / "warmup.json").write_text(json.dumps(warmup, indent=1) + "\n")
    return {"model": model_dir, "train": data_dir / "train.parquet", "test": data_dir / "test.parquet",
            "warmup": out_dir / "warmup.json"}
