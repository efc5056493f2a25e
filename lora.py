"""LoRA: train peft adapters on a frozen base model (actor_rollout_ref.model.lora_rank > 0, and for the critic
critic.model.lora_rank > 0), as verl does.

    wrap(model, model_cfg)          peft's get_peft_model with LoraConfig(r, lora_alpha, target_modules,
                                    exclude_modules), before FSDP2: only the lora_A/lora_B matrices train (and a
                                    critic's value head: value_head)
    check_models(cfg)               before any weights load: each LoRA's targets match modules of its model
    Adapter                         the adapter tensors in peft's saved format + its LoraConfig: what moves to the
                                    rollout engine at each sync and what a checkpoint keeps (peft's folder layout)
    adapter_from_full_state(...)    an Adapter from the wrapped model's gathered adapter tensors
    base_weight_name(name)          the base model's Hugging Face name of a wrapped parameter
    export_adapter(...)             --export of a LoRA checkpoint: its adapter folder and tokenizer
    merge(base_model, folder)       the base with a saved adapter folded in (export, hf_model checkpoints)

The reference policy is the same module with the adapter disabled (models.AdapterDisabled), so LoRA keeps one copy
of the base weights. The critic's value head is new (or small) and trains whole beside the adapters: peft's
token-classification task keeps a trained copy of it (modules_to_save), saved with the adapter. verl v0.5.0 wraps
its critic as a causal LM instead, which leaves the head frozen at its initial weights. Left out: DoRA, rsLoRA,
other modules_to_save, verl's layered_summon (the weights are gathered in buckets of
rollout.update_weights_bucket_megabytes anyway).
"""
from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import vision
from config import ConfigError

ADAPTER_WEIGHTS = "adapter_model.safetensors"      # peft's names (its config: adapter_config.json)
PEFT_PREFIX = "base_model.model."        # what PeftModel puts before the wrapped model's parameter names


def enabled(model_cfg):
    return model_cfg.lora_rank > 0


def lora_config(model_cfg, value_head=None):
    """peft's LoRA config from actor_rollout_ref.model or critic.model (verl's fsdp_workers: bias none). The
    actor is a causal LM; a critic a token-classification model whose value head (`value_head`, the head
    module's name; critic.model has no exclude_modules) peft trains whole and gives no adapter: all-linear would
    otherwise count it, as a token-classification model has no output embedding to leave out."""
    from peft import LoraConfig, TaskType
    exclude = [value_head] if value_head else _plain(model_cfg.get("exclude_modules"))
    return LoraConfig(task_type=TaskType.TOKEN_CLS if value_head else TaskType.CAUSAL_LM, r=model_cfg.lora_rank,
                      lora_alpha=model_cfg.lora_alpha, target_modules=_plain(model_cfg.target_modules),
                      exclude_modules=exclude, bias="none", modules_to_save=[value_head] if value_head else None)


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def check_target_modules(model_cfg, section="actor_rollout_ref.model"):
    """ConfigError when target_modules (minus exclude_modules) match no linear layer of the model: checked on an
    empty (meta-device) copy built from config.json, so nothing is loaded. The message names `section`'s key
    and lists the layer names that exist."""
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
    with torch.device("meta"):
        model = vision.causal_lm_class(config).from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    output_layer = model.get_output_embeddings()
    linear = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and module is not output_layer]
    peft_cfg = lora_config(model_cfg)
    if peft_cfg.target_modules == "all-linear":          # peft's shorthand: every linear layer but the output one
        peft_cfg.target_modules = linear
    matched = [name for name, _ in model.named_modules() if check_target_module_exists(peft_cfg, name)]
    if not matched:
        names = sorted({name.rsplit(".", 1)[-1] for name in linear})
        targets = model_cfg.target_modules
        meant = isinstance(targets, str) and difflib.get_close_matches(targets.lower(), ["all-linear"], cutoff=0.8)
        raise ConfigError(f"'{section}.target_modules'={targets!r} (exclude_modules="
                          f"{model_cfg.get('exclude_modules')!r}) matches no layer of {model_cfg.path}"
                          + (": did you mean 'all-linear'?" if meant else "")
                          + f"; its linear layers are named {', '.join(names)} (or use all-linear)")


def check_models(cfg):
    """check_target_modules for every model that will take LoRA (the actor; the critic when PPO builds one), from
    config.json alone: the trainer calls it before any weights load."""
    if enabled(cfg.actor_rollout_ref.model):
        check_target_modules(cfg.actor_rollout_ref.model)
    if enabled(cfg.critic.model) and cfg.algorithm.adv_estimator == "gae":
        check_target_modules(cfg.critic.model, "critic.model")


def wrap(model, model_cfg, value_head=None):
    """The model with LoRA adapters on the target modules; base parameters frozen (requires_grad False), but for
    a critic's value head (`value_head`: its module name), which trains whole. The adapter's config names the base
    model's folder as an absolute path, so a saved or exported adapter loads from any working directory."""
    from peft import get_peft_model
    model.enable_input_require_grads()      # verl does: with a frozen embedding, checkpointed blocks still get grads
    wrapped = get_peft_model(model, lora_config(model_cfg, value_head))
    base = wrapped.peft_config["default"].base_model_name_or_path       # peft takes the path it was loaded from
    if base and Path(base).is_dir():
        wrapped.peft_config["default"].base_model_name_or_path = str(Path(base).resolve())
    return wrapped


def log_parameter_counts(model, model_cfg, role="actor"):
    """One line on rank 0: LoRA's trainable parameters against the whole model's."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    who = "" if role == "actor" else f"{role} "
    print(f"{who}LoRA rank {model_cfg.lora_rank}, alpha {model_cfg.lora_alpha}, target_modules "
          f"{model_cfg.target_modules}: {trainable:,} trainable of {total:,} parameters "
          f"({100 * trainable / total:.2f}%)", flush=True)


def is_adapter_name(name):
    """A tensor the adapter holds: a LoRA matrix of a wrapped model (peft names them ...lora_A.<adapter>.weight /
    lora_B), or the trained copy of a critic's value head (...score.modules_to_save.<adapter>.weight)."""
    return ".lora_A." in name or ".lora_B." in name or ".modules_to_save." in name


def base_weight_name(name):
    """'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight' -> 'model.layers.0.self_attn.q_proj.weight':
    the plain model's name of a wrapped base parameter (a value head's untrained original: 'score.weight')."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


@dataclass
class Adapter:
    """A LoRA adapter as peft saves it: `state` {peft key: full tensor} (keys without the adapter name, e.g.
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'), and its LoraConfig."""
    state: dict
    config: object

    @property
    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def save(self, folder):
        """adapter_model.safetensors + adapter_config.json in `folder`: loadable with PeftModel.from_pretrained
        and by vLLM's LoRARequest."""
        from safetensors.torch import save_file
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state.items()}, folder / ADAPTER_WEIGHTS,
                  metadata={"format": "pt"})
        self.config.save_pretrained(folder)
        return folder


def adapter_from_full_state(model, full_state):
    """An Adapter from a wrapped model and its adapter tensors {state_dict name: full tensor}; peft's own
    get_peft_model_state_dict picks and renames them."""
    from peft import get_peft_model_state_dict
    return Adapter(get_peft_model_state_dict(model, state_dict=full_state), model.peft_config["default"])


def export_adapter(adapter_folder, hf_folder, out):
    """A saved adapter plus the tokenizer files of `hf_folder` (a checkpoint's huggingface/), copied to `out`.
    No config.json: transformers would read `out` as a full model; adapter_config.json names the base model."""
    model_files = ("config.json", "generation_config.json", "model.safetensors.index.json")
    tokenizer_files = [item for item in Path(hf_folder).iterdir()
                       if item.is_file() and item.suffix != ".safetensors" and item.name not in model_files]
    for item in [*Path(adapter_folder).iterdir(), *tokenizer_files]:
        shutil.copy2(item, Path(out) / item.name)


def merge(base_model, adapter_folder):
    """A plain Hugging Face model with the adapter folded into its weights (peft's merge_and_unload)."""
    from peft import PeftModel
    return PeftModel.from_pretrained(base_model, str(adapter_folder)).merge_and_unload()
