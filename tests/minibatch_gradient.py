"""One GRPO minibatch's gradient, for the loss-normalisation invariance tests (tests/test_grpo.py).

    python tests/minibatch_gradient.py OUT.pt MICRO MODE [MODE ...]                  # one process: all 64 rows
    torchrun --nproc_per_node 2 tests/minibatch_gradient.py OUT.pt MICRO MODE ...   # rank r takes rows r*32..

A fixed tiny model and a fixed batch of 64 sequences (8 prompts x n = 8, responses of 1..8 tokens)
make one minibatch; grpo.update_policy runs it with an optimizer stand-in that records the
(averaged, unclipped) gradient at step(). Rank 0 saves {mode: flat gradient}. Not a test file itself
(no test_ prefix). pi_old_and_ref is grpo.train()'s step 3 on a batch, for the tests that run
update_policy themselves (tests/test_grpo.py).
"""

import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import corrections  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

PROMPTS, N, R = 8, 8, 8


class GradientRecorder:
    """Stands in for the optimizer: step() records the gradient instead of changing the weights."""

    def __init__(self, params):
        self.params = list(params)
        self.param_groups, self.gradient = [{"params": self.params, "lr": 0.0}], None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.gradient = torch.cat([p.grad.reshape(-1) for p in self.params]).clone()


def fixed_batch(model, tokenizer):
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 40, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 6, (PROMPTS,), generator=g)
    ]
    responses = [
        torch.randint(3, 40, (int(k),), generator=g).tolist()
        for k in torch.randint(1, R + 1, (PROMPTS * N,), generator=g)
    ]
    batch = rollout.make_batch(
        [p for p in prompts for _ in range(N)],
        responses,
        [[0.0] * len(r) for r in responses],
        tokenizer.pad_token_id,
        R,
        torch.device("cpu"),
    )
    with torch.no_grad():
        lp, _ = logprobs.response_logprobs(model, batch, logprobs.LogprobSettings())
    batch["rollout_logprobs"] = (lp + 0.05 * torch.randn(lp.shape, generator=g)) * batch[
        "response_mask"
    ]
    batch["advantages"] = torch.randn(PROMPTS * N, generator=g)
    return batch


def pi_old_and_ref(model, ref_model, batch, args, correction, world_size=1):
    """grpo.train()'s step 3 on `batch`, in place: pi_old (grpo.compute_pi_old), the rollout
    correction's IS weights and loss mask (decoupled mode), pi_ref's logprobs when `ref_model` is
    given. Returns the step's metrics (the correction's, actor/entropy)."""
    log_pi = grpo.logprob_settings(args, model)
    old_logprobs, _, corr_metrics = grpo.compute_pi_old(
        model, batch, args, log_pi, correction, world_size
    )
    is_weights, loss_mask = None, batch["response_mask"]
    if not correction.bypass_mode:
        is_weights, loss_mask, batch_corr_metrics = corrections.apply_rollout_correction(
            old_logprobs, batch["rollout_logprobs"], batch["response_mask"], correction
        )
        corr_metrics.update(batch_corr_metrics)
    batch["old_logprobs"] = old_logprobs
    batch["loss_mask"] = loss_mask
    if is_weights is not None:
        batch["is_weights"] = is_weights
    if ref_model is not None:
        batch["ref_logprobs"] = grpo.batch_logprobs(ref_model, batch, args, log_pi)["logprobs"]
    return corr_metrics


def minibatch_gradient(micro, mode, rank=0, world_size=1, policy_loss="vanilla", **settings):
    """The gradient of the one minibatch (all 64 sequences over all ranks) with micro-batch size
    `micro`; `settings` override grpo.py flags."""
    model, tokenizer = tasks.build_tiny_model(None, arch="qwen2")
    batch = fixed_batch(model, tokenizer)
    rows = slice(rank * PROMPTS * N // world_size, (rank + 1) * PROMPTS * N // world_size)
    batch = {k: v[rows] for k, v in batch.items()}
    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        train_batch_size=PROMPTS,
        ppo_mini_batch_size=PROMPTS,
        rollout_n=N,
        max_response_length=R,
        ppo_micro_batch_size_per_gpu=micro,
        max_grad_norm=1e30,
        loss_agg_mode=mode,
        policy_loss=policy_loss,
        entropy_coeff=0.01,
        dro_beta=0.1,
        **settings,
    )
    correction = corrections.RolloutCorrection.from_name("decoupled_token_is")
    pi_old_and_ref(model, None, batch, args, correction)
    recorder = GradientRecorder(model.parameters())
    grpo.update_policy(
        model, recorder, batch, args, correction, grpo.logprob_settings(args, model), world_size
    )
    return recorder.gradient


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    out, micro, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        dist.init_process_group("gloo")
    grads = {mode: minibatch_gradient(micro, mode, rank, world_size) for mode in modes}
    if rank == 0:
        torch.save(grads, out)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
        # a rank's interpreter shutdown aborted in 1 of 4 runs ("terminate called without an
        # active exception", torch 2.13 gloo; 1 of 20 even after the barrier): all is written by
        # now, so leave without the shutdown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
