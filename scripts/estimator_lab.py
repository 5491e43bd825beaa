"""The estimator lab: the exact bias and variance of every rollout-correction estimator, on a policy
small enough to enumerate every response.

    .venv/bin/python scripts/estimator_lab.py   # figures in docs/img/, numbers in docs/estimator_lab.json (~15 s CPU)

Why. The rollout-correction documents make precise claims (verl's docs/algo/rollout_corr_math.md,
section 3.3; the TIS paper, Yao et al. 2025, "Vanilla-IS vs. TIS"): ignoring the rollout/trainer
mismatch biases the gradient; sequence-level IS is unbiased but its variance grows with the length;
token-level truncated IS trades a small bias for a low variance; rejection drops what IS cannot
repair. Monte-Carlo training curves bury these effects in seed noise (docs/mismatch_experiment.md).
Here nothing is sampled: every expectation is an exact sum over all V^L responses.

The setting (one prompt, responses of exactly L tokens from a vocabulary of V):
    pi_train(y)    = prod_t softmax(theta[y_{t-1}])[y_t]   a bigram language model: one table of logits theta (V+1, V)
                     shared by all positions, like an LM's weights (row V is the "previous token" of t = 0), so the
                     per-token mismatch is the same at every position and only its accumulation changes with L
    pi_rollout(y)  = the same table perturbed: weights rounded to bf16 / fp8-e4m3 / int8 / int4 (rollout.apply_mismatch,
                     per output token = per row of theta^T (V, V+1), like an LM head), a sampling
                     temperature the trainer does not apply, additive Gaussian logit noise, or a "spike" (one logit
                     the trainer finds nearly impossible, as a kernel bug would produce)
    R(y)           = fraction of positions t with y_t == t mod V (a copy-like reward)
    A(y)           = R(y) - E_{pi_rollout}[R] (the group mean GRPO estimates, here exact)

The true gradient is grad_theta E_{pi_train}[R], by autograd through the exact sum. A method is an
estimator g(y) of it from ONE response y ~ pi_rollout: the negative gradient of its loss on that
response, with the loss computed by corrections.py itself (apply_rollout_correction and the
loss terms, composed as grpo.update_policy composes them), at theta = theta_old (the first gradient of an update, where pi_old =
pi_theta). Then, exactly,
    mean      m   = sum_y pi_rollout(y | kept) g(y)    (rejection methods: a batch mean over the kept responses)
    bias          = ||m - grad J|| / ||grad J||        cosine(m, grad J)
    variance      = sum_y pi_rollout(y | kept) ||g(y)||^2 - ||m||^2   (trace of one sample's covariance) / ||grad J||^2
    variance_ratio = the same variance / that of on-policy REINFORCE (responses from pi_train, baseline E_train[R])
    mse(N)        = bias^2 + variance / (N * kept)     (relative; a batch of N responses keeps about N * kept)
Per-response gradients come from one backward pass: each response gets its own copy of the table (B,
V+1, V) and the loss is aggregated with "token-sum", so grad[y] is response y's gradient alone.
"""

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import corrections  # noqa: E402
import logprobs  # noqa: E402
import objectives  # noqa: E402
from corrections import RolloutCorrection  # noqa: E402

# Every method is a corrections.RolloutCorrection; "vanilla" IS has no truncation: an infinite
# threshold (verl accepts `inf`; corrections clamps log-ratios to +-20 before exponentiating, so the
# weights stay finite).
NO_TRUNCATION = math.inf
METHODS = {
    # PPO against pi_old, pi_rollout ignored (TIS paper's naive)
    "naive": RolloutCorrection.from_name("disabled"),
    "seq IS (vanilla)": RolloutCorrection(
        rollout_is="sequence", rollout_is_threshold=NO_TRUNCATION
    ),
    "token IS (vanilla)": RolloutCorrection(rollout_is="token", rollout_is_threshold=NO_TRUNCATION),
    "token TIS": RolloutCorrection.from_name("decoupled_token_is"),  # min(rho_t, 2)
    "seq TIS": RolloutCorrection.from_name("decoupled_seq_is"),  # min(prod rho, 2)
    # seq TIS + reject prod rho outside [0.5, 2]
    "seq MIS": RolloutCorrection.from_name("decoupled_seq_is_rs"),
    # reject exp(mean log rho) outside [0.999, 1.001]
    "geo RS": RolloutCorrection.from_name("decoupled_geo_rs"),
    "geo RS + token TIS": RolloutCorrection.from_name("decoupled_geo_rs_token_tis"),
    # reject mean_t (rho - log rho - 1) > 0.01 (seq_mean_k3)
    "K3 RS": RolloutCorrection.from_name("decoupled_k3_rs"),
    # token weights zeroed outside [0.5, 5]
    "IcePop": RolloutCorrection.from_name("decoupled_token_icepop"),
    # naive + drop sequences with any rho_t < 1e-4
    "veto": RolloutCorrection(rollout_token_veto_threshold=1e-4),
    # pi_theta / pi_rollout clipped to [0.8, 1.2]
    "bypass PPO-clip": RolloutCorrection.from_name("bypass_ppo_clip"),
    # REINFORCE, seq TIS from pi_theta / pi_rollout
    "bypass PG-IS": RolloutCorrection.from_name("bypass_pg_is"),
}
COLORS = {
    "naive": "tab:red",
    "seq IS (vanilla)": "black",
    "token IS (vanilla)": "tab:gray",
    "token TIS": "tab:blue",
    "seq TIS": "tab:olive",
    "seq MIS": "tab:green",
    "geo RS": "tab:purple",
    "geo RS + token TIS": "tab:pink",
    "K3 RS": "tab:brown",
    "IcePop": "tab:cyan",
    "veto": "gold",
    "bypass PPO-clip": "tab:orange",
    "bypass PG-IS": "darkblue",
}
ROUNDINGS = ("bf16", "int8", "fp8", "int4")
# The figures show these; the others coincide with one of them away from the spike (veto = naive,
# vanilla token IS and IcePop ~ token TIS, bypass PG-IS = seq TIS at theta = theta_old) and are in
# the table.
FIGURE_METHODS = (
    "naive",
    "seq IS (vanilla)",
    "token TIS",
    "seq TIS",
    "seq MIS",
    "geo RS",
    "K3 RS",
    "bypass PPO-clip",
)
BIAS_FLOOR = 1e-6  # the figures draw a zero bias (seq IS: ~1e-15, float64 rounding) at this floor


@dataclass
class Args:
    vocab_size: int = 3
    """V: tokens per position (V^L responses are enumerated)."""
    length: int = 6
    """L for the mismatch-size sweep and the table."""
    max_length: int = 10
    """The length sweep runs L = 1 .. max_length (3^10 = 59049 responses at the top)."""
    logit_std: float = 1.0
    """Std of the random logits of pi_train (larger = a sharper policy)."""
    seed: int = 0
    """Seed of the logits and of the noise directions."""
    noise_sizes: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
    """Std of the additive Gaussian logit noise of pi_rollout (the mismatch-size sweep)."""
    temperatures: tuple[float, ...] = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5)
    """Rollout sampling temperatures the trainer does not apply (the second mismatch-size sweep)."""
    length_noise: float = 1.0
    """Logit noise std of the length sweep."""
    batch_size: int = 64
    """N in mse(N) = bias^2 + variance / N."""
    spike_logit: float = -12.0
    """"spike" mismatch: pi_train's logit of one (context, token) entry is set to this; pi_rollout
    keeps the original."""
    out_json: str = "docs/estimator_lab.json"
    """All numbers (the tables of docs/estimator_lab.md)."""
    img_dir: str = "docs/img"
    """Where the figures go (estimator_lab_mismatch.png, estimator_lab_length.png)."""


# ---------------------------------------------------------------------------------------------------------------
# 1. The enumerated policy
# ---------------------------------------------------------------------------------------------------------------


def all_responses(vocab_size, length):
    """(V^L, L) every response, and (V^L, L) the previous token of each position (V = the start
    "token")."""
    grids = (
        torch.cartesian_prod(*[torch.arange(vocab_size)] * length)
        if length > 1
        else torch.arange(vocab_size)[:, None]
    )
    tokens = grids.reshape(-1, length)
    prev = torch.cat([torch.full((tokens.shape[0], 1), vocab_size), tokens[:, :-1]], dim=1)
    return tokens, prev


def reward(tokens, vocab_size):
    """R(y) = fraction of positions with y_t == t mod V. (B,)"""
    target = torch.arange(tokens.shape[1]) % vocab_size
    return (tokens == target).double().mean(1)


def token_logprobs(table, tokens, prev, temperature=1.0):
    """(B, L) log pi(y_t | y_{t-1}) for a table (V+1, V) shared by all responses, or (B, V+1, V) one
    per response; through logprobs.token_logprobs_and_entropy (the trainers' own logprob
    routine)."""
    B, L = tokens.shape
    logits = table[prev] if table.dim() == 2 else table[torch.arange(B)[:, None], prev]  # (B, L, V)
    lp, _ = logprobs.token_logprobs_and_entropy(
        logits.reshape(B * L, -1),
        tokens.reshape(-1),
        None,
        logprobs.LogprobSettings(temperature=temperature, chunk_size=B * L),
    )
    return lp.reshape(B, L)


def round_table(table, kind):
    """pi_rollout's weights: rollout.apply_mismatch on the table seen as an LM head theta^T (V,
    V+1): one row (one output channel, one per-row scale) per vocabulary token."""
    import rollout  # imported here: only the rounding perturbations need it

    ((_, rounded),) = rollout.apply_mismatch([("policy.weight", table.T.contiguous())], kind)
    return rounded.T.contiguous()


def make_policy(args):
    """pi_train's table (V+1, V) and a unit noise direction of the same shape (the same for every L,
    so the length sweep changes nothing but L)."""
    g = torch.Generator().manual_seed(args.seed)
    V = args.vocab_size
    theta = torch.randn(V + 1, V, generator=g, dtype=torch.float64) * args.logit_std
    noise = torch.randn(V + 1, V, generator=g, dtype=torch.float64)
    return theta, noise


def rollout_table(theta, noise, args, kind, size):
    """(table, temperature, train_table) of pi_rollout for one perturbation. train_table is
    pi_train's table (only the spike changes it)."""
    if kind == "noise":
        return theta + size * noise, 1.0, theta
    if kind == "temperature":
        return theta, size, theta
    if kind in ROUNDINGS:
        return round_table(theta, kind), 1.0, theta
    # the trainer finds token 0 after the start token nearly impossible, the rollout does not
    if kind == "spike":
        train = theta.clone()
        train[args.vocab_size, 0] = args.spike_logit
        return theta, 1.0, train
    raise ValueError(f"unknown perturbation {kind!r}")


# ---------------------------------------------------------------------------------------------------------------
# 2. Exact moments of every estimator
# ---------------------------------------------------------------------------------------------------------------


def per_response_gradients(config, train_table, rollout_lp, advantages, tokens, prev):
    """(B, P) g(y): minus the gradient of the method's loss on response y alone, at theta =
    theta_old, and (B,) kept(y): 1 unless the method's rejection mask dropped the whole response."""
    B = tokens.shape[0]
    # one copy per response
    table = train_table.detach().expand(B, *train_table.shape).clone().requires_grad_(True)
    logprobs = token_logprobs(table, tokens, prev)  # (B, L)
    mask = torch.ones_like(logprobs)
    adv = advantages[:, None].expand_as(logprobs)
    # the policy-gradient term as grpo.update_policy composes it. Decoupled: pi_old = pi_theta at the
    # first gradient of an update, corrected against pi_rollout; bypass: pi_old = pi_rollout, the
    # correction from the current logprobs (the same values here, at theta = theta_old)
    anchor = rollout_lp if config.bypass_mode else logprobs.detach()
    weights, loss_mask, _ = corrections.apply_rollout_correction(
        logprobs.detach(), rollout_lp, mask, config
    )
    if config.loss_type == "reinforce":
        losses, _ = objectives.reinforce_token_loss(logprobs, adv, loss_mask)
    else:
        losses, _ = objectives.ppo_clip_token_loss(logprobs, anchor, adv, loss_mask)
        if config.bypass_mode:  # the ratio is against pi_rollout: no IS weights (verl)
            weights = None
    if weights is not None:
        losses = losses * weights
    # "token-sum": loss = sum_y sum_t l_t(y), so each response's gradient is its own (no
    # normalisation across responses; the rejection renormalisation is applied in `evaluate`, as a
    # batch mean over kept responses does).
    loss = objectives.agg_loss(losses, loss_mask, "token-sum")
    kept_mask = loss_mask
    (grad,) = torch.autograd.grad(loss, table)
    return -grad.reshape(B, -1), kept_mask.bool().any(-1).double()


def true_gradient(train_table, tokens, prev, rewards):
    """grad_theta E_{pi_train}[R], exact. (P,)"""
    theta = train_table.detach().clone().requires_grad_(True)
    expected_reward = (token_logprobs(theta, tokens, prev).sum(1).exp() * rewards).sum()
    (grad,) = torch.autograd.grad(expected_reward, theta)
    return grad.reshape(-1)


def evaluate(args, length, kind, size, methods=None):
    """Every method's exact bias / cosine / variance for one (length, perturbation). Returns a
    dict."""
    theta, noise = make_policy(args)
    rollout, temperature, train_table = rollout_table(theta, noise, args, kind, size)
    tokens, prev = all_responses(args.vocab_size, length)
    rewards = reward(tokens, args.vocab_size)
    rollout_lp = token_logprobs(rollout, tokens, prev, temperature)  # (B, L)
    train_lp = token_logprobs(train_table, tokens, prev)
    q = rollout_lp.sum(1).exp()  # pi_rollout(y), sums to 1
    p = train_lp.sum(1).exp()
    advantages = rewards - (q * rewards).sum()
    g_true = true_gradient(train_table, tokens, prev, rewards)
    true_norm = g_true.norm()
    # The yardstick for variances: plain on-policy REINFORCE (responses from pi_train itself,
    # baseline E_train[R]).
    g_on, _ = per_response_gradients(
        METHODS["naive"], train_table, train_lp, rewards - (p * rewards).sum(), tokens, prev
    )
    on_policy_variance = (p * g_on.square().sum(1)).sum() - (p @ g_on).square().sum()
    out = {
        "length": length,
        "kind": kind,
        "size": size,
        "true_grad_norm": float(true_norm),
        "on_policy_variance": float(on_policy_variance / true_norm**2),
        # KL(pi_rollout || pi_train) of whole responses
        "kl_seq": float((q * (q.log() - p.log())).sum()),
        # E_q[(p/q)^2] - 1: the variance factor of sequence IS
        "chi2_seq": float((p * p / q).sum() - 1.0),
        "expected_reward_train": float((p * rewards).sum()),
        "expected_reward_rollout": float((q * rewards).sum()),
        "methods": {},
    }
    for name in methods or METHODS:
        # (B, P)
        g, kept = per_response_gradients(
            METHODS[name], train_table, rollout_lp, advantages, tokens, prev
        )
        # A batch mean over the responses a method keeps (verl's agg_loss over the rejection mask)
        # estimates E_q[g | kept]: rejection renormalises. Without rejection kept = 1 and this is
        # E_q[g].
        kept_mass = float(q @ kept)
        q_kept = q * kept / max(kept_mass, 1e-300)
        mean = q_kept @ g
        second = (q_kept * g.square().sum(1)).sum()
        bias = (mean - g_true).norm() / true_norm
        variance = float((second - mean.square().sum()).clamp(min=0) / true_norm**2)
        out["methods"][name] = {
            "bias": float(bias),
            "cosine": float(torch.nn.functional.cosine_similarity(mean, g_true, dim=0)),
            "variance": variance,
            "variance_ratio": variance * float(true_norm**2 / on_policy_variance),
            "bias_abs": float(bias * true_norm),
            "kept": kept_mass,
            # a batch of N responses keeps about N * kept of them; nothing kept: no gradient, error
            # = ||grad J||
            "mse": float(bias**2 + variance / (args.batch_size * kept_mass))
            if kept_mass > 0
            else 1.0,
        }
    return out


# ---------------------------------------------------------------------------------------------------------------
# 3. The sweeps, the figures, the tables
# ---------------------------------------------------------------------------------------------------------------


def run(args):
    t0 = time.time()
    results = {
        "args": dataclasses.asdict(args),
        "noise": [],
        "temperature": [],
        "length": [],
        "table": [],
    }
    for size in args.noise_sizes:
        results["noise"].append(evaluate(args, args.length, "noise", size))
    for tau in args.temperatures:
        results["temperature"].append(evaluate(args, args.length, "temperature", tau))
    for length in range(1, args.max_length + 1):
        results["length"].append(evaluate(args, length, "noise", args.length_noise))
    for kind, size in [(k, None) for k in ROUNDINGS] + [
        ("temperature", 1.2),
        ("noise", 0.2),
        ("noise", 1.0),
        ("spike", None),
    ]:
        results["table"].append(evaluate(args, args.length, kind, size))
    results["seconds"] = round(time.time() - t0, 1)
    return results


def label(row):
    return row["kind"] if row["size"] is None else f"{row['kind']} {row['size']:g}"


def markdown_tables(results):
    rows = results["table"]
    lines = [
        "| perturbation (L = %d) | KL(rollout \\|\\| train), sequence | chi2, sequence | E_train[R] | E_rollout[R] |"
        % rows[0]["length"],
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {label(r)} | {r['kl_seq']:.2e} | {r['chi2_seq']:.2e} | {r['expected_reward_train']:.4f} | "
            f"{r['expected_reward_rollout']:.4f} |"
        )
    lines += [
        "",
        "relative bias ||E g - grad J|| / ||grad J|| (cosine in brackets):",
        "",
        "| method | " + " | ".join(label(r) for r in rows) + " |",
        "| --- |" + " --- |" * len(rows),
    ]
    for name in METHODS:
        cells = [
            f"{r['methods'][name]['bias']:.1e} ({r['methods'][name]['cosine']:.3f})" for r in rows
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "variance of one response's gradient / on-policy REINFORCE's (rollout mass kept):",
        "",
        "| method | " + " | ".join(label(r) for r in rows) + " |",
        "| --- |" + " --- |" * len(rows),
    ]
    for name in METHODS:
        cells = [
            f"{r['methods'][name]['variance_ratio']:.3g} ({r['methods'][name]['kept']:.2g})"
            for r in rows
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _curves(ax_row, points, x):
    """bias, variance ratio, mse of FIGURE_METHODS against x; a method that keeps nothing has no
    variance (NaN)."""
    for name in FIGURE_METHODS:
        m = [p["methods"][name] for p in points]
        c = COLORS[name]
        ax_row[0].plot(x, [max(v["bias"], BIAS_FLOOR) for v in m], "o-", color=c, label=name, ms=3)
        ax_row[1].plot(
            x, [v["variance_ratio"] if v["kept"] > 0 else math.nan for v in m], "o-", color=c, ms=3
        )
        ax_row[2].plot(x, [v["mse"] for v in m], "o-", color=c, ms=3)
    for ax in ax_row:
        ax.set_yscale("log")
        ax.grid(alpha=0.3)


def plot(args, results):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.join(ROOT, args.img_dir), exist_ok=True)
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    for row_axes, sweep, xlabel in (
        (axes[0], "noise", "logit noise std"),
        (axes[1], "temperature", "rollout temperature (trainer: 1)"),
    ):
        _curves(row_axes, results[sweep], [p["size"] for p in results[sweep]])
        row_axes[0].set(
            title=f"relative bias (floor {BIAS_FLOOR:g} = zero), L = {args.length}", xlabel=xlabel
        )
        row_axes[1].set(title="variance / on-policy REINFORCE variance", xlabel=xlabel)
        row_axes[2].set(title=f"relative MSE, batch of {args.batch_size}", xlabel=xlabel)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"Exact moments of the rollout-correction estimators (V = {args.vocab_size}, L = {args.length}, "
        f"every response enumerated)"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, args.img_dir, "estimator_lab_mismatch.png"), dpi=100)

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _curves(axes, results["length"], [p["length"] for p in results["length"]])
    axes[0].set(title=f"relative bias (floor {BIAS_FLOOR:g} = zero)", xlabel="response length L")
    axes[1].set(title="variance / on-policy REINFORCE variance", xlabel="response length L")
    axes[2].set(title=f"relative MSE, batch of {args.batch_size}", xlabel="response length L")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"The same estimators as the response grows (logit noise std {args.length_noise} per token)"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, args.img_dir, "estimator_lab_length.png"), dpi=100)


def main(args):
    torch.set_num_threads(1)  # tiny tensors; a second thread only spins on a shared machine
    results = run(args)
    with open(os.path.join(ROOT, args.out_json), "w") as f:
        json.dump(results, f, indent=1)
    plot(args, results)
    print(markdown_tables(results))
    print(f"\n{results['seconds']} s; wrote {args.out_json} and {args.img_dir}/estimator_lab_*.png")


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
