"""harness.py: the plumbing the three scripts share. The rerun rule (resume, or start afresh with the
earlier logs moved aside, never appended to) for grpo.py, ppo_rlhf.py and rewards.py; checkpoints that
restore every RNG of every rank (2 processes); metric reduction and gradient averaging across ranks;
the fail-fast hook. Budget: ~40 s on 2 cores (one torchrun start, six tiny runs)."""

import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
import lora  # noqa: E402
import memory  # noqa: E402
import rollout  # noqa: E402
import tools  # noqa: E402


def steps(path):
    return [json.loads(line)["step"] for line in open(path)]


# --------------------------------------------------------------------------------------------------
# the rerun rule, file by file
# --------------------------------------------------------------------------------------------------


def test_rows_after_a_checkpoint_move_to_discarded(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3)))
    harness.move_rows_after(str(path), 1)
    assert steps(path) == [0, 1]
    assert steps(str(path) + ".discarded") == [2, 3]
    harness.move_rows_after(str(path), 5)  # nothing after step 5: unchanged
    assert steps(path) == [0, 1]


def test_a_fresh_start_moves_the_earlier_logs_aside_and_keeps_models(tmp_path):
    for name in ("metrics.jsonl", "samples.jsonl", "args.json", "metrics.jsonl.discarded"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "reward_model").mkdir()  # a model a later run reuses stays where it is
    assert harness.move_previous_run_aside(str(tmp_path)) == str(tmp_path / "previous_run_1")
    assert sorted(os.listdir(tmp_path / "previous_run_1")) == [
        "args.json",
        "metrics.jsonl",
        "metrics.jsonl.discarded",
        "samples.jsonl",
    ]
    assert (tmp_path / "reward_model").is_dir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert harness.move_previous_run_aside(str(tmp_path)) == str(tmp_path / "previous_run_2")
    assert harness.move_previous_run_aside(str(tmp_path)) is None  # nothing left to move


@dataclasses.dataclass
class Settings:
    """A stand-in for a script's Args: the fields the harness reads."""

    output_dir: str
    seed: int = 1
    lr: float = 1e-3
    save_every: int = 1
    resume_from: str = None
    allow_changed_settings: bool = False
    track: bool = False


def write_checkpoint(settings, step):
    def write_files(folder):
        Path(folder, "model.bin").write_bytes(bytes(range(256)) * 4)

    harness.save_checkpoint(settings.output_dir, 0, write_files, {"step": step}, settings)


def test_checkpoints_are_verified_and_a_damaged_one_gives_way_to_checkpoint_old(tmp_path):
    settings = Settings(output_dir=str(tmp_path))
    assert harness.find_checkpoint(str(tmp_path)) is None  # nothing there: a fresh start
    write_checkpoint(settings, 1)
    path = str(tmp_path / "checkpoint")
    assert harness.checkpoint_problem(path) is None
    assert harness.find_checkpoint(str(tmp_path)) == path
    assert sorted(os.listdir(path)) == [
        "manifest.json",
        "model.bin",
        "rng_rank0.pt",
        "trainer_state.pt",
    ]
    assert harness.load_checkpoint(path, 0)["step"] == 1
    # the same size, other bytes: only the hash sees it
    shutil.copytree(path, path + ".old")
    Path(path, "model.bin").write_bytes(bytes(reversed(range(256))) * 4)
    assert "is damaged" in harness.checkpoint_problem(path)
    assert harness.find_checkpoint(str(tmp_path)) == path + ".old"  # a complete one beside it
    shutil.rmtree(path + ".old")
    with pytest.raises(harness.RunError, match="no complete checkpoint.old"):
        harness.find_checkpoint(str(tmp_path))  # never replaced by a fresh run
    with pytest.raises(harness.RunError, match="--resume-from"):
        harness.find_checkpoint(str(tmp_path), resume_from=path)


def test_resuming_with_other_settings_is_refused_but_logging_options_may_change(tmp_path):
    write_checkpoint(Settings(output_dir=str(tmp_path)), 3)
    same = Settings(output_dir=str(tmp_path), save_every=5, track=True)
    assert harness.checkpoint_to_resume(same) == str(tmp_path / "checkpoint")
    with pytest.raises(harness.RunError, match=r"--lr \(0.001 -> 0.01\), --seed \(1 -> 2\)"):
        harness.checkpoint_to_resume(Settings(output_dir=str(tmp_path), seed=2, lr=0.01))
    changed = Settings(output_dir=str(tmp_path), lr=0.01, allow_changed_settings=True)
    assert harness.checkpoint_to_resume(changed) == str(tmp_path / "checkpoint")
    assert harness.checkpoint_to_resume(Settings(output_dir=str(tmp_path), lr=0.01), ("lr",))


def test_run_log_writes_only_on_rank_0(tmp_path):
    quiet = harness.RunLog(str(tmp_path), enabled=False)
    quiet.metrics({"step": 1})
    quiet.samples([{"step": 1}])
    quiet.close()
    assert not os.listdir(tmp_path)
    log = harness.RunLog(str(tmp_path), enabled=True)
    log.metrics({"step": 1, "x": 0.5})
    log.samples([{"step": 1, "text": "a"}])
    log.close()
    assert steps(tmp_path / "metrics.jsonl") == [1] and steps(tmp_path / "samples.jsonl") == [1]


# --------------------------------------------------------------------------------------------------
# the rerun rule, script by script: a second run into a folder whose checkpoint is gone
# --------------------------------------------------------------------------------------------------


def grpo_run(output_dir):
    import grpo
    from test_grpo import _small_args

    args = _small_args(output_dir=str(output_dir), total_steps=2, train_size=16, val_size=4)
    grpo.train(dataclasses.replace(args, val_every=1, log_samples_every=1))


def ppo_rlhf_run(output_dir, reward_model_dir):
    import ppo_rlhf
    from test_ppo_rlhf import tiny_args

    args = tiny_args(
        reward_model_dir,
        output_dir,
        total_episodes=32,
        rollout_batch_size=16,
        local_micro_batch_size=16,
        noptepochs=1,
        log_samples_every=1,
    )
    ppo_rlhf.train(args)


def rewards_run(output_dir):
    import rewards

    args = dataclasses.replace(
        rewards.PRESETS["tiny"][1],
        output_dir=str(output_dir),
        num_train=32,
        num_test=8,
        normalize_samples=16,
        debug_normalize=0,
        rollout_batch_size=64,
        eval_every=1,
        kl_samples=0,
    )
    rewards.train(args)


@pytest.mark.parametrize("script", ["grpo", "ppo_rlhf", "rewards"])
def test_a_rerun_without_a_checkpoint_starts_afresh_and_moves_the_logs_aside(
    script, tmp_path, tiny_assets
):
    """The first run's checkpoint is gone (or was never written: a run killed before its first
    save): the second run starts from step 1 again, its metrics.jsonl has each step once, and the
    first run's metrics.jsonl, samples.jsonl and args.json are in previous_run_1/, whole."""
    out = tmp_path / script

    def run():
        if script == "grpo":
            grpo_run(out)
        elif script == "ppo_rlhf":
            ppo_rlhf_run(out, tiny_assets)
        else:
            rewards_run(out)

    run()
    first = steps(out / "metrics.jsonl")
    if script != "rewards":  # (rewards.py logs the normalisations as extra rows of a step)
        assert len(first) == len(set(first)) >= 2
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    run()
    assert steps(out / "metrics.jsonl") == first
    assert steps(out / "previous_run_1" / "metrics.jsonl") == first
    assert json.load(open(out / "previous_run_1" / "args.json"))["script"] == script
    assert json.load(open(out / "args.json"))["script"] == script
    if script != "rewards":  # (rewards.py logs no samples)
        assert steps(out / "samples.jsonl") == steps(out / "previous_run_1" / "samples.jsonl")


# --------------------------------------------------------------------------------------------------
# two processes: reduction, gradient averaging, checkpoints with every rank's RNG
# --------------------------------------------------------------------------------------------------


def test_two_ranks_reduce_average_and_resume_every_rng(tmp_path):
    """Rank r's metrics reduce to the mean (max / min / sum by name), gradients to their mean, the
    checksum spread is 0 for identical parameters and not otherwise; after a checkpoint each rank
    draws the same numbers from python, numpy, torch (and CUDA, where present) as after reloading
    it, and its own: the ranks' streams differ."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "tests" / "harness_ranks.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for report in reports:
        assert report["reduced"] == {"loss": 0.5, "ratio_max": 1.0, "ratio_min": 0.0, "count": 2.0}
        assert report["gradient"] == [[1.5, 1.5]]
        assert report["spread_equal"] == 0.0 and report["spread_different"] > 0
        assert report["state_step"] == 3
        assert report["after_load"] == report["after_save"]
        assert {"rng_rank0.pt", "rng_rank1.pt", "trainer_state.pt", "model.txt"} <= set(
            report["files"]
        )
    assert reports[0]["after_save"] != reports[1]["after_save"]


def test_one_optimizer_step_applies_clips_and_refuses_a_non_finite_norm():
    """harness.OptimizerStep, the one step both trainers' update_policy take per minibatch: without
    clipping (ppo_rlhf.py, as OpenAI) the optimizer applies the gradient backward() left, whole; with
    max_grad_norm it applies the gradient scaled to that norm and reports the norm before clipping;
    a non-finite norm ends the run in one line naming the step before anything changes; the
    gradients are zeroed after each step."""
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.SGD([weight], lr=1.0)

    def backward_and_step(stepper, gradient, step=1):
        stepper.backward((weight * gradient).sum())  # d loss / d weight = gradient
        return stepper.apply(step)

    unclipped = harness.OptimizerStep(optimizer)
    assert backward_and_step(unclipped, torch.tensor([3.0, 4.0])) == {}
    assert weight.tolist() == [-2.0, -2.0] and weight.grad is None
    clipped = harness.OptimizerStep(optimizer, max_grad_norm=1.0)
    metrics = backward_and_step(clipped, torch.tensor([3.0, 4.0]))  # norm 5, scaled by 1 / 5
    assert metrics == {"grad_norm": 5.0}
    assert torch.allclose(weight.detach(), torch.tensor([-2.6, -2.8]))
    with pytest.raises(harness.RunError, match="step 7"):
        backward_and_step(clipped, torch.tensor([float("inf"), 1.0]), step=7)
    assert torch.allclose(weight.detach(), torch.tensor([-2.6, -2.8]))  # not applied


@pytest.mark.parametrize("script", ["grpo", "ppo_rlhf"])
def test_help_lists_every_flag_with_the_algorithm_s_first(script):
    """Both trainers' Args take the flags of the rooms that read them as mixins (rollout.py's engine
    and asynchrony flags, memory.py's, lora.py's, harness.py's run flags), flat: `--help` lists
    every field of Args as its flag, the algorithm's own first (GRPOArgs / PPOArgs), then the run's,
    then each room's in turn."""
    module = importlib.import_module(script)
    env = dict(os.environ, COLUMNS="200")
    result = subprocess.run(
        [sys.executable, f"{script}.py", "tiny", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # each option's own line starts with its flag: "│ --rollout-n INT  ..."
    lines = [line for line in result.stdout.splitlines() if line.startswith("│ --")]
    listed = [line.split()[1].rstrip(",") for line in lines if not line.startswith("│ --help")]
    fields = [f.name for f in dataclasses.fields(module.Args)]
    assert listed == ["--" + name.replace("_", "-") for name in fields]
    own = module.GRPOArgs if script == "grpo" else module.PPOArgs
    first = [f.name for f in dataclasses.fields(own)]
    assert fields[: len(first)] == first
    rooms = [harness.RunArgs, harness.CheckpointedRunArgs]
    if script == "grpo":
        rooms += [rollout.EngineArgs, tools.ToolArgs, rollout.AsyncArgs, memory.MemoryArgs]
    rooms += [lora.LoraArgs]
    position = len(first)
    for room in rooms:
        names = [f.name for f in dataclasses.fields(room) if f.name not in fields[:position]]
        assert fields[position : position + len(names)] == names, room.__name__
        position += len(names)
    assert position == len(fields)


def test_fail_fast_excepthook_ends_the_process_at_once():
    """Under torchrun (setup_distributed installs it) an uncaught error ends the rank without
    waiting for anything: the traceback is printed and os._exit(1) skips atexit handlers (a process
    group's shutdown would block there)."""
    code = (
        "import atexit, sys, harness; atexit.register(print, 'atexit ran'); "
        "sys.excepthook = harness.fail_fast_excepthook; raise RuntimeError('boom')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr and "atexit ran" not in proc.stdout


def test_args_json_records_the_environment_the_run_ran_on(tmp_path):
    """args.json holds run_environment(): the commit (with "+dirty" when tracked files differ from
    it), the versions, torch's CPU kernel set and the GPU, so two tables can say whether their runs
    could be bit-identical."""

    @dataclasses.dataclass
    class Args:
        output_dir: str
        seed: int = 1
        track: bool = False

    log = harness.start_logs(Args(str(tmp_path)), "grpo", rank=0, world_size=1)
    log.close()
    written = json.load(open(tmp_path / "args.json"))
    assert written["script"] == "grpo" and written["seed"] == 1
    environment = written["environment"]
    assert environment["torch"] == torch.__version__
    assert environment["transformers"] == transformers.__version__
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert (environment["vllm"] is not None) == has_vllm
    assert environment["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert environment["cuda_device"] is None or torch.cuda.is_available()
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:  # a copy of the tree without .git
        assert environment["git_commit"] is None
        return
    status = subprocess.run(
        git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    dirty = "+dirty" if status.stdout.strip() else ""
    assert environment["git_commit"] == head.stdout.strip() + dirty
