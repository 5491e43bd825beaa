"""scripts/mismatch_experiment.py: every arm it can run is a grpo.py command that parses, passes
grpo.check_args and sets what the arm's name says (the lab's runs take hours; a wrong flag would
only show in its table)."""

import os
import sys

import pytest

import grpo
import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import mismatch_experiment as lab  # noqa: E402


def parsed(arm, tmp_path):
    """The grpo Args of the arm's command, as grpo.py's main() would build them."""
    command = lab.command(arm, 3, str(tmp_path / "run"))
    assert command[1].endswith("grpo.py")
    return harness.parse_args("grpo.py", grpo.PRESETS, grpo.check_args, command[2:])


@pytest.mark.parametrize("arm", lab.DEFAULT_ARMS + lab.LORA_ARMS + lab.ASYNC_ARMS)
def test_every_arm_is_the_grpo_run_its_name_says(arm, tmp_path):
    args = parsed(arm, tmp_path)
    source, remedy = lab.parse_arm(arm)
    assert args.seed == 3 and args.output_dir == str(tmp_path / "run")
    assert args.rollout_staleness == {"lag1": 1, "lag2": 2, "lag4": 4}.get(source, 0)
    assert args.async_rollouts == (source in lab.ASYNC_SOURCES)
    assert args.in_flight_updates == (source == "inflight")
    if args.async_rollouts:
        assert args.max_staleness == (4 if source == "async4" else 1)
    assert args.lora_rank == (8 if source in lab.LORA_SOURCES else 0)
    mismatch = {"int8": "int8", "lora_bf16": "bf16"}
    assert args.mismatch == mismatch.get(source, "none")
    assert args.top_p == (0.8 if source == "top_p" else 1.0)
    assert args.top_k == (5 if source == "top_k" else 0)
    if source in lab.TRUNCATION_SOURCES:
        # the trainer scores over the kept set only when the remedy is replay
        assert args.replay_sampling_mask == (remedy == "replay")
    corrections = {
        "token_tis": "decoupled_token_is",
        "seq_mis": "decoupled_seq_is_rs",
        "icepop": "decoupled_token_icepop",
        "bypass": "bypass_ppo_clip",
    }
    assert args.correction == corrections.get(remedy, "disabled")
    assert args.off_policy_mask_threshold == (0.5 if remedy == "offpolicy_mask" else None)
    # everything else is the preset's
    preset = grpo.PRESETS["tiny_lora" if source in lab.LORA_SOURCES else "tiny"][1]
    for field in ("total_steps", "rollout_n", "train_batch_size", "lr", "tiny_arch", "backend"):
        assert getattr(args, field) == getattr(preset, field), field


def test_arms_the_lab_refuses():
    with pytest.raises(SystemExit, match="replay removes truncated sampling only"):
        lab.parse_arm("lag4/replay")
    with pytest.raises(SystemExit, match="sources: none, lag1"):
        lab.parse_arm("lag3/naive")
    with pytest.raises(SystemExit, match="remedies: naive, replay"):
        lab.parse_arm("int8/tis")
