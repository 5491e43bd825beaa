"""LoRA: train a low-rank update of each linear layer and keep every base weight frozen.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv 2106.09685,
section 4.1) trains, for a frozen weight W (out x in), two small matrices A (r x in) and B
(out x r), and the layer computes

    h = W x + (alpha / r) B A x.

The optimizer holds only A and B, so gradients and Adam state shrink from 16 bytes per parameter
of the model to 16 bytes per adapter parameter (a 7B model at r = 32: ~80M), and the base can stay
in bf16. What the gradient becomes, with G = dL/dW' the gradient the full model would give the
merged weight W' = W + s B A (s = alpha / r):

    dL/dB = s G A^T,    dL/dA = s B^T G.

peft initialises B = 0, so the first step moves only B, along s G A^T: a random r-dimensional
projection of the full gradient (tests/test_lora.py checks this identity against the full model's
gradient). Because B starts at 0 the adapted model starts equal to the base, and "the base with
the adapter switched off" is the initial policy: the reference for the KL terms without a second
copy in memory (verl's ref_in_actor, trainer/ppo/ray_trainer.py). "LoRA Without Regret"
(Schulman et al., Thinking Machines, 2025) finds that in RL even r = 1 matches full fine-tuning at
about 10x its learning rate; verl's docs/advance/ppo_lora.rst recommend an order of magnitude more
than full fine-tuning and r >= 32.

The rollout engine computes with one merged matrix per layer. merged_named_weights builds W + s B A
out of place, in float32, one layer at a time: the trainer's W is never written. (Merging into W in
place and subtracting again after the sync, as TRL's GRPOTrainer does through peft's
merge_adapter / unmerge_adapter, rounds W at every cycle when W is bf16: docs/lora.md has the drift
measured.)

    1. the adapter       add_adapter (peft's LoRA layers injected into the HF model itself: every
                         name, decoder layer and helper of the model stays as it was),
                         adapter_layers, adapter_disabled (the reference policy),
                         without_adapter (an engine's plain copy)
    2. merged weights    merged_weight, merged_named_weights (the engine's sync, the export),
                         head_weight (an adapted LM head's, with its gradient: logprobs.py)
    3. files             adapter_weights, save_adapter / load_adapter (peft's format:
                         adapter_config.json + adapter_model.safetensors, which
                         peft.PeftModel.from_pretrained reads), adapter_settings (its r and
                         alpha); the merged model's HF folder is merged_named_weights written
                         by the trainer (grpo.save_merged_model, ppo_rlhf.save_final_policy)
    4. the flags         LoraArgs (--lora-rank, --lora-alpha, --lora-target-modules: the mixin
                         grpo.py's and ppo_rlhf.py's Args inherit) and check_lora_args
"""

import contextlib
import json
import os
from dataclasses import dataclass

import torch

import harness

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# peft.PeftModel's prefix in the names of a saved adapter (PeftModel wraps a LoraModel, which
# wraps the HF model)
PEFT_PREFIX = "base_model.model."


# --------------------------------------------------------------------------------------------------
# 1. The adapter
# --------------------------------------------------------------------------------------------------


def lora_config(rank, alpha, target_modules):
    """peft's LoraConfig for --lora-rank / --lora-alpha / --lora-target-modules ("all-linear":
    every linear layer of the decoder, attention and MLP, not the LM head; or module names).
    No dropout (an RL update's ratio must be computed by the same function as pi_old), no
    bias."""
    from peft import LoraConfig

    modules = target_modules if target_modules == "all-linear" else target_modules.split(",")
    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=0.0, bias="none"
    )


def add_adapter(model, rank, alpha, target_modules, seed=0):
    """Inject peft's LoRA layers into `model` in place (peft.inject_adapter_in_model) and return
    it: every targeted Linear becomes a lora.Linear holding the frozen base_layer and the trainable
    lora_A / lora_B (A random, B = 0: the model computes what it computed before). Every other
    parameter is frozen. A is drawn from its own generator seeded with `seed`, not from the
    process's RNG: every rank draws the same A whatever it did before (rank 0 alone builds the
    tiny model). gpt2's Conv1D stores W transposed (in x out): peft's fan_in_fan_out."""
    from peft import inject_adapter_in_model
    from transformers.pytorch_utils import Conv1D

    config = lora_config(rank, alpha, target_modules)
    config.fan_in_fan_out = any(isinstance(m, Conv1D) for m in model.modules())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as error:  # peft: no module of that name
            raise harness.RunError(
                f"--lora-target-modules {target_modules}: {harness.first_line(error)}"
            ) from None
    head = model.get_output_embeddings()
    if (
        head in adapter_layers(model).values()
        and model.config.get_text_config().tie_word_embeddings
    ):
        # the head's weight is the embedding matrix: the merged head would be a second matrix that
        # a tied engine (vLLM skips lm_head.* when tied) and a tied saved model cannot hold
        raise harness.RunError(
            f"--lora-target-modules {target_modules}: the LM head is tied to the input "
            "embeddings in this model; adapt it only in a model with untied embeddings"
        )
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return model


def adapter_layers(model):
    """{module name: peft LoRA layer} of a model add_adapter adapted ({} for any other model)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_adapter(model):
    """True for a model add_adapter adapted."""
    return bool(adapter_layers(getattr(model, "module", model)))


@contextlib.contextmanager
def adapter_disabled(model):
    """Inside this block the model computes with its base weights alone (every adapter switched
    off): the initial policy, pi_ref for the KL loss, with no second model in memory."""
    layers = list(adapter_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def without_adapter(model):
    """`model` with each LoRA layer replaced by its base layer, in place (for a copy: an engine's
    own model, which computes with merged weights), returned."""
    for name, layer in adapter_layers(model).items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.get_base_layer())
    return model


# --------------------------------------------------------------------------------------------------
# 2. Merged weights, out of place
# --------------------------------------------------------------------------------------------------


def merged_weight(layer):
    """W + (alpha / r) B A of one LoRA layer: a new float32 tensor; the layer's W is not touched.
    Sharded weights (FSDP2) are gathered whole first (a collective). Conv1D: (B A)^T."""
    base = harness.whole(layer.get_base_layer().weight.detach()).float()
    a = harness.whole(layer.lora_A[ADAPTER].weight.detach()).float()
    b = harness.whole(layer.lora_B[ADAPTER].weight.detach()).float()
    delta = layer.scaling[ADAPTER] * (b @ a)
    return base + (delta.T if layer.fan_in_fan_out else delta)


def head_weight(layer):
    """The weight an adapted LM head computes with, for logprobs.py's chunked head (which multiplies
    hidden states by one (V, H) matrix): W + (alpha / r) B A built with autograd, so the gradient
    reaches A and B (W stays frozen); W alone while the adapter is switched off (the reference)."""
    base = layer.get_base_layer().weight
    if layer.disable_adapters:
        return base
    a = layer.lora_A[ADAPTER].weight
    b = layer.lora_B[ADAPTER].weight
    return base + layer.scaling[ADAPTER] * (b @ a).to(base.dtype)


def merged_named_weights(model):
    """(HF name, tensor) pairs of the model with each adapter merged into its weight (merged_weight,
    float32), every other weight as it is, one at a time (a generator: a sharded model gathers one
    weight at a time, every rank in the same order). The names are the HF model's own
    (q_proj.weight, not q_proj.base_layer.weight), as an engine or save_pretrained expects them."""
    model = getattr(model, "module", model)
    layers = adapter_layers(model)
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue  # inside its layer's merged weight
        owner, _, leaf = name.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        if owner == layer_name or layer_name not in layers:
            yield name, harness.whole(p.detach())  # not an adapted layer's
        elif leaf == "weight":
            yield f"{layer_name}.weight", merged_weight(layers[layer_name])
        else:  # an adapted layer's bias, unchanged
            yield f"{layer_name}.{leaf}", harness.whole(p.detach())


# --------------------------------------------------------------------------------------------------
# 3. Files: the adapter in peft's format, the merged model in HF's
# --------------------------------------------------------------------------------------------------


def adapter_weights(model):
    """{name: CPU tensor} of the adapter, in peft's saved names (PeftModel's prefix, no adapter
    name: base_model.model.<module>.lora_A.weight), gathered whole under FSDP2 (every rank takes
    part, every rank gets them)."""
    model = getattr(model, "module", model)
    weights = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            saved_name = PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")
            weights[saved_name] = harness.whole(p.detach()).cpu().contiguous()
    return weights


def save_adapter(folder, model, weights):
    """Write the adapter in peft's format into `folder`: adapter_model.safetensors (`weights`, from
    adapter_weights) and adapter_config.json, naming the base the model was loaded from
    (peft.PeftModel.from_pretrained(base, folder) loads it onto the base model)."""
    from safetensors.torch import save_file

    model = getattr(model, "module", model)
    config = model.peft_config[ADAPTER]
    config.base_model_name_or_path = model.name_or_path
    config.save_pretrained(folder)
    save_file(weights, os.path.join(folder, ADAPTER_FILE))


def load_adapter(model, folder):
    """Load the adapter save_adapter wrote into a model add_adapter adapted with the same settings;
    every adapter weight must be in the file, finite, of its shape (a RunError in one line
    otherwise). Safetensors only: nothing in the folder is unpickled."""
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_FILE)
    try:
        saved = load_file(path)
    except Exception as error:  # a missing or malformed file
        raise harness.RunError(f"{path}: not a readable adapter ({harness.first_line(error)})")
    params = dict(model.named_parameters())
    expected = {
        PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): name
        for name in params
        if ".lora_A." in name or ".lora_B." in name
    }
    if set(saved) != set(expected):
        raise harness.RunError(
            f"{path}: its adapter weights are not this model's at these --lora-* settings"
        )
    with torch.no_grad():
        for saved_name, name in expected.items():
            tensor = saved[saved_name]
            if tensor.shape != params[name].shape or not torch.isfinite(tensor).all():
                raise harness.RunError(f"{path}: {saved_name} is not finite or not of its shape")
            params[name].copy_(tensor)


def adapter_settings(folder):
    """(r, lora_alpha) of a saved adapter's adapter_config.json."""
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    return config["r"], config["lora_alpha"]


# --------------------------------------------------------------------------------------------------
# 4. The flags (grpo.py's and ppo_rlhf.py's Args inherit them)
# --------------------------------------------------------------------------------------------------


@dataclass
class LoraArgs:
    """LoRA's flags, the same in both trainers (ppo_rlhf.py adapts its policy; its value head is
    trained whole); flat on the command line and in args.json."""

    lora_rank: int = 0
    """LoRA's rank r (lora.py): train only (alpha / r) B A beside each frozen linear weight; 0 = off
    (every weight trained). The reference policy is then the base with the adapter off (no second
    model), and the base is frozen in bf16 under bf16 autocast (verl actor_rollout_ref.model
    .lora_rank)."""
    lora_alpha: float = 16.0
    """LoRA's alpha: the update is scaled by alpha / r (verl's default 16; its GSM8K LoRA recipe
    uses alpha = r = 32)."""
    lora_target_modules: str = "all-linear"
    """The linear layers LoRA adapts: all-linear (every linear layer of the decoder, attention and
    MLP; not the LM head) or comma-separated module names (q_proj,v_proj; GPT-2's c_attn,c_proj;
    grpo.py's lm_head only in a model with untied embeddings)."""


def check_lora_args(args):
    """A rank of 0 (off) or more and a positive alpha, each refused in one line."""
    harness.check_rules(args, {}, {">= 0": "lora_rank", "> 0": "lora_alpha"})
