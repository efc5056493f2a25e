"""Vision-language models (vision.py) on the tiny random Qwen2.5-VL: the data forms verl writes, the clear errors on
bad rows, and the training forward (padded, packed) against a plain forward of the processor's outputs.
(The VL runs under torchrun, with both engines: test_vision_runs.py.)
Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_vision.py -q"""

import importlib.util
import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import vision
from attention import VARLEN_CPU
from data import RLHFDataset, collate
from demo_vl import COLOURS, VL_PROMPT, render_square
from forward import token_logprobs, token_values
from models import load_model
from rollout import responses_to_batch
from test_vllm import clean_env  # noqa: F401  (fixture)

# transformers' Qwen2-VL processors import torchvision; setup.sh installs it (an older .venv may lack it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                                reason="torchvision is not installed: re-run `bash setup.sh`")


@pytest.fixture(scope="module")
def processor(tiny_vl_dir):
    return vision.load_processor(tiny_vl_dir)


def png(colour="red", size=56, seed=0):
    import random
    if size == 56:
        return render_square(colour, random.Random(seed))
    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (size, size // 2), COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()


def write_vl_rows(path, prompts, images, **columns):
    table = {"data_source": ["minirl/colour"] * len(prompts),
             "prompt": [[{"role": "user", "content": p}] for p in prompts],
             "reward_model": [{"style": "rule", "ground_truth": "red"}] * len(prompts),
             "images": images}
    table.update(columns)
    pq.write_table(pa.table(table), path)
    return path


# ------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------
def test_image_forms_struct_bytes_and_relative_path_load_alike(processor, tmp_path):
    image = png("blue")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "b.png").write_bytes(image)
    forms = {"struct": [{"bytes": image, "path": "ignored-when-bytes.png"}], "bytes": [image],
             "path": ["imgs/b.png"], "struct_path_only": [{"bytes": None, "path": "imgs/b.png"}]}
    items = {}
    for name, images in forms.items():
        ds = RLHFDataset(write_vl_rows(tmp_path / f"{name}.parquet", [VL_PROMPT], [images]), processor.tokenizer,
                         max_prompt_length=64, processor=processor)
        items[name] = ds[0]
    reference = items["struct"]
    # the processor's own output on the decoded image: the dataset must carry exactly this
    from PIL import Image
    text = processor.apply_chat_template(vision.split_markers([{"role": "user", "content": VL_PROMPT}]),
                                         add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    n = int(reference["attention_mask"].sum())
    assert reference["input_ids"][-n:].tolist() == expected["input_ids"][0].tolist()
    assert torch.equal(reference["multi_modal_inputs"]["pixel_values"], expected["pixel_values"])
    assert reference["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    # raw ids keep one image token per image (vLLM expands it); input_ids have grid 4x4 / merge 2x2 = 4 of them
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert reference["raw_prompt_ids"].count(image_id) == 1
    assert reference["input_ids"].tolist().count(image_id) == 4
    assert len(reference["raw_prompt_ids"]) == n - 3
    for name, item in items.items():
        assert torch.equal(item["input_ids"], reference["input_ids"]), name
        assert torch.equal(item["multi_modal_inputs"]["pixel_values"],
                           reference["multi_modal_inputs"]["pixel_values"]), name
        assert item["multi_modal_data"]["image"][0].size == (56, 56)


def test_prompt_length_counts_expanded_image_tokens(processor, tmp_path):
    path = write_vl_rows(tmp_path / "big.parquet", [VL_PROMPT, VL_PROMPT], [[png("red")], [png("red", size=112)]])
    ds = RLHFDataset(path, processor.tokenizer, max_prompt_length=64, processor=processor)
    small, big = (int(ds[i]["attention_mask"].sum()) for i in range(2))
    assert big - small == 8 - 4             # 112x56 px: grid 1x8x4 -> 8 image tokens against 4
    with pytest.raises(ValueError, match=rf"big.parquet, row 1: the templated prompt is {big} tokens"):
        RLHFDataset(path, processor.tokenizer, max_prompt_length=small, processor=processor).check_prompt_lengths()
    kept = RLHFDataset(path, processor.tokenizer, max_prompt_length=small, processor=processor,
                       filter_overlong_prompts=True)
    assert len(kept) == 1 and kept.origins[0][1] == 0


@pytest.mark.parametrize("case, match", [
    ("two_markers", r"bad.parquet, row 1: the prompt has 2 <image> marker\(s\) but column 'images' holds 1"),
    ("corrupt", r"bad.parquet, row 1, column 'images', image 0: cannot read the image"),
    ("missing", r"bad.parquet, row 1, column 'images', image 0: cannot read the image .*nowhere.png does not exist"),
    ("folder", r"bad.parquet, row 1, column 'images', image 0: cannot read the image .*/sub is not a file"),
    ("empty_bytes", r"bad.parquet, row 1, column 'images', image 0: .*the image's bytes are empty \(0 bytes\)"),
    ("video", r"bad.parquet, row 1, column 'videos': the row has videos"),
    ("bomb", r"bad.parquet, row 1, column 'images', image 0: cannot read the image \(Image size \(400000000 pixels\) "
             r"exceeds limit .* Pillow refuses an image that large; downscale it\)"),
    ("strip", r"bad.parquet, row 1, column 'images', image 0: the image is 5000 x 20 pixels, which Qwen2-VL's image "
              r"processor refuses \(absolute aspect ratio must be smaller than 200, got 250.0\); pad or crop it"),
])
def test_bad_rows_fail_at_load_naming_file_and_row(processor, tmp_path, case, match):
    prompts, images, extra = [VL_PROMPT, VL_PROMPT], [[png()], [png()]], {}
    if case == "two_markers":
        prompts[1] = "<image><image>Two?"
    elif case == "corrupt":
        images[1] = [png()[:40]]                     # a truncated PNG
    elif case == "missing":                          # paths are relative to the parquet's folder
        (tmp_path / "here.png").write_bytes(png())
        images = [["here.png"], ["nowhere.png"]]
    elif case == "empty_bytes":                      # it said "got None"
        images[1] = [b""]
    elif case == "bomb":                             # Pillow's decompression-bomb guard: it was a bare traceback
        from PIL import Image
        bomb = io.BytesIO()
        Image.new("1", (20000, 20000)).save(bomb, format="PNG")    # 48 KB of PNG, 400M pixels
        images[1] = [bomb.getvalue()]
    elif case == "strip":                            # refused by the processor when the row's turn came
        from PIL import Image
        strip = io.BytesIO()
        Image.new("RGB", (5000, 20)).save(strip, format="PNG")
        images[1] = [strip.getvalue()]
    elif case == "folder":                           # it said "does not exist" of a folder
        (tmp_path / "here.png").write_bytes(png())
        (tmp_path / "sub").mkdir()
        images = [["here.png"], ["sub"]]
    else:
        extra["videos"] = [None, ["clip.mp4"]]
    path = write_vl_rows(tmp_path / "bad.parquet", prompts, images, **extra)
    with pytest.raises(ValueError, match=match):
        RLHFDataset(path, processor.tokenizer, max_prompt_length=64, processor=processor)


def test_a_prompt_the_processor_refuses_is_named_by_its_row(processor, tmp_path, monkeypatch):
    """Whatever else the processor raises on a row (checked at load or at the row's turn) names the row."""
    path = write_vl_rows(tmp_path / "rows.parquet", [VL_PROMPT, VL_PROMPT], [[png()], [png()]])
    dataset = RLHFDataset(path, processor.tokenizer, max_prompt_length=64, processor=processor)
    dataset[1]                                        # the row encodes

    def refuse(*args, **kwargs):
        raise ValueError("a refusal of the processor's")
    monkeypatch.setattr(vision, "encode_prompt", refuse)
    with pytest.raises(vision.ImageError, match=r"rows.parquet, row 1: the processor cannot take the row's prompt "
                                                r"and images \(a refusal of the processor's\); fix or drop the row"):
        dataset[1]


def test_text_model_refuses_rows_with_images(processor, tmp_path):
    path = write_vl_rows(tmp_path / "t.parquet", [VL_PROMPT], [[png()]])
    with pytest.raises(ValueError, match=r"t.parquet, row 0: the row has images .* the model is text-only"):
        RLHFDataset(path, processor.tokenizer, max_prompt_length=64)


# ------------------------------------------------------------------------------------------------------------
# Forward: padded, packed, and a plain forward of the processor's outputs
# ------------------------------------------------------------------------------------------------------------
def image_batch(processor, config, tmp_path):
    """Three rows (one image, none, two of different sizes) with random responses of 5, 8 and 3 tokens, the last
    ending at a generated image placeholder: (dataset rows, the full batch, the responses)."""
    prompts = [VL_PROMPT, "Say hi.", "<image> and <image>: which is red?"]
    images = [[png("red")], [], [png("green", seed=1), png("blue", size=112)]]
    ds = RLHFDataset(write_vl_rows(tmp_path / "f.parquet", prompts, images), processor.tokenizer,
                     max_prompt_length=48, processor=processor)
    rows = [ds[i] for i in range(3)]
    batch = collate(rows)
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(10, 300, (n,), generator=generator).tolist() for n in (5, 8, 3)]
    # the rollout ends a response at a generated image placeholder, as at EOS (row 2 ends with one)
    stops = [processor.tokenizer.eos_token_id, *vision.special_token_ids(config)]
    responses[2][-1] = config.image_token_id
    full = {**batch, **responses_to_batch(batch, responses, 8, processor.tokenizer.pad_token_id, stops)}
    assert full["response_mask"][2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    return rows, full, responses


def plain_forward(model, row, response, **kwargs):
    """The model on one unpadded sequence (the last response token is only a label) with the processor's inputs
    and the model's own positions; returns (model output, prompt length)."""
    prompt = row["input_ids"][row["attention_mask"].bool()]
    ids = torch.cat([prompt, torch.tensor(response[:-1])]).unsqueeze(0)
    inputs = dict(row.get("multi_modal_inputs") or {})
    if inputs:
        inputs["mm_token_type_ids"] = vision.token_types(model.config, ids)
    with torch.no_grad():
        return model(input_ids=ids, **inputs, **kwargs), len(prompt)


@pytest.mark.parametrize("attn", ["sdpa", VARLEN_CPU])
def test_padded_packed_and_plain_forward_agree(tiny_vl_dir, processor, tmp_path, attn):
    """With either attention the actor can load with on CPU: sdpa, and minirl_varlen (use_remove_padding=true, the
    seed's value), which the vision tower calls too. It once gave the tower's bidirectional windows causal
    attention: log-probs 0.007 off the plain forward's, unseen by the vLLM runs' probability check."""
    model = load_model(tiny_vl_dir, attn_implementation=attn).eval()
    rows, full, responses = image_batch(processor, model.config, tmp_path)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    with torch.no_grad():
        padded, _ = token_logprobs(model, full, use_remove_padding=False)
        packed, _ = token_logprobs(model, full, use_remove_padding=True)
    mask = full["response_mask"].bool()
    assert float((padded - packed)[mask].abs().max()) < 1e-5

    # independent: the model (loaded with transformers' default attention) on each unpadded sequence (the last
    # response token is only a label), with the processor's inputs and its own positions
    plain = load_model(tiny_vl_dir).eval()
    for i, row in enumerate(rows):
        out, prompt_len = plain_forward(plain, row, responses[i])
        logits = out.logits[0, prompt_len - 1:]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(responses[i]).unsqueeze(1))[:, 0]
        assert torch.allclose(padded[i, :len(responses[i])], expected, atol=1e-5), i

    # the images matter: other pixels (the patches in reverse order), other log-probs
    flipped = [{**m, "pixel_values": m["pixel_values"].flip(0)} if m else m for m in full["multi_modal_inputs"]]
    with torch.no_grad():
        other, _ = token_logprobs(model, {**full, "multi_modal_inputs": flipped}, use_remove_padding=True)
    assert float((other - packed)[0][mask[0]].abs().max()) > 1e-4


def test_vl_critic_values_padded_packed_and_plain_forward_agree(tiny_vl_dir, processor, tmp_path):
    """The critic is the VL model with a one-output value head in place of the LM head (vision.with_value_head):
    its values come from the actor's VL forward (images, rope positions, packing)."""
    from transformers import AutoModelForImageTextToText
    torch.manual_seed(3)
    critic = load_model(tiny_vl_dir, kind="token_cls").eval()
    rows, full, responses = image_batch(processor, critic.config, tmp_path)
    head = critic.get_output_embeddings()
    assert tuple(head.weight.shape) == (1, 64) and head.bias is not None
    assert float(head.weight.detach().std()) == pytest.approx(0.02, rel=0.5) and not head.bias.any()
    with torch.no_grad():
        padded = token_values(critic, full, use_remove_padding=False)
        packed = token_values(critic, full, use_remove_padding=True)
    mask = full["response_mask"].bool()
    assert float((padded - packed)[mask].abs().max()) < 1e-5
    assert not padded[~mask].any()

    # independent: the plain VL model from the same checkpoint, its final hidden states, then the head; values are
    # read at verl's slice [:, -R-1:-1] (the state before each response token)
    plain = AutoModelForImageTextToText.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()
    for i, row in enumerate(rows):
        out, prompt_len = plain_forward(plain, row, responses[i], output_hidden_states=True)
        hidden = out.hidden_states[-1][0, prompt_len - 1:]                        # [len(response), H]
        expected = (hidden @ head.weight.T + head.bias)[:, 0]
        assert torch.allclose(padded[i, :len(responses[i])], expected, atol=1e-5), i

    # the images matter: other pixels, other values
    flipped = [{**m, "pixel_values": m["pixel_values"].flip(0)} if m else m for m in full["multi_modal_inputs"]]
    with torch.no_grad():
        other = token_values(critic, {**full, "multi_modal_inputs": flipped}, use_remove_padding=True)
    assert float((other - packed)[0][mask[0]].abs().max()) > 1e-4


def test_fsdp_units_and_gradient_checkpointing_cover_both_towers(tiny_vl_dir):
    from models import decoder_layers
    model = load_model(tiny_vl_dir, gradient_checkpointing=True)
    units = decoder_layers(model)
    assert len(units) == 2 + 2                   # 2 decoder layers + 2 vision blocks, each sharded on its own
    assert sum(type(u).__name__ == "Qwen2_5_VLVisionBlock" for u in units) == 2
    assert model.model.visual.gradient_checkpointing and model.model.language_model.gradient_checkpointing


# ------------------------------------------------------------------------------------------------------------
# geometry3k preprocessing (verl's examples/data_preprocess/geo3k.py)
# ------------------------------------------------------------------------------------------------------------
def test_geo3k_rows_are_verls_and_load_with_their_images(processor, tmp_path):
    from data import preprocess_geo3k
    source = tmp_path / "geometry3k"
    (source / "data").mkdir(parents=True)
    (source / "imgs").mkdir()
    (source / "imgs" / "t0.png").write_bytes(png("green"))
    problem = "<image>Find x. Round to the nearest tenth."
    # the HF layout (parquet, images as {bytes, path} structs) for train, jsonl with image paths for test
    pq.write_table(pa.Table.from_pylist([{"images": [{"bytes": png("red"), "path": "a.png"}], "problem": problem,
                                          "answer": "5.8"}]), source / "data" / "train-00000-of-00001.parquet")
    (source / "test.jsonl").write_text(json.dumps({"images": ["imgs/t0.png"], "problem": problem, "answer": "12"}))
    paths = preprocess_geo3k(source, tmp_path / "out")
    train = pq.read_table(paths["train"]).to_pylist()[0]
    instruction = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
                   "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                   "MUST BE put in \\boxed{}.")
    assert train == {"data_source": "hiyouga/geometry3k",
                     "prompt": [{"role": "user", "content": problem + " " + instruction}],
                     "images": [{"bytes": png("red"), "path": "a.png"}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": "5.8"},
                     "extra_info": {"split": "train", "index": 0, "answer": "5.8", "question": problem}}
    test = pq.read_table(paths["test"]).to_pylist()[0]
    assert test["images"] == [{"bytes": png("green"), "path": "imgs/t0.png"}]     # read in: the parquet stands alone
    item = RLHFDataset(paths["test"], processor.tokenizer, max_prompt_length=256, processor=processor)[0]
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert item["data_source"] == "hiyouga/geometry3k"


# verl's examples/sglang_multiturn/config/tool_config/geo3k_tool_config.yaml, verbatim
VERL_GEO3K_TOOL_YAML = """\
tools:
  - class_name: "verl.tools.geo3k_tool.Geo3kTool"
    config: {}
    tool_schema:
      type: "function"
      function:
        name: "calc_geo3k_reward"
        description: "A tool for calculating the reward of geo3k. (1.0 if parsed answer is correct, 0.0 if parsed \
answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the geo3k problem, must be a digits"
          required: ["answer"]"""


def test_geo3k_multiturn_rows_are_verls_and_its_tool_grades_the_answer(tmp_path):
    """`data.py geo3k --multiturn`: verl's geo3k_multiturn_w_tool.py row, written out here; verl's geo3k tool yaml
    loads unchanged, and the tool grades the bare answer (geo3k's scorer, no \\boxed{} needed, no format part)
    with verl's step rewards: 0.0 when the grade improves, -0.05 otherwise."""
    import asyncio

    import tools
    from data import preprocess_geo3k
    source = tmp_path / "geometry3k"
    source.mkdir()
    problem = "<image>Find x. Round to the nearest tenth."
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([{"images": [{"bytes": png("red"), "path": "a.png"}], "problem": problem,
                                              "answer": "5.8"}]), source / f"{split}.parquet")
    train = pq.read_table(preprocess_geo3k(source, tmp_path / "out", multiturn=True)["train"]).to_pylist()[0]
    instruction = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
                   "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                   "MUST BE put in \\boxed{}.")
    system = ("You are a math expert. You are given a question and you need to solve it step by step. Reasoning step "
              "by step before any tool call. You should use the `calc_geo3k_reward` tool after step by step solving "
              "the question, before generate final answer at least once and refine your answer if necessary. ")
    assert train == {"data_source": "hiyouga/geometry3k", "agent_name": "tool_agent",
                     "prompt": [{"role": "system", "content": system},
                                {"role": "user", "content": problem + " " + instruction}],
                     "images": [{"bytes": png("red"), "path": "a.png"}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": "5.8"},
                     "extra_info": {"split": "train", "index": 0, "answer": "5.8", "question": problem,
                                    "need_tools_kwargs": True,
                                    "tools_kwargs": {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "5.8"}}}}}
    written = tmp_path / "out" / "geo3k_tool_config.yaml"                    # the rows come with verl's yaml
    assert yaml.safe_load(written.read_text()) == yaml.safe_load(VERL_GEO3K_TOOL_YAML)
    (name, tool), = tools.load_tools(written).items()
    assert name == "calc_geo3k_reward" and type(tool) is tools.Geo3kTool

    async def session():
        instance = await tool.create(ground_truth="5.8")
        answers = [await tool.execute(instance, {"answer": answer}) for answer in ("6", "5.8", "5.9", 5.8)]
        return answers, await tool.calc_reward(instance)
    answers, final = asyncio.run(session())
    assert [(text, step) for text, step, _ in answers] == [
        ("Current parsed answer='6' reward=0.0", -0.05), ("Current parsed answer='5.8' reward=1.0", 0.0),
        ("Current parsed answer='5.9' reward=0.0", -0.05), ("Current parsed answer='5.8' reward=1.0", 0.0)]
    assert final == 1.0


def test_image_prompts_list_the_tools_when_the_template_renders_them(processor, tmp_path):
    """A multi-turn run's tool schemas reach an image prompt's template as a text prompt's (verl's rollout templates
    them with `tools`); a template that renders a conversation the same with and without them (the tiny model's,
    like Qwen2.5-VL's own) is noticed, so the trainer can warn that the model is never shown its tools."""
    import tools
    (tmp_path / "geo3k_tool_config.yaml").write_text(VERL_GEO3K_TOOL_YAML)
    schemas = [dict(tool.get_openai_tool_schema())
               for tool in tools.load_tools(tmp_path / "geo3k_tool_config.yaml").values()]
    path = write_vl_rows(tmp_path / "rows.parquet", ["<image>What colour?"], [[{"bytes": png("red"), "path": None}]])
    listing = "{% if tools %}<|im_start|>system\n{{ tools[0].function.name }}<|im_end|>\n{% endif %}"
    expected = ("<|im_start|>system\ncalc_geo3k_reward<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>\n<|im_start|>assistant\n")
    with_listing = RLHFDataset(path, processor.tokenizer, max_prompt_length=256, processor=processor, tools=schemas,
                               chat_template=listing + processor.chat_template)
    assert processor.tokenizer.decode(with_listing[0]["raw_prompt_ids"]) == expected
    assert not with_listing.template_ignores_tools()
    own = RLHFDataset(path, processor.tokenizer, max_prompt_length=256, processor=processor, tools=schemas)
    assert own.template_ignores_tools()
    without_tools = RLHFDataset(path, processor.tokenizer, max_prompt_length=256, processor=processor)
    assert not without_tools.template_ignores_tools()


def test_seed_example_config_qwen2_5_vl_geo3k_passes_print_config(tiny_vl_dir, tmp_path):
    """geo3k_vl.yaml holds the seed's example values (Qwen2.5-VL-32B on geometry3k); its paths point at this host."""
    import subprocess
    import sys
    from demo_vl import vl_demo_rows
    from launch import ROOT
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(vl_demo_rows("train", 64)), data)
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(ROOT / "geo3k_vl.yaml"),
                          "--print-config", "--world-size", "8", f"actor_rollout_ref.model.path={tiny_vl_dir}",
                          f"data.train_files={data}", f"data.val_files={data}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = out.stdout
    assert "disable_mm_preprocessor_cache: true" in printed and "image_key: images" in printed
    assert "responses per step 128 (train_batch_size x n), per rank 16" in printed
    # 64 rows / 32 prompts = 2 steps per epoch x 5 epochs
    assert "training steps 10" in printed


@pytest.mark.parametrize("case", ["reward_model", "critic_hf_model"])
def test_vl_as_reward_model_or_hf_critic_is_a_config_error(tiny_vl_dir, tmp_path, case):
    """Read from config.json before any model loads (vision.folder_is_vision_language): the command exits with a
    config error naming the key. (A VL critic's value head has no Hugging Face class, so no hf_model for it.)"""
    import subprocess
    import sys
    from launch import ROOT, launch_env
    data = write_vl_rows(tmp_path / "train.parquet", [VL_PROMPT] * 4, [[png()]] * 4)
    extra = {"reward_model": ["reward_model.enable=true", f"reward_model.model.path={tiny_vl_dir}"],
             "critic_hf_model": ["algorithm.adv_estimator=gae", f"critic.model.path={tiny_vl_dir}",
                                 "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]}[case]
    message = {"reward_model": rf"'reward_model.model.path'={tiny_vl_dir} is a vision-language model; a model-based "
                               r"reward needs a text token-classification checkpoint",
               "critic_hf_model": rf"'critic.checkpoint.save_contents' has hf_model, but 'critic.model.path'="
                                  rf"{tiny_vl_dir} is a vision-language model"}[case]
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(ROOT / "config.yaml"),
                          f"actor_rollout_ref.model.path={tiny_vl_dir}", f"data.train_files={data}",
                          "data.val_files=null", f"af_output_dir={tmp_path / 'out'}", *extra],
                         capture_output=True, text=True, cwd=ROOT, env=launch_env(), timeout=300)
    assert out.returncode == 2 and re.search("config error: " + message, out.stderr), out.stderr[-2000:]
    assert not (tmp_path / "out").exists()          # nothing ran: no output folder was made


def test_vllm_engine_gets_the_multimodal_arguments_and_the_checkpoint(tiny_vl_dir, tiny_model_dir, tmp_path,
                                                                      clean_env):
    from rollout import vllm_engine_kwargs
    from test_vllm import vllm_config
    cfg = vllm_config(tiny_vl_dir, tmp_path, "engine_kwargs.vllm.disable_mm_preprocessor_cache=true",
                      "+actor_rollout_ref.rollout.engine_kwargs.vllm.limit_mm_per_prompt={image: 2}")
    kwargs = vllm_engine_kwargs(cfg, torch.device("cpu"))
    assert kwargs["mm_processor_cache_gb"] == 0 and kwargs["limit_mm_per_prompt"] == {"image": 2}
    # a VL checkpoint is loaded even with the dummy_dtensor default; a text model keeps dummy weights
    assert kwargs["load_format"] == "auto"
    assert vllm_engine_kwargs(vllm_config(tiny_model_dir, tmp_path), torch.device("cpu"))["load_format"] == "dummy"
