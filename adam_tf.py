"""
TF1-style Adam (`tf.compat.v1.train.AdamOptimizer`) as a standalone torch.optim.Optimizer.

Why it exists: OpenAI's lm-human-preferences trained with TF1's Adam, and PyTorch's Adam with the
same `eps` is NOT the same optimizer. See "The N Implementation Details of RLHF with PPO" (Huang et
al., 2023, Hugging Face blog), section "PyTorch Adam optimizer numerical issues w.r.t RLHF" (the
Adam optimizer's epsilon detail).

TF1's update (the formula just before section 2.1 of Kingma & Ba, arXiv:1412.6980; eps here is their
eps_hat):

    m_t   = b1 * m_{t-1} + (1 - b1) * g
    v_t   = b2 * v_{t-1} + (1 - b2) * g^2
    lr_t  = lr * sqrt(1 - b2^t) / (1 - b1^t)
    theta = theta - lr_t * m_t / (sqrt(v_t) + eps_hat)

PyTorch's Adam (Algorithm 1 of the paper) puts eps on the bias-corrected sqrt(v) instead:

    theta = theta - lr / (1 - b1^t) * m_t / (sqrt(v_t) / sqrt(1 - b2^t) + eps)
          = theta - lr_t * m_t / (sqrt(v_t) + eps * sqrt(1 - b2^t))

(multiplying top and bottom by sqrt(1 - b2^t))

So in TF's parameterisation PyTorch's effective epsilon is eps * sqrt(1 - b2^t), not eps. Early in
training this is much smaller: at t=1 with b2=0.999 it is eps * sqrt(0.001) = eps * 0.0316, i.e.
31.6x smaller. Where |g| is comparable to eps (many weights of an LM get gradients that small), the
denominator is smaller and PyTorch takes larger steps. As t grows, sqrt(1 - b2^t) -> 1 (0.80 at
t=1000, 0.99998 at t=10000) and the two optimizers become the same. The blog measured the
consequence on gpt2 after the first PPO epochs: approxkl 0.00037 (TF1 Adam) vs 0.00237 (PyTorch
Adam), ratio_max 1.23 vs 1.81. `scripts/adam_experiment.py` reruns that comparison on a tiny model.

Equivalently: torch.optim.Adam reproduces this optimizer if you set its eps to eps_hat / sqrt(1 -
b2^t) before step t, so that eps * sqrt(1 - b2^t) = eps_hat (tests/test_adam_tf.py checks exactly
that).

step() uses that identity: TF1's formula above, computed by torch's fused Adam kernel
(torch.optim.adam.adam, fused=True) with eps = eps_hat / sqrt(1 - b2^t); one pass over theta, g, m
and v instead of the six of separate lerp, mul, addcmul, sqrt, add and addcdiv ops (0.14 s against
1.03 s per step for SmolLM2-135M on 2 CPU cores, bench/bench_ppo_cpu.py). The result differs from
the explicit formula by float rounding only (tests/test_adam_tf.py checks it to 1e-12 in float64).
Unlike the lm-human-preference-details version this uses only public torch API (no
torch.optim._functional, no _get_value): the functional `adam` is in torch.optim.adam's __all__,
fused on CPU since torch 2.4 (tests run on torch 2.13; the GPU machine has 2.11).
"""

import math

import torch
from torch.optim.adam import adam as adam_functional  # torch.optim.Adam.step without the class


class AdamTF(torch.optim.Optimizer):
    """Adam with TF1's epsilon placement: theta -= lr_t * m_t / (sqrt(v_t) + eps), lr_t =
    lr*sqrt(1-b2^t)/(1-b1^t).

    Per-parameter state: `step` (int, number of updates so far), `exp_avg` (m), `exp_avg_sq` (v).
    Defaults match TF1 except eps: TF1's default epsilon is 1e-8; OpenAI's lm-human-preferences used
    1e-5 (lm_human_preferences/utils/core.py, minimize: tf.train.AdamOptimizer(learning_rate=lr,
    epsilon=1e-5)).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-5):
        # `not 0.0 <= x` is also True for NaN, so NaN is rejected too
        if not 0.0 <= lr:
            raise ValueError(f"AdamTF: invalid learning rate lr={lr}, must be >= 0")
        if len(betas) != 2:
            raise ValueError(f"AdamTF: betas must be a pair (beta1, beta2), got {betas}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"AdamTF: invalid beta{i + 1}={beta}, must be in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"AdamTF: invalid eps={eps}, must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # t -> the parameters taking their t-th step (one t unless some grads were None)
            by_step = {}
            for p in group["params"]:
                if p.grad is None:
                    # frozen or unused parameter: no update, no state (like torch.optim.Adam)
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamTF does not support sparse gradients")
                if torch.is_complex(p):
                    raise RuntimeError("AdamTF does not support complex parameters")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                by_step.setdefault(state["step"], []).append(p)

            for t, params in by_step.items():
                # m_t = b1 m + (1 - b1) g, v_t = b2 v + (1 - b2) g^2, theta -= lr_t m_t / (sqrt(v_t)
                # + eps_hat): by the identity in the module docstring, torch's Adam step t with eps
                # = eps_hat / sqrt(1 - b2^t)
                eps_torch = group["eps"] / math.sqrt(1 - beta2**t)
                adam_functional(
                    params,
                    [p.grad for p in params],
                    [self.state[p]["exp_avg"] for p in params],
                    [self.state[p]["exp_avg_sq"] for p in params],
                    [],
                    # the kernel adds 1 first
                    [p.new_full((), t - 1.0, dtype=torch.float32) for p in params],
                    fused=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=0.0,
                    eps=eps_torch,
                    maximize=False,
                )

        return loss
