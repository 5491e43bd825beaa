"""A run is never lost and never silently wrong: every broken file, full disk or bad value ends in one
line naming the cause (no traceback), before any training step, and what was on disk is kept.

One row of the fault table per test, on the tiny presets: grpo.py's and ppo_rlhf.py's checkpoints are
built once per test session (two short runs) and each test breaks a copy. The scripts run in this
process through their main(argv), as on the command line; the SIGKILL and torchrun tests run them as
processes. Budget: ~60 s on 2 cores.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpo  # noqa: E402
import harness  # noqa: E402
import ppo_rlhf  # noqa: E402
import rewards  # noqa: E402
import tasks  # noqa: E402


def grpo_argv(output_dir, steps=2, *extra, save_every=1):
    """grpo.py tiny, small and fast: a checkpoint every `save_every` steps, samples every step."""
    return [
        "tiny",
        "--output-dir",
        str(output_dir),
        "--total-steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--train-size",
        "64",
        "--val-every",
        "0",
        "--log-samples-every",
        "1",
        *extra,
    ]


def ppo_argv(output_dir, assets, updates=2, *extra):
    return [
        "tiny",
        "--output-dir",
        str(output_dir),
        "--reward-model-path",
        str(assets / "reward_model"),
        "--total-episodes",
        str(32 * updates),
        "--rollout-batch-size",
        "32",
        "--local-micro-batch-size",
        "32",
        "--noptepochs",
        "1",
        "--save-every",
        "1",
        "--no-cuda",
        *extra,
    ]


def run_main(main, argv, capfd):
    """(exit code, stderr) of SCRIPT.main(argv), in this process."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capfd.readouterr().err


def error_lines(stderr):
    return [line for line in stderr.splitlines() if ": error: " in line]


def assert_one_line(stderr, *words):
    """Exactly one error line, naming every word, and no traceback."""
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def steps(path):
    return [json.loads(line)["step"] for line in open(path)]


@pytest.fixture(scope="session")
def grpo_done(tmp_path_factory):
    """A finished grpo.py tiny run of 2 steps with a checkpoint after each."""
    out = tmp_path_factory.mktemp("faults") / "grpo"
    grpo.main(grpo_argv(out))
    return out


@pytest.fixture(scope="session")
def ppo_done(tmp_path_factory, tiny_assets):
    """A finished ppo_rlhf.py tiny run of 2 updates with a checkpoint after each."""
    out = tmp_path_factory.mktemp("faults") / "ppo"
    ppo_rlhf.main(ppo_argv(out, tiny_assets))
    return out


def copy_of(run, tmp_path):
    target = tmp_path / run.name
    shutil.copytree(run, target)
    return target


# --------------------------------------------------------------------------------------------------
# logs cut short
# --------------------------------------------------------------------------------------------------


def test_a_partial_last_line_is_moved_aside_and_the_run_resumes(grpo_done, tmp_path, capfd):
    """What a kill or a full disk leaves: the line moves to metrics.jsonl.discarded with a notice,
    and the run resumes from its checkpoint (it used to exit with a JSONDecodeError)."""
    out = copy_of(grpo_done, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "pro')
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0, stderr[-2000:]
    assert "1 line(s) cut short moved to" in stderr
    assert steps(out / "metrics.jsonl") == [1, 2, 3]
    assert open(out / "metrics.jsonl.discarded").read() == '{"step": 3, "reward/me\n'
    assert open(out / "samples.jsonl.discarded").read() == '{"step": 3, "pro\n'


def test_no_checkpoint_and_a_partial_line_start_afresh_with_the_old_logs_kept(
    ppo_done, tiny_assets, tmp_path, capfd
):
    """ppo_rlhf.py restarted before its first checkpoint, the killed run's last line cut short: the
    new run starts at update 1 in a clean metrics.jsonl; the old file moves aside as it was."""
    out = copy_of(ppo_done, tmp_path)
    shutil.rmtree(out / "checkpoint")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "objective/kl": 0.1')
    before = open(out / "metrics.jsonl").read()
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets), capfd)
    assert code == 0, stderr[-2000:]
    assert steps(out / "metrics.jsonl") == [1, 2]
    assert open(out / "previous_run_1" / "metrics.jsonl").read() == before


# --------------------------------------------------------------------------------------------------
# broken checkpoints: one line naming the file, before anything loads; nothing replaced
# --------------------------------------------------------------------------------------------------


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def overwrite_the_end(path):
    """Random bytes over the file's last 64 bytes: its size stays the same."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 64)
        f.write(os.urandom(64))


BREAKS = {
    "model.safetensors truncated": ("model.safetensors", truncate, "bytes, the manifest says"),
    "model.safetensors deleted": ("model.safetensors", os.remove, "is missing"),
    "config.json deleted": ("config.json", os.remove, "is missing"),
    "trainer_state.pt truncated": ("trainer_state.pt", truncate, "bytes, the manifest says"),
    "trainer_state.pt deleted": ("trainer_state.pt", os.remove, "is missing"),
    "model.safetensors overwritten": ("model.safetensors", overwrite_the_end, "is damaged"),
    "manifest.json deleted": ("manifest.json", os.remove, "manifest.json is missing"),
}


@pytest.mark.parametrize("fault", sorted(BREAKS))
def test_a_broken_grpo_checkpoint_ends_in_one_line(fault, grpo_done, tmp_path, capfd):
    name, damage, says = BREAKS[fault]
    out = copy_of(grpo_done, tmp_path)
    damage(out / "checkpoint" / name)
    files = sorted(os.listdir(out / "checkpoint"))
    metrics = open(out / "metrics.jsonl").read()
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, name, says, "move")
    assert "Loading weights" not in stderr  # refused before any model loads
    # nothing replaced: the checkpoint and the logs are as they were, no fresh run started
    assert sorted(os.listdir(out / "checkpoint")) == files
    assert open(out / "metrics.jsonl").read() == metrics
    assert not (out / "previous_run_1").exists()


@pytest.mark.parametrize("name", ["value_head.pt", "rng_rank0.pt"])
def test_a_ppo_checkpoint_missing_a_file_ends_in_one_line(
    name, ppo_done, tiny_assets, tmp_path, capfd
):
    out = copy_of(ppo_done, tmp_path)
    os.remove(out / "checkpoint" / name)
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 2), capfd)
    assert code == 1
    assert_one_line(stderr, name, "is missing")


def test_a_damaged_checkpoint_resumes_from_a_complete_checkpoint_old(grpo_done, tmp_path, capfd):
    """Where checkpoint.old is complete (a crash during the swap leaves both), a damaged checkpoint
    gives way to it, with a notice."""
    out = copy_of(grpo_done, tmp_path)
    shutil.copytree(out / "checkpoint", out / "checkpoint.old")
    overwrite_the_end(out / "checkpoint" / "model.safetensors")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0, stderr[-2000:]
    assert "is damaged" in stderr and "resuming from" in stderr and "checkpoint.old" in stderr
    assert steps(out / "metrics.jsonl") == [1, 2, 3]
    assert harness.checkpoint_problem(str(out / "checkpoint")) is None  # the new one is whole


# --------------------------------------------------------------------------------------------------
# bad values and changed settings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_flags_are_refused_before_any_model_loads(value, tmp_path, capfd):
    for main, name in ((grpo.main, "grpo.py"), (ppo_rlhf.main, "ppo_rlhf.py")):
        code, stderr = run_main(main, ["tiny", "--output-dir", str(tmp_path), "--lr", value], capfd)
        assert code == 2
        assert_one_line(stderr, f"{name}: error: --lr must be a finite number")
    argv = ["tiny", "--output-dir", str(tmp_path), "--temperature", value]
    code, stderr = run_main(rewards.main, argv, capfd)
    assert code == 2
    assert_one_line(stderr, "--temperature must be a finite number")


def test_resuming_with_other_settings_is_refused_unless_asked(grpo_done, tmp_path, capfd):
    out = copy_of(grpo_done, tmp_path)
    args_json = open(out / "args.json").read()
    code, stderr = run_main(grpo.main, grpo_argv(out, 2, "--seed", "2", "--lr", "0.01"), capfd)
    assert code == 1
    assert_one_line(stderr, "--lr (0.001 -> 0.01)", "--seed (1 -> 2)", "--allow-changed-settings")
    assert open(out / "args.json").read() == args_json  # it describes the steps that were run
    # settings that cannot change the experiment may change; more steps under a constant lr too
    code, stderr = run_main(grpo.main, grpo_argv(out, 3, "--torch-threads", "1"), capfd)
    assert code == 0, stderr[-2000:]
    # asked for: the change is printed and the run resumes
    argv = grpo_argv(out, 4, "--lr", "0.002", "--allow-changed-settings")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 0 and "changed settings: --lr (0.001 -> 0.002)" in stderr


def test_total_episodes_cannot_change_when_the_lr_schedule_depends_on_them(
    ppo_done, tiny_assets, tmp_path, capfd
):
    """ppo_rlhf.py anneals the lr to 0 over all the updates: more episodes change every step's lr."""
    out = copy_of(ppo_done, tmp_path)
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "--total-episodes (64 -> 96)")


def test_track_without_a_wandb_login_is_refused_and_offline_logs_in_the_output_dir(
    tmp_path, capfd, monkeypatch
):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "empty_netrc"))
    (tmp_path / "empty_netrc").write_text("")
    out = tmp_path / "tracked"
    code, stderr = run_main(grpo.main, grpo_argv(out, 1, "--track"), capfd)
    assert code == 2
    assert_one_line(stderr, "--track", "wandb login", "WANDB_MODE=offline")
    assert not (out / "tiny_model").exists()  # refused before any model was built
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, stderr = run_main(grpo.main, grpo_argv(out, 1, "--track"), capfd)
    assert code == 0, stderr[-2000:]
    assert (out / "wandb").is_dir() and not (ROOT / "wandb").exists()


# --------------------------------------------------------------------------------------------------
# failing writes: a full disk, an interrupted reward-model save, one rank of two
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, grpo_done):
    """A folder on a filesystem that holds the tiny model and one checkpoint and a half: the second
    checkpoint write runs out of space. A real tmpfs where the platform allows mounting one (root);
    else None (the test simulates the failing write)."""
    checkpoint = sum(f.stat().st_size for f in (grpo_done / "checkpoint").iterdir())
    model = sum(f.stat().st_size for f in (grpo_done / "tiny_model").iterdir())
    size = model + checkpoint * 3 // 2 + 256 * 1024
    mount = tmp_path / "small_disk"
    mount.mkdir()
    if os.geteuid() != 0:
        yield None
        return
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
    if subprocess.run(command, capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_during_a_checkpoint_ends_in_one_line_and_keeps_the_last_one(
    small_disk, tmp_path, capfd, monkeypatch
):
    if small_disk is None:  # no mount here: the same write fails in simulation
        out = tmp_path / "run"
        real_save = torch.save

        def save_until_full(obj, f, *args, **kwargs):
            if str(f).endswith("trainer_state.pt") and "checkpoint.tmp" in str(f):
                if save_until_full.calls:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                save_until_full.calls += 1
            return real_save(obj, f, *args, **kwargs)

        save_until_full.calls = 0
        monkeypatch.setattr(torch, "save", save_until_full)
    else:
        out = small_disk / "run"
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "No space left on device", "checkpoint.tmp")
    assert not (out / "checkpoint.tmp").exists()  # the partial checkpoint was removed
    assert harness.checkpoint_problem(str(out / "checkpoint")) is None  # the last one is whole
    assert json.load(open(out / "checkpoint" / harness.MANIFEST))["step"] == 1
    assert steps(out / "metrics.jsonl") == [1, 2]  # every complete line kept


def test_a_failed_append_is_cut_back_to_the_last_complete_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    harness.append_line(str(path), '{"step": 1}\n')
    real_write = os.write

    def write_half(fd, data):  # the disk fills halfway through the line
        if len(data) > 4:
            real_write(fd, bytes(data[:4]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_half)
    with pytest.raises(harness.RunError, match="No space left on device"):
        harness.append_line(str(path), '{"step": 2, "x": 1.0}\n')
    assert path.read_text() == '{"step": 1}\n'


def test_an_interrupted_reward_model_save_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    model, tokenizer = tasks.build_tiny_model(None, arch="gpt2")
    reward_model = rewards.RewardModel(model)
    path = tmp_path / "reward_model"
    rewards.save_reward_model(reward_model, str(path), tokenizer)
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", fail)
    with torch.no_grad():
        reward_model.reward_bias.fill_(5.0)
    with pytest.raises(harness.RunError, match="No space left on device"):
        rewards.save_reward_model(reward_model, str(path), tokenizer)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert not (tmp_path / "reward_model.tmp").exists()


def test_torchrun_a_failed_write_on_one_rank_ends_both_in_one_line(tmp_path):
    """Rank 1 cannot write its RNG file into checkpoint.tmp (simulated: no space) while rank 0 waits
    at the barrier that follows: both ranks end in seconds, each with one error line, and rank 0
    removes the partial checkpoint."""
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    sizes = ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "4"]
    cmd = [
        *torchrun,
        "2",
        str(ROOT / "tests" / "fail_rank1_write.py"),
        *grpo_argv(out, 2),
        *sizes,
        "--ppo-micro-batch-size-per-gpu",
        "4",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if ".py: error:" in line]
    assert len(ours) == 2, result.stderr[-3000:]
    assert any("No space left on device" in line and "checkpoint.tmp" in line for line in ours)
    assert any("another rank stopped" in line for line in ours)
    assert not (out / "checkpoint.tmp").exists()
    assert time.time() - start < 120


# --------------------------------------------------------------------------------------------------
# a run killed with SIGKILL resumes exactly
# --------------------------------------------------------------------------------------------------


def rows_without_clocks(path):
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(("timing/", "time/"))}
        for line in open(path)
    ]


def test_a_run_killed_with_sigkill_resumes_to_the_same_metrics_and_weights(tmp_path):
    def command(output_dir):
        return [sys.executable, "grpo.py", *grpo_argv(output_dir, 8, save_every=2)]

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    uninterrupted = tmp_path / "uninterrupted"
    subprocess.run(
        command(uninterrupted), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300
    )
    process = subprocess.Popen(
        command(tmp_path / "killed"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it after step 5: its checkpoint is step 4's
        if metrics.exists() and len(open(metrics).read().splitlines()) >= 5:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(open(metrics).read().splitlines()) < 8
    subprocess.run(
        command(tmp_path / "killed"),
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert rows_without_clocks(metrics) == rows_without_clocks(uninterrupted / "metrics.jsonl")
    from safetensors.torch import load_file

    ours = load_file(tmp_path / "killed" / "checkpoint" / "model.safetensors")
    theirs = load_file(uninterrupted / "checkpoint" / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
