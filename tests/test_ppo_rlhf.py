"""ppo_rlhf.py: every implementation detail against hand-computed tensors, a padded-forward parity
test against an unpadded HF forward, and short end-to-end runs (learning, resume, 2-process torchrun
on CPU with gloo).

Budget: <= 180 s on 2 CPU cores. The end-to-end runs use a tiny random reward model (normalised to
mean 0 / std 1 on random responses) built in a fixture, so they do not pay for `python rewards.py
tiny`; the full pipeline command is measured separately (see the PR report / README).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import corrections
import logprobs
import objectives
import ppo_rlhf
import rewards
import tasks
from ppo_rlhf import (
    PRESETS,
    adaptive_kl_update,
    batch_sizes,
    check_args,
    clipped_value_loss,
    compute_gae,
    left_pad_queries,
    linear_lr,
    local_seed,
    minibatch_schedule,
    penalise_untruncated,
    truncate_responses,
    whiten,
)
from tolerances import assert_float32_close

ROOT = Path(__file__).resolve().parent.parent
PAD = 0

# ---------------------------------------------------------------------------------------------------------------
# padding, position ids, truncation
# ---------------------------------------------------------------------------------------------------------------


def test_openai_position_ids_are_the_exclusive_cumsum_and_pads_become_zero():
    """rewards.forward_inputs, the OpenAI rule both ppo_rlhf.py's forwards and the reward model use:
    real tokens at 0, 1, 2, ... as if unpadded; a pad after real tokens takes the next position
    ([repro]'s cumsum - mask; verl's cumsum - 1 in rollout.make_batch would repeat the last one)."""
    P = 50257  # gpt2's added [PAD]: outside the embedding, must never be looked up
    qr = torch.tensor([[P, P, 23073, 11, 339, 561], [7, 8, 9, 10, P, P]])
    inputs = rewards.forward_inputs(qr, qr != P)
    assert inputs["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert inputs["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 4]]
    assert inputs["input_ids"].tolist() == [[0, 0, 23073, 11, 339, 561], [7, 8, 9, 10, 0, 0]]


def test_left_pad_queries_truncates_and_left_pads():
    q = left_pad_queries([[5, 6], [1, 2, 3, 4, 5, 6], []], 4, PAD)
    assert q.tolist() == [[0, 0, 5, 6], [1, 2, 3, 4], [0, 0, 0, 0]]


def test_move_padding_left_keeps_token_order():
    x = torch.tensor([[0, 5, 6, 7, 0, 0], [0, 0, 1, 0, 2, 0], [3, 4, 5, 6, 7, 8]])
    assert rewards.left_pad(x, PAD).tolist() == [
        [0, 0, 0, 5, 6, 7],
        [0, 0, 0, 0, 1, 2],
        [3, 4, 5, 6, 7, 8],
    ]


def test_truncation_at_first_token_after_position_and_penalty():
    DOT = 9
    responses = torch.tensor(
        [
            # DOT at 1 is before truncate_after=3; first counted DOT at 4
            [1, DOT, 2, 3, DOT, 4, DOT, 5],
            [1, 2, 3, 4, 5, 6, 7, 8],  # no DOT at all -> unchanged, penalised
            [DOT, 2, 3, 4, 5, 6, 7, 8],  # only a DOT before truncate_after -> unchanged, penalised
            [1, 2, 3, DOT, 5, 6, 7, DOT],  # DOT exactly at truncate_after counts
        ]
    )
    post = truncate_responses(responses, DOT, 3, PAD)
    assert post.tolist() == [
        [1, DOT, 2, 3, DOT, 0, 0, 0],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [DOT, 2, 3, 4, 5, 6, 7, 8],
        [1, 2, 3, DOT, 0, 0, 0, 0],
    ]
    scores = torch.tensor([0.5, 0.7, 0.9, -0.3])
    assert penalise_untruncated(scores, post, DOT, 3, -1.0).tolist() == pytest.approx(
        [0.5, -1.0, -1.0, -0.3]
    )
    # the reward model's view: query + truncated response with the tail pads moved left, last
    # position real
    q = torch.tensor([[0, 11, 12]] * 4)
    rm_input = rewards.left_pad(torch.cat([q, post], 1), PAD)
    assert rm_input[0].tolist() == [0, 0, 0, 0, 11, 12, 1, DOT, 2, 3, DOT]
    assert (rm_input[:, -1] != PAD).all()


# ---------------------------------------------------------------------------------------------------------------
# whitening, GAE, value clipping, KL controller, lr, minibatches, seeds, batch arithmetic
# ---------------------------------------------------------------------------------------------------------------


def test_whiten_is_tf_moments_biased_and_shift_mean_false_keeps_mean():
    rewards = torch.tensor([[1.2, 1.3, 1.4], [1.5, 1.6, 1.7], [1.8, 1.9, 2.0]], dtype=torch.float64)
    # the blog's tf.nn.moments output (biased variance 0.0667, not torch.var's 0.075)
    expected = [
        [0.05080712, 0.4381051, 0.8254035],
        [1.2127019, 1.6000004, 1.9872988],
        [2.3745968, 2.7618952, 3.1491938],
    ]
    out = whiten(rewards, shift_mean=False)
    assert torch.allclose(out, torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert out.mean().item() == pytest.approx(1.6, abs=1e-9)  # mean kept
    centred = whiten(rewards)
    assert centred.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert centred.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def test_gae_matches_a_plain_python_loop():
    g = torch.Generator().manual_seed(0)
    rewards, values = (
        torch.randn(3, 7, generator=g, dtype=torch.float64),
        torch.randn(3, 7, generator=g, dtype=torch.float64),
    )
    gamma, lam = 0.9, 0.95
    adv, ret = compute_gae(rewards, values, gamma, lam)
    for b in range(3):
        r, v = rewards[b].tolist(), values[b].tolist()
        expected, last = [0.0] * 7, 0.0
        for t in reversed(range(7)):
            next_v = v[t + 1] if t + 1 < 7 else 0.0
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            expected[t] = last
        assert adv[b].tolist() == pytest.approx(expected, abs=1e-12)
    assert torch.allclose(ret, adv + values)
    # gamma = lam = 1: the advantage is the undiscounted reward-to-go minus the value
    adv1, _ = compute_gae(rewards, values, 1.0, 1.0)
    assert torch.allclose(adv1, rewards.flip(1).cumsum(1).flip(1) - values)


def test_value_clipping_hand_computed():
    vpred = torch.tensor([[1.0, 0.0, 0.5]])
    values = torch.tensor([[0.5, 0.1, 0.5]])
    returns = torch.tensor([[2.0, -1.0, 0.0]])
    vf_loss, clipfrac, err = clipped_value_loss(vpred, values, returns, 0.2)
    # clipped vpred = [0.7, 0.0, 0.5]; unclipped sq err = [1, 1, 0.25]; clipped sq err = [1.69, 1,
    # 0.25]
    assert vf_loss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.25) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert err[0].tolist() == pytest.approx([1.0, 1.0, 0.25])


def test_adaptive_kl_controller_hand_computed():
    # proportional_error = clip(kl/target - 1, -0.2, 0.2); mult = 1 + error * n_steps / horizon
    assert adaptive_kl_update(0.15, 9.0, 512, 6.0, 10000) == pytest.approx(
        0.15 * (1 + 0.2 * 512 / 10000)
    )
    assert adaptive_kl_update(0.15, 6.6, 512, 6.0, 10000) == pytest.approx(
        0.15 * (1 + 0.1 * 512 / 10000)
    )
    assert adaptive_kl_update(0.15, 0.0, 512, 6.0, 10000) == pytest.approx(
        0.15 * (1 - 0.2 * 512 / 10000)
    )
    assert adaptive_kl_update(0.15, 6.0, 512, 6.0, 10000) == pytest.approx(0.15)


def test_linear_lr_anneals_to_zero():
    lrs = [linear_lr(u, 4, 1e-5) for u in range(1, 5)]
    assert lrs == pytest.approx([1e-5, 0.75e-5, 0.5e-5, 0.25e-5])
    assert linear_lr(5, 4, 1e-5) == pytest.approx(0.0)


def test_minibatch_schedule_uses_every_sample_once_per_epoch():
    rng = np.random.default_rng(0)
    perms = []
    for _ in range(4):
        perm = torch.from_numpy(rng.permutation(16))
        perms.append(perm.tolist())
        schedule = minibatch_schedule(perm, local_mini=8, micro=2)
        assert len(schedule) == 2 and all(len(mb) == 4 for mb in schedule)
        flat = torch.cat([m for mini in schedule for m in mini]).tolist()
        assert flat == perm.tolist() and sorted(flat) == list(range(16))
    assert len({tuple(p) for p in perms}) == 4  # a fresh permutation each epoch


def test_per_rank_seeds():
    assert [local_seed(1, r) for r in range(3)] == [1, 100004, 200007]


def test_global_batch_sizes_are_gpu_count_independent_and_errors_are_clear():
    gpt2 = PRESETS["gpt2_sentiment"][1]
    one, eight = batch_sizes(gpt2, 1), batch_sizes(gpt2, 8)
    assert (one["local_batch"], one["micro"], one["grad_accum"], one["num_updates"]) == (
        512,
        64,
        8,
        1953,
    )
    assert (eight["local_batch"], eight["micro"], eight["grad_accum"], eight["num_updates"]) == (
        64,
        64,
        1,
        1953,
    )
    with pytest.raises(
        ValueError, match="^--rollout-batch-size 512 must be divisible by the world size 3$"
    ):
        check_args(gpt2, 3)
    with pytest.raises(ValueError, match="must be divisible by --local-micro-batch-size 48$"):
        check_args(dataclasses.replace(gpt2, local_micro_batch_size=48), 1)
    with pytest.raises(ValueError, match="^--truncate-after 24 must be < --response-length 24"):
        check_args(dataclasses.replace(gpt2, truncate_after=24), 1)
    with pytest.raises(
        ValueError,
        match="^--correction must be one of decoupled_token_is, .*, got 'no_such_preset'$",
    ):
        check_args(dataclasses.replace(gpt2, correction="no_such_preset"), 1)


def test_unknown_preset_is_rejected_by_the_cli():
    import tyro

    with pytest.raises(SystemExit):
        tyro.extras.overridable_config_cli(PRESETS, args=["no_such_preset"], console_outputs=False)


# ---------------------------------------------------------------------------------------------------------------
# logprobs without the full float32 log-softmax; forward parity; generation
# ---------------------------------------------------------------------------------------------------------------


def logprobs_from_logits(logits, tokens, temperature, banned=None, chunk_rows=1024):
    """logprobs.token_logprobs_and_entropy's logprobs on (B, T, V) logits (what
    logprobs_from_hidden calls)."""
    B, T, V = logits.shape
    return logprobs.token_logprobs_and_entropy(
        logits.reshape(B * T, V),
        tokens.reshape(B * T),
        None,
        logprobs.LogprobSettings(temperature=temperature, chunk_size=chunk_rows, banned=banned),
    )[0].reshape(B, T)


def test_chunked_logprobs_and_entropy_match_log_softmax_including_gradients():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    tokens = torch.randint(1, 11, (3, 5), generator=g)
    T = 0.7
    ours = logprobs_from_logits(logits, tokens, T, chunk_rows=4)  # chunks of 4 rows, checkpointed
    ref = F.log_softmax(logits / T, -1).gather(-1, tokens[..., None]).squeeze(-1)
    # (sums over the 11 tokens of the vocabulary, in another order: tests/tolerances.py)
    assert_float32_close(ours, ref, terms=11)
    (g1,) = torch.autograd.grad(ours.sum(), logits)
    (g2,) = torch.autograd.grad(ref.sum(), logits)
    assert_float32_close(g1, g2, terms=11)
    p = F.softmax(logits / T, -1)
    _, entropy = logprobs.token_logprobs_and_entropy(
        logits.detach().reshape(15, 11),
        tokens.reshape(15),
        None,
        logprobs.LogprobSettings(temperature=T, chunk_size=4),
    )
    assert torch.allclose(entropy.reshape(3, 5), -(p * p.log()).sum(-1), atol=1e-5)
    # a banned (in-vocabulary pad) token is removed from the distribution
    banned = torch.zeros(11, dtype=torch.bool)
    banned[0] = True
    ref_b = F.log_softmax((logits / T).masked_fill(banned, float("-inf")), -1).gather(
        -1, tokens[..., None]
    )
    assert torch.allclose(
        logprobs_from_logits(logits, tokens, T, banned, 4), ref_b.squeeze(-1), atol=1e-6
    )


def test_padded_forward_matches_unpadded_hf_forward(tiny_lm):
    model, tok = tiny_lm
    pad = tok.pad_token_id
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, len(tok), (n,), generator=g) for n in (9, 5, 2)]
    L = 9
    padded = torch.stack([torch.cat([torch.full((L - len(r),), pad), r]) for r in rows])
    with torch.no_grad():
        hidden = model.base_model(**rewards.forward_inputs(padded, padded != pad)).last_hidden_state
        logits = model.get_output_embeddings()(hidden)
        for i, r in enumerate(rows):
            # unpadded HF forward, default positions 0..n-1
            ref = model(input_ids=r[None]).logits[0]
            assert torch.allclose(logits[i, L - len(r) :], ref, atol=1e-5)
        # PolicyAndValue slices the response positions, and its zero-initialised value head gives
        # exactly 0
        pv = ppo_rlhf.PolicyAndValue(model)
        resp_hidden, values = pv(padded, 4, pad)
        assert torch.equal(resp_hidden, hidden[:, 3:-1])
        assert torch.equal(values, torch.zeros(3, 5)) and values.dtype == torch.float32
        assert torch.equal(ppo_rlhf.response_hidden(model, padded, 4, pad), hidden[:, 3:-1])
        # logprobs and entropy through the float32 LM head == a plain log_softmax of the logits
        tokens = padded[:, 4:]
        lp, ent = ppo_rlhf.logprobs_from_hidden(
            model, resp_hidden, tokens, logprobs.LogprobSettings(temperature=0.7, chunk_size=4)
        )
        full = torch.log_softmax(logits[:, 3:-1] / 0.7, -1)
        assert torch.allclose(lp, full.gather(-1, tokens[..., None])[..., 0], atol=1e-5)
        assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# end to end: learning, resume, 2-process torchrun
# ---------------------------------------------------------------------------------------------------------------


def tiny_args(assets, output_dir, **overrides):
    base = PRESETS["tiny"][1]
    return dataclasses.replace(
        base,
        reward_model_path=str(assets / "reward_model"),
        output_dir=str(output_dir),
        # exact fp32 CPU, even on a GPU box; no sample tables unless asked
        **{"cuda": False, "log_samples_every": 0, **overrides},
    )


def read_metrics(output_dir):
    return [json.loads(line) for line in open(Path(output_dir) / "metrics.jsonl")]


def test_tiny_run_learns(tiny_assets, tmp_path):
    out = tmp_path / "learn"
    ppo_rlhf.train(tiny_args(tiny_assets, out, total_episodes=64 * 30, save_every=0))
    m = read_metrics(out)
    assert [r["step"] for r in m] == list(range(1, 31))
    first = np.mean([r["objective/scores"] for r in m[:3]])
    last = np.mean([r["objective/scores"] for r in m[-3:]])
    print(f"scores {first:.3f} -> {last:.3f}; kl {[round(r['objective/kl'], 2) for r in m[-3:]]}")
    assert last - first >= 0.5
    # policy == reference before the first step
    assert m[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert all(0.0 <= r["objective/kl"] < 3 * PRESETS["tiny"][1].kl_target for r in m)
    assert (out / "policy" / "value_head.pt").exists()
    # DIALECT checkpoint layout: <output_dir>/checkpoint/ (HF policy + trainer state + per-rank
    # RNG), nothing else
    assert {"config.json", "trainer_state.pt", "value_head.pt", "rng_rank0.pt"} <= set(
        os.listdir(out / "checkpoint")
    )
    assert not (out / "checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    for key in (
        "objective/kl_coef",
        "objective/entropy",
        "objective/non_score_reward",
        "objective/score_total",
        "ppo/policy/approxkl_avg",
        "ppo/policy/clipfrac_avg",
        "ppo/loss/policy_avg",
        "ppo/loss/value_avg",
        "ppo/loss/total",
        "ppo/val/vpred",
        "ppo/val/error",
        "ppo/val/clipfrac",
        "ppo/val/mean",
        "ppo/val/var",
        "ppo/returns/mean",
        "ppo/lr",
        "ppo/episode",
    ):
        assert key in m[-1] and np.isfinite(m[-1][key]), key


def test_resume_after_crash_is_exact(tiny_assets, tmp_path, monkeypatch):
    """A run that crashes while saving update 3's checkpoint (its metrics row already written)
    resumes from update 2's checkpoint when started again with the same --output-dir: update 3's row
    moves to metrics.jsonl.discarded, and the final weights and beta are those of an uninterrupted
    run."""
    args = tiny_args(
        tiny_assets,
        tmp_path / "uninterrupted",
        total_episodes=64 * 3,
        save_every=2,
        correction="decoupled_token_is",
    )
    ppo_rlhf.train(args)
    uninterrupted = json.load(open(tmp_path / "uninterrupted" / "final_rank0.json"))
    assert "rollout_corr/kl" in read_metrics(tmp_path / "uninterrupted")[-1]
    out = tmp_path / "resume"
    args = dataclasses.replace(args, output_dir=str(out))
    save = ppo_rlhf.save

    def crash_at_update_3(args, rank, model, tokenizer, optimizer, update, *rest):
        if update == 3:
            raise RuntimeError("simulated crash")
        save(args, rank, model, tokenizer, optimizer, update, *rest)

    monkeypatch.setattr(ppo_rlhf, "save", crash_at_update_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ppo_rlhf.train(args)
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(ppo_rlhf, "save", save)
    ppo_rlhf.train(args)  # resumes from <output_dir>/checkpoint
    resumed = json.load(open(out / "final_rank0.json"))
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl.discarded")] == [3]
    assert resumed["checksum"] == uninterrupted["checksum"]
    assert resumed["kl_coef"] == uninterrupted["kl_coef"]


def test_cli_rejects_bad_input_before_loading_models(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "ppo_rlhf.py",
            "tiny",
            "--output-dir",
            str(tmp_path / "bad"),
            "--kl-coef",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2  # argparse's convention for bad input, as grpo.py and rewards.py
    assert proc.stderr.strip().splitlines() == [
        "ppo_rlhf.py: error: --kl-coef must be >= 0, got -1.0"
    ]
    assert not (tmp_path / "bad" / "reward_model_run").exists()  # nothing was trained or loaded


BAD_FLAGS = [  # (flags after `tiny`, the start of the one-line message)
    (["--kl-coef", "-1"], "--kl-coef must be >= 0, got -1.0"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--temperature", "0"], "--temperature must be > 0, got 0.0"),
    (["--cliprange", "-1"], "--cliprange must be in [0, 1), got -1.0"),
    (["--vf-coef", "-1"], "--vf-coef must be >= 0, got -1.0"),
    (["--gamma", "2"], "--gamma must be in [0, 1], got 2.0"),
    (["--lam", "2"], "--lam must be in [0, 1], got 2.0"),
    (["--kl-target", "0"], "--kl-target must be > 0, got 0.0"),
    (["--kl-horizon", "0"], "--kl-horizon must be >= 1, got 0"),
    (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
    (["--optimizer", "sgd"], "--optimizer must be one of adam_tf, adam, got 'sgd'"),
    (["--precision", "fp16"], "--precision must be one of auto, fp32, bf16, got 'fp16'"),
    (["--correction", "nope"], "--correction must be one of decoupled_token_is, "),
    (["--truncate-after", "16"], "--truncate-after 16 must be < --response-length 16"),
    (
        ["--nminibatches", "3"],
        "--rollout-batch-size / world size = 64 must be divisible by --nminibatches 3",
    ),
    (
        ["--base-model", "/no/such/model"],
        "--base-model '/no/such/model': not a local directory, and its config",
    ),
    (
        ["--reward-model-path", "/no/such/dir"],
        "--reward-model-path '/no/such/dir' must be a directory",
    ),
    (
        ["--resume-from", "/no/such/dir"],
        "--resume-from '/no/such/dir' must be a checkpoint directory",
    ),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_every_bad_flag_is_one_line_and_exit_2(flags, message, tmp_path, capsys):
    """main() as the command line runs it: a bad flag is refused by check_args in one line naming
    it, exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        ppo_rlhf.main(["tiny", "--output-dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppo_rlhf.py: error: " + message), lines


def test_an_output_dir_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="^--output-dir '.*a_file/run': cannot be created"):
        check_args(
            dataclasses.replace(PRESETS["tiny"][1], output_dir=str(tmp_path / "a_file" / "run")), 1
        )


def test_torchrun_two_cpu_processes_end_identical(tiny_assets, tmp_path):
    out = tmp_path / "ddp"
    # gloo on CPU, even on a 1-GPU machine
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "ppo_rlhf.py",
        "tiny",
        "--output-dir",
        str(out),
        "--reward-model-path",
        str(tiny_assets / "reward_model"),
        "--total-episodes",
        str(64 * 3),
        "--save-every",
        "0",
        "--log-samples-every",
        "0",
        "--kl-horizon",
        "100",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = json.load(open(out / "final_rank0.json"))
    r1 = json.load(open(out / "final_rank1.json"))
    assert r0["checksum"] == r1["checksum"] and r0["abs_checksum"] == r1["abs_checksum"]
    # updated, from the all-reduced KL
    assert r0["kl_coef"] == r1["kl_coef"] != PRESETS["tiny"][1].kl_coef
    m = read_metrics(out)
    assert [r["step"] for r in m] == [1, 2, 3] and m[-1]["ppo/episode"] == 64 * 3


def test_bypass_logs_the_first_micro_batch_correction_metrics(tiny_assets, tmp_path, monkeypatch):
    """Bypass mode: update_policy corrects every micro-batch (corrections.apply_rollout_correction of
    the current logprobs); the logged rollout_corr/* and training/* are those of the first
    micro-batch of the update (verl, grpo.update_policy), where pi_theta is still pi_old: the
    generate()-vs-forward mismatch alone, ~0 on CPU in fp32. Later micro-batches (after optimizer
    steps) differ."""
    calls = []
    apply_rollout_correction = corrections.apply_rollout_correction

    def recording(*args, **kwargs):
        weights, mask, metrics = apply_rollout_correction(*args, **kwargs)
        calls.append(metrics)
        return weights, mask, metrics

    monkeypatch.setattr(corrections, "apply_rollout_correction", recording)
    # bypass mode's per-micro-batch correction runs in objectives.bypass_mode_loss, which calls
    # the function by the name objectives imported it under
    monkeypatch.setattr(objectives, "apply_rollout_correction", recording)
    out = tmp_path / "bypass"
    ppo_rlhf.train(
        tiny_args(
            tiny_assets,
            out,
            total_episodes=64,
            local_micro_batch_size=16,
            nminibatches=2,
            save_every=0,
            correction="bypass_ppo_clip",
        )
    )
    m = read_metrics(out)[0]
    assert len(calls) == 4 * 4  # 4 epochs x 2 minibatches x 2 micro-batches, none in step 7
    corr_keys = [k for k in calls[0] if k.startswith(("rollout_corr/", "training/"))]
    assert "rollout_corr/kl" in corr_keys and abs(m["rollout_corr/kl"]) < 1e-3
    for k in corr_keys:
        assert m[k] == pytest.approx(calls[0][k], rel=1e-6, abs=1e-6, nan_ok=True), k
    # the policy moved
    assert abs(calls[-1]["rollout_corr/kl"]) > 100 * abs(calls[0]["rollout_corr/kl"])
    assert np.isfinite(m["ppo/loss/total"])


def test_disabled_correction_is_the_original_ppo_loss():
    """--correction disabled (the default): no IS weights and the plain mask, so update_policy's
    policy term is OpenAI's clipped surrogate as train_policy.py writes it (pg_losses = -A * ratio,
    pg_losses2 = -A * clip(ratio), the mean of their max), here split over two ranks with
    verl's global token count (each rank's loss x world size / all tokens)."""
    g = torch.Generator().manual_seed(0)
    new, old, rollout_lp, adv = (
        torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.1 for _ in range(4)
    )
    mask = torch.ones(4, 6, dtype=torch.float64)
    disabled = corrections.RolloutCorrection.from_name("disabled")
    is_weights, pg_mask, metrics = corrections.apply_rollout_correction(
        old, rollout_lp, mask, disabled
    )
    assert is_weights is None and torch.equal(pg_mask, mask) and "rollout_corr/kl" in metrics
    info = dict(dp_size=2, batch_num_tokens=48.0)
    pg_losses, _ = objectives.ppo_clip_token_loss(new, old, adv, pg_mask, 0.2, 0.2)
    loss = objectives.agg_loss(pg_losses, pg_mask, "token-mean", **info)
    ratio = torch.exp(new - old)
    openai = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)).mean()
    assert loss.item() == pytest.approx(openai.item() * 24 / 48 * 2, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# OpenAI fidelity: per-group whitening, the reward model's seed, the TL;DR preset and its query
# path, new metrics
# ---------------------------------------------------------------------------------------------------------------


def openai_whiten(x, shift_mean=True):
    """lm_human_preferences/utils/core.py whiten, transcribed in numpy: tf.nn.moments (biased
    variance) over all elements, (x - mean) * rsqrt(var + 1e-8), the mean added back when shift_mean
    is False."""
    mean, var = x.mean(), x.var()
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_in_groups_of_64_equals_what_eight_ranks_compute(shift_mean):
    """OpenAI's 8 ranks each whitened their own 64 rollouts. One process with group_size=64 must
    give, row for row, the 8 ranks' results (each computed here as the original would on its 64
    rows), and differ from whitening all 512 at once when the ranks' batches have different
    scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 24, generator=g, dtype=torch.float64)
    # rank r: scale r + 1
    x = x * torch.arange(1, 9, dtype=torch.float64).repeat_interleave(64)[:, None] + 0.3
    ranks = np.concatenate(
        [openai_whiten(x[64 * r : 64 * (r + 1)].numpy(), shift_mean) for r in range(8)]
    )
    grouped = whiten(x, shift_mean=shift_mean, group_size=64)
    np.testing.assert_allclose(grouped.numpy(), ranks, rtol=1e-10, atol=1e-10)
    # group_size 0: the whole batch, as before
    np.testing.assert_allclose(
        whiten(x, shift_mean=shift_mean).numpy(),
        openai_whiten(x.numpy(), shift_mean),
        rtol=1e-10,
        atol=1e-10,
    )
    assert not np.allclose(whiten(x, shift_mean=shift_mean).numpy(), ranks, atol=1e-3)


def test_whiten_group_size_is_checked():
    gpt2 = PRESETS["gpt2_sentiment"][1]
    assert gpt2.whiten_group_size == 64  # 512 / 8 ranks: one GPU reproduces the 8-GPU experiment
    assert batch_sizes(gpt2, 1)["local_batch"] == 512 and batch_sizes(gpt2, 8)["local_batch"] == 64
    with pytest.raises(ValueError, match="must be divisible by --whiten-group-size 48$"):
        batch_sizes(dataclasses.replace(gpt2, whiten_group_size=48), 1)
    with pytest.raises(ValueError, match="^--whiten-group-size must be >= 8 to whiten rewards"):
        batch_sizes(dataclasses.replace(gpt2, whiten_group_size=4), 1)
    with pytest.raises(ValueError, match="^--whiten-group-size must be >= 0"):
        batch_sizes(dataclasses.replace(gpt2, whiten_group_size=-1), 1)


def test_gpt2_tldr_preset_follows_launch_py():
    """Every value of launch.py's summarize_tldr_task and get_experiments()['tldr'] /
    get_train_reward_experiments() ['tldr'], and it validates on 1 and 8 ranks (4 rollouts per rank
    on 8: no reward whitening there)."""
    a = PRESETS["gpt2_tldr"][1]
    assert (a.query_dataset, a.query_length, a.response_length, a.query_suffix, a.query_prefix) == (
        "tldr",
        500,
        75,
        "\n\nTL;DR:",
        "",
    )
    assert (a.start_text, a.end_text, a.truncate_token, a.truncate_after, a.temperature) == (
        None,
        None,
        "\n",
        55,
        0.7,
    )
    assert (
        a.total_episodes,
        a.rollout_batch_size,
        a.lr,
        a.kl_coef,
        a.adaptive_kl,
        a.whiten_rewards,
    ) == (1_000_000, 32, 2e-6, 0.03, False, False)
    assert (
        a.noptepochs,
        a.nminibatches,
        a.gamma,
        a.lam,
        a.vf_coef,
        a.cliprange,
        a.cliprange_value,
    ) == (4, 1, 1.0, 0.95, 0.1, 0.2, 0.2)
    assert batch_sizes(a, 1)["local_batch"] == 32 and batch_sizes(a, 8)["local_batch"] == 4
    r = rewards.PRESETS[a.reward_preset][1]
    assert r.label_source.endswith("/labels/tldr/online_45k.json") and r.query_dataset == "tldr"
    assert (r.num_train, r.batch_size, r.lr, r.rollout_batch_size, r.normalize_samples) == (
        46_000,
        16,
        2.5e-5,
        128,
        256,
    )
    # the reward model must see the task the policy trains on (train_policy.py asserts hparams.task
    # equality)
    for key in (
        "query_length",
        "response_length",
        "temperature",
        "query_suffix",
        "query_prefix",
        "start_text",
        "end_text",
    ):
        assert getattr(r, key) == getattr(a, key), key


def test_inline_reward_model_gets_the_policy_seed(tmp_path, monkeypatch):
    """lm-human-preference-details' train-both script seeds the reward model with the policy's
    seed."""
    seen = {}

    def fake_train(rm_args):
        seen["seed"], seen["output_dir"] = rm_args.seed, rm_args.output_dir
        os.makedirs(rm_args.output_dir, exist_ok=True)  # rewards.train creates it
        return os.path.join(rm_args.output_dir, "reward_model")

    monkeypatch.setattr(rewards, "train", fake_train)
    args = dataclasses.replace(PRESETS["tiny"][1], seed=7, output_dir=str(tmp_path))
    rm_path, _ = ppo_rlhf.reward_model_paths(args)
    assert seen["seed"] == 7 and rm_path == os.path.join(
        str(tmp_path), "reward_model_run", "reward_model"
    )


def test_tldr_query_batches_offline(tmp_path, monkeypatch):
    """The gpt2_tldr query path on a local file in OpenAI's tldr JSON format (a list of posts with
    "content"): raw left-padded queries for the reward model, the policy's queries end with the
    suffix, and resuming at update 2 replays the stream (sharded by rank, shared shuffle) to exactly
    the second batch."""
    posts = [
        {
            "id": str(i),
            "subreddit": "s",
            "title": "t",
            "content": f"post {i}\n\n\n\nends",
            "summary": "x",
        }
        for i in range(10)
    ]
    path = tmp_path / "train-subset.json"
    path.write_text(json.dumps(posts))
    monkeypatch.setattr(rewards, "OPENAI_TLDR_URL", str(path))
    tokenizer = tasks.build_tiny_tokenizer()
    args = dataclasses.replace(PRESETS["gpt2_tldr"][1], query_length=12)
    stream = ppo_rlhf.query_batches(args, tokenizer, seed=1, local_batch=2, start_update=1)
    first, second = next(stream), next(stream)
    assert first.shape == (2, 12)
    texts = [
        tokenizer.decode(row[row != tokenizer.pad_token_id]) for row in torch.cat([first, second])
    ]
    assert all(t.startswith("post ") and "\n\n\n" not in t for t in texts) and len(set(texts)) == 4
    suffix = tokenizer.encode(args.query_suffix, add_special_tokens=False)
    policy_queries = rewards.format_queries(first, [], suffix, tokenizer.pad_token_id)
    assert (
        policy_queries.shape == (2, 12 + len(suffix))
        and policy_queries[:, -len(suffix) :].tolist() == [suffix] * 2
    )
    resumed = next(ppo_rlhf.query_batches(args, tokenizer, seed=1, local_batch=2, start_update=2))
    assert torch.equal(resumed, second)
    rank1 = next(
        ppo_rlhf.query_batches(
            args, tokenizer, seed=100004, local_batch=2, start_update=1, rank=1, world_size=2
        )
    )
    rank0 = next(
        ppo_rlhf.query_batches(
            args, tokenizer, seed=1, local_batch=2, start_update=1, rank=0, world_size=2
        )
    )
    assert torch.equal(
        torch.stack([rank0[0], rank1[0], rank0[1], rank1[1]]), torch.cat([first, second])
    )


def test_grouped_whitening_run_logs_the_new_metrics(tiny_assets, tmp_path):
    """Two updates with whitening groups of 8: the [repro]/OpenAI metrics ppo/val/ratio_var,
    advantage_var and var_explained are logged; the group means of the whitened advantages are 0, so
    advantage_var is ~0 (as [repro] logs it across ranks), ratio_var > 0 (the ratio is exactly 1
    only before the first optimizer step), and var_explained = 1 - error / var(returns) <= 1."""
    out = tmp_path / "grouped"
    ppo_rlhf.train(
        tiny_args(
            tiny_assets,
            out,
            total_episodes=32,
            rollout_batch_size=16,
            local_micro_batch_size=8,
            whiten_group_size=8,
            save_every=0,
        )
    )
    m = read_metrics(out)
    assert len(m) == 2
    for r in m:
        assert 0.0 <= r["ppo/val/advantage_var"] < 1e-10
        assert r["ppo/val/ratio_var"] > 0 and np.isfinite(r["ppo/val/ratio_var"])
        assert np.isfinite(r["ppo/val/var_explained"]) and r["ppo/val/var_explained"] <= 1.0


def test_lexicon_labeller_score_is_logged_only_for_lexicon_reward_presets(
    tiny_assets, tmp_path, monkeypatch
):
    """objective/lexicon_score (smol_sentiment): the programmatic labeller's mean score of the
    decoded truncated responses, one call per response; absent for presets whose labels came from
    elsewhere."""
    import rewards

    seen = []
    monkeypatch.setattr(
        tasks, "lexicon_sentiment_score", lambda text: seen.append(text) or len(seen) % 3
    )
    monkeypatch.setitem(
        rewards.PRESETS,
        "lexicon_check",
        ("lexicon check", dataclasses.replace(rewards.PRESETS["tiny"][1], label_source="lexicon")),
    )
    out = tmp_path / "lexicon"
    ppo_rlhf.train(
        tiny_args(
            tiny_assets, out, total_episodes=64 * 2, save_every=0, reward_preset="lexicon_check"
        )
    )
    m = read_metrics(out)
    assert len(seen) == 2 * 64 and all(isinstance(t, str) for t in seen)
    for update, row in enumerate(m):
        assert row["objective/lexicon_score"] == pytest.approx(
            np.mean([(64 * update + i + 1) % 3 for i in range(64)])
        )
    ppo_rlhf.train(tiny_args(tiny_assets, tmp_path / "plain", total_episodes=64, save_every=0))
    assert "objective/lexicon_score" not in read_metrics(tmp_path / "plain")[0]
