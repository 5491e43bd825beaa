"""A run is never lost and never silently wrong: every broken file, full disk or bad value ends in one
line naming the cause (no traceback), before any training step, and what was on disk is kept.

One row of the fault table per test, on the tiny presets: grpo.py's and ppo_rlhf.py's checkpoints are
built once per test session (two short runs) and each test breaks a copy. The scripts run in this
process through their main(argv), as on the command line; the SIGKILL and torchrun tests run them as
processes. Budget: ~60 s on 2 cores.
"""

import contextlib
import copy
import dataclasses
import errno
import json
import os
import random
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


def test_prompts_all_overlong_are_one_line_naming_the_flag(tmp_path, capfd):
    """A --max-prompt-length that drops (verl's filter_overlong_prompts) so many prompts that no
    batch of --train-batch-size is left ends in one line naming both flags, not in a traceback
    from the data order."""
    argv = grpo_argv(tmp_path / "out", 2, "--task", "arith", "--max-prompt-length", "8")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 1
    assert_one_line(
        stderr, "0 of the 64 training prompts fit --max-prompt-length 8", "--train-batch-size"
    )


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
            path = str(getattr(f, "name", f))  # harness.save_plain passes a file object
            if path.endswith("trainer_state.pt") and "checkpoint.tmp" in path:
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


def test_a_run_killed_with_sigkill_resumes_to_the_same_metrics_and_weights(
    grpo_uninterrupted, tmp_path
):
    def command(output_dir):
        return [sys.executable, "grpo.py", *grpo_argv(output_dir, 8, save_every=2)]

    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    uninterrupted = grpo_uninterrupted  # the same run with a checkpoint only at the end
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


# --------------------------------------------------------------------------------------------------
# Shared clusters: checkpoints from others, two runs in one folder, preemption, divergence
# (one test per fault of issue 44's list, numbered as there)
# --------------------------------------------------------------------------------------------------


class RunsCode:
    """A pickle that runs code when it is loaded: it creates `marker` (harmless)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def rewrite_manifest_entry(checkpoint, name):
    """The manifest re-hashed for a file someone replaced: whoever edits a checkpoint can edit its
    manifest, so the hashes prove nothing about who wrote it."""
    manifest = json.load(open(checkpoint / harness.MANIFEST))
    file = checkpoint / name
    manifest["files"][name] = {"bytes": file.stat().st_size, "sha256": harness.sha256_of(file)}
    json.dump(manifest, open(checkpoint / harness.MANIFEST, "w"))


@pytest.mark.parametrize("name", ["trainer_state.pt", "rng_rank0.pt"])
def test_1_a_crafted_pickle_in_a_checkpoint_runs_nothing(name, grpo_done, tmp_path, capfd):
    out = copy_of(grpo_done, tmp_path)
    marker = tmp_path / "the_pickle_ran"
    torch.save({"step": 2, "payload": RunsCode(str(marker))}, out / "checkpoint" / name)
    rewrite_manifest_entry(out / "checkpoint", name)
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, name, "nothing in it ran")
    assert not marker.exists()
    assert steps(out / "metrics.jsonl") == [1, 2]


def live_processes_with(text):
    """pids of the live processes whose command line contains `text`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in command and state != "Z":
            pids.append(int(pid))
    return pids


def wait_for_rows(metrics, count, process, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{metrics}: fewer than {count} rows (exit code {process.poll()})")


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
DDP_SIZES = ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "4"]
DDP_SIZES += ["--ppo-micro-batch-size-per-gpu", "4"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def test_2_one_run_per_output_dir_and_ranks_end_with_their_launcher(tmp_path, capfd):
    """A second run into a folder a live run holds is refused in one line naming the holder (and
    writes nothing there); killing only the torchrun launcher (SIGKILL) ends both ranks; then the
    folder is free again."""
    out = tmp_path / "run"
    command = [*TORCHRUN, "grpo.py", *grpo_argv(out, 200, *DDP_SIZES, save_every=100)]
    launcher = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_rows(out / "metrics.jsonl", 1, launcher)
        rows = (out / "metrics.jsonl").read_text()
        code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
        assert code == 1
        assert_one_line(stderr, str(out), "in use by another run", "pid", "grpo.py")
        assert (out / "metrics.jsonl").read_text().startswith(rows)  # not moved aside
        assert len(live_processes_with(str(out))) >= 3  # the launcher and its two ranks
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    killed = time.time()
    while live_processes_with(str(out)) and time.time() < killed + 20:
        time.sleep(0.02)
    assert live_processes_with(str(out)) == []  # no orphan rank runs on
    assert time.time() - killed < 1.0  # README: within a second (measured 0.12-0.24 s)
    code, stderr = run_main(grpo.main, grpo_argv(out / "other", 1), capfd)
    assert code == 0, stderr[-2000:]
    harness.lock_output_dir(str(out), 0)  # free again: the dead run's lock went with it
    harness.release_output_dirs()


def test_3_a_fresh_start_rebuilds_what_other_settings_built(
    grpo_done, tmp_path, capfd, monkeypatch
):
    """Without a checkpoint, grpo.py's tiny model is rebuilt for another --tiny-arch or --seed, and
    ppo_rlhf.py's reward model is trained again for another --seed (a resume keeps its own)."""
    out = copy_of(grpo_done, tmp_path)
    shutil.rmtree(out / "checkpoint")
    assert json.load(open(out / "tiny_model" / "config.json"))["model_type"] == "gpt2"
    code, stderr = run_main(grpo.main, grpo_argv(out, 1, "--tiny-arch", "qwen2"), capfd)
    assert code == 0, stderr[-2000:]
    assert json.load(open(out / "tiny_model" / "config.json"))["model_type"] == "qwen2"
    shutil.rmtree(out / "checkpoint")
    code, stderr = run_main(
        grpo.main, grpo_argv(out, 1, "--tiny-arch", "qwen2", "--seed", "2"), capfd
    )
    assert code == 0, stderr[-2000:]
    assert harness.built_with(str(out / "tiny_model"))["seed"] == 2

    trained = []

    def fake_train(rm_args):
        trained.append(rm_args.seed)
        os.makedirs(rm_args.output_dir, exist_ok=True)
        return os.path.join(rm_args.output_dir, "reward_model")

    monkeypatch.setattr(rewards, "train", fake_train)
    args = dataclasses.replace(ppo_rlhf.PRESETS["tiny"][1], seed=1, output_dir=str(tmp_path / "p"))
    ppo_rlhf.reward_model_paths(args)
    ppo_rlhf.reward_model_paths(args)  # the same settings: reused
    ppo_rlhf.reward_model_paths(dataclasses.replace(args, seed=2))  # a fresh start, seed 2
    ppo_rlhf.reward_model_paths(args, resume="a checkpoint")  # resuming: its own, seed 2
    assert trained == [1, 2]


def test_4_a_checkpoint_resumes_only_with_the_world_size_that_wrote_it(grpo_done, tmp_path, capfd):
    """A 2-process checkpoint (two RNG files) is refused in one process, in one line (1 -> 2 is
    refused too: rank 1 has no RNG file)."""
    out = copy_of(grpo_done, tmp_path)
    shutil.copy(out / "checkpoint" / "rng_rank0.pt", out / "checkpoint" / "rng_rank1.pt")
    rewrite_manifest_entry(out / "checkpoint", "rng_rank1.pt")
    manifest = json.load(open(out / "checkpoint" / harness.MANIFEST))
    json.dump({**manifest, "world_size": 2}, open(out / "checkpoint" / harness.MANIFEST, "w"))
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "written by 2 processes", "this run has 1", "--nproc_per_node 2")


def test_5_a_symlinked_checkpoint_folder_keeps_working(grpo_done, tmp_path, capfd):
    out = copy_of(grpo_done, tmp_path)
    elsewhere = tmp_path / "bigger_disk" / "checkpoint"
    elsewhere.parent.mkdir()
    shutil.move(out / "checkpoint", elsewhere)
    os.symlink(elsewhere, out / "checkpoint")
    for total in (3, 4):
        code, stderr = run_main(grpo.main, grpo_argv(out, total), capfd)
        assert code == 0, stderr[-2000:]
        assert os.path.islink(out / "checkpoint")
        assert json.load(open(elsewhere / harness.MANIFEST))["step"] == total
    assert steps(out / "metrics.jsonl") == [1, 2, 3, 4]


def test_6_a_kill_while_the_metrics_are_rewritten_loses_no_row(
    grpo_done, tmp_path, capfd, monkeypatch
):
    """On resume the rows after the checkpoint are cut from metrics.jsonl: the kept rows go to a
    temporary file swapped in, so a kill before the swap leaves the whole old file."""
    out = copy_of(grpo_done, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward/mean": 0.5}) + "\n")
    before = (out / "metrics.jsonl").read_text()
    real_replace = os.replace

    def killed_before_the_swap(src, dst):
        if str(dst).endswith("metrics.jsonl"):
            raise KeyboardInterrupt  # the process dies here
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_swap)
    code, _ = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 130
    assert (out / "metrics.jsonl").read_text() == before
    monkeypatch.setattr(os, "replace", real_replace)
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0, stderr[-2000:]
    assert steps(out / "metrics.jsonl") == [1, 2, 3]


def strict_rows(path):
    """Every line parsed as strict JSON (NaN, Infinity refused)."""

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in open(path)]


@pytest.mark.parametrize("script", ["grpo", "ppo_rlhf"])
def test_7_divergence_stops_at_that_step_before_the_update_and_the_save(
    script, tiny_assets, tmp_path, capfd
):
    out = tmp_path / script
    if script == "grpo":
        code, stderr = run_main(grpo.main, grpo_argv(out, 3, "--lr", "1e6"), capfd)
    else:  # two epochs: the second one's loss is nan
        argv = ppo_argv(out, tiny_assets, 3, "--lr", "1e6", "--noptepochs", "2")
        code, stderr = run_main(ppo_rlhf.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, "step 1:", "is nan", "diverged", "nothing was saved")
    assert not (out / "checkpoint").exists()
    # metrics.jsonl holds no row of the diverged step (nor, with val before train, a bare NaN)
    logged = strict_rows(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    assert all(row["step"] < 1 for row in logged)
    assert harness.json_line({"loss": float("nan"), "x": [float("inf"), 1.0]}) == (
        '{"loss": null, "x": [null, 1.0]}\n'
    )


def test_7_an_update_that_breaks_the_weights_ends_sampling_in_one_line(
    tiny_assets, tmp_path, capfd
):
    """One epoch of lr 1e6: the loss of update 1 is finite, its update is not, and update 2 cannot
    sample (torch.multinomial on nan probabilities): one line that says so, not a traceback."""
    argv = ppo_argv(tmp_path / "ppo", tiny_assets, 3, "--lr", "1e6")
    code, stderr = run_main(ppo_rlhf.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, "sampling failed", "not finite", "diverged", "lower --lr")


def stop_with_a_signal(command, out, rows, sig, ddp=False):
    """Start `command`, send `sig` after `rows` rows of metrics.jsonl, return (exit code, stderr)."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_for_rows(out / "metrics.jsonl", rows, process)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=240)
    return process.returncode, stderr


@pytest.fixture(scope="module")
def grpo_uninterrupted(tmp_path_factory):
    """grpo.py tiny for 8 steps, never interrupted: what a stopped and resumed run must equal."""
    out = tmp_path_factory.mktemp("uninterrupted") / "grpo"
    command = [sys.executable, "grpo.py", *grpo_argv(out, 8, save_every=100)]
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    return out


def same_run(ours, theirs):
    from safetensors.torch import load_file

    assert rows_without_clocks(ours / "metrics.jsonl") == rows_without_clocks(
        theirs / "metrics.jsonl"
    )
    mine = load_file(ours / "checkpoint" / "model.safetensors")
    other = load_file(theirs / "checkpoint" / "model.safetensors")
    assert all(torch.equal(mine[k], other[k]) for k in other)


def test_8_sigterm_saves_at_the_end_of_the_step_and_the_rerun_resumes_exactly(
    grpo_uninterrupted, tmp_path
):
    out = tmp_path / "stopped"
    command = [sys.executable, "grpo.py", *grpo_argv(out, 8, save_every=100)]
    code, stderr = stop_with_a_signal(command, out, 3, signal.SIGTERM)
    assert code == 143, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("grpo.py: stopped by SIGTERM")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    stopped_at = json.load(open(out / "checkpoint" / harness.MANIFEST))["step"]
    assert 3 <= stopped_at < 8 and f"after step {stopped_at}," in lines[0]
    assert steps(out / "metrics.jsonl") == list(range(1, stopped_at + 1))
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    same_run(out, grpo_uninterrupted)


def test_8_ctrl_c_stops_ppo_rlhf_with_a_checkpoint_and_it_resumes(tiny_assets, tmp_path):
    out = tmp_path / "ppo"
    command = [sys.executable, "ppo_rlhf.py", *ppo_argv(out, tiny_assets, 12)]
    command[command.index("--save-every") + 1] = "100"
    code, stderr = stop_with_a_signal(command, out, 2, signal.SIGINT)
    assert code == 130, stderr[-2000:]
    assert len([line for line in stderr.splitlines() if "stopped by SIGINT" in line]) == 1
    assert "Traceback" not in stderr, stderr[-2000:]
    stopped_at = json.load(open(out / "checkpoint" / harness.MANIFEST))["step"]
    assert 2 <= stopped_at < 12
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    assert steps(out / "metrics.jsonl") == list(range(1, 13))


def test_8_sigterm_to_torchrun_stops_both_ranks_at_the_same_step(tmp_path):
    """torchrun passes SIGTERM to its ranks: they agree on the step (one all-reduce), save one
    checkpoint, exit 143 each, and torchrun itself exits 1 (how it reports a rank that exited
    non-zero; README says so); the rerun under torchrun resumes and ends with identical ranks."""
    out = tmp_path / "ddp"
    command = [*TORCHRUN, "grpo.py", *grpo_argv(out, 8, *DDP_SIZES, save_every=100)]
    code, stderr = stop_with_a_signal(command, out, 2, signal.SIGTERM)
    assert code == 1
    ours = [line for line in stderr.splitlines() if "grpo.py: stopped by SIGTERM" in line]
    assert len(ours) == 1, stderr[-3000:]
    stopped_at = json.load(open(out / "checkpoint" / harness.MANIFEST))["step"]
    assert len([n for n in os.listdir(out / "checkpoint") if n.startswith("rng_rank")]) == 2
    subprocess.run(command, cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["step"] for row in rows] == list(range(1, 9)) and stopped_at < 8
    assert rows[-1]["debug/rank_param_checksum_max_diff"] == 0.0


def make_folder_without_weights(out):
    folder = out.parent / "config_only"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "verl_source.py", folder / "notes.py")  # any non-weight file
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return ["--model-name-or-path", str(folder)]


def test_9_each_of_the_smaller_faults_ends_in_one_line(grpo_done, tiny_assets, tmp_path, capfd):
    # a metrics line that is JSON but not an object: moved aside like a line cut short
    out = copy_of(grpo_done, tmp_path / "a")
    with open(out / "metrics.jsonl", "a") as f:
        f.write("42\n" + json.dumps({"step": 3, "reward/mean": 0.5}) + "\n")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3, "--log-samples-every", "10"), capfd)
    assert code == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert "1 line(s) cut short moved" in stderr  # the 42
    assert "1 row(s) logged after the checkpoint's step 2 moved" in stderr  # the old step 3
    assert open(out / "metrics.jsonl.discarded").read().startswith("42\n")
    # the resumed run logs no extra samples table at its first step (3: not a multiple of 10)
    assert max(json.loads(line)["step"] for line in open(out / "samples.jsonl")) == 2

    # fewer steps than the checkpoint holds: nothing to do, refused, args.json untouched
    args_json = (out / "args.json").read_text()
    code, stderr = run_main(grpo.main, grpo_argv(out, 2), capfd)
    assert code == 1
    assert_one_line(stderr, "is at step 3", "--total-steps is 2", "nothing to train")
    assert (out / "args.json").read_text() == args_json

    # a manifest entry deleted and its file truncated
    out = copy_of(grpo_done, tmp_path / "b")
    manifest = json.load(open(out / "checkpoint" / harness.MANIFEST))
    del manifest["files"]["rng_rank0.pt"]
    json.dump(manifest, open(out / "checkpoint" / harness.MANIFEST, "w"))
    truncate(out / "checkpoint" / "rng_rank0.pt")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "rng_rank0.pt is not in the manifest")

    # another script's checkpoint, even with --allow-changed-settings
    out = tmp_path / "c"
    argv = ppo_argv(out, tiny_assets, 2, "--resume-from", str(grpo_done / "checkpoint"))
    code, stderr = run_main(ppo_rlhf.main, argv + ["--allow-changed-settings"], capfd)
    assert code == 1
    assert_one_line(stderr, "was written by grpo.py, not ppo_rlhf.py")

    # a model folder with a config but no weights: refused before anything loads
    out = tmp_path / "d" / "run"
    code, stderr = run_main(grpo.main, grpo_argv(out, 1, *make_folder_without_weights(out)), capfd)
    assert code == 2
    assert_one_line(stderr, "--model-name-or-path", "config.json but no weights")

    # metrics.jsonl that cannot be opened for appending (a read-only file, a full quota)
    out = copy_of(grpo_done, tmp_path / "e")
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith("metrics.jsonl") and flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args)

    os.open = read_only
    try:
        code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    finally:
        os.open = real_open
    assert code == 1
    assert_one_line(stderr, "cannot append to", "metrics.jsonl", "Permission denied")


# --------------------------------------------------------------------------------------------------
# Shared run folders (issue 61): nothing a run writes follows a symlink out of its folder, a resume
# is the same experiment or refused, what a run builds appears whole with its mark, one run per
# folder whatever happens to run.lock, and every remaining failure ends in one line
# --------------------------------------------------------------------------------------------------


def snapshot(path):
    """Every file under `path` (or the file itself) with its bytes: what must not change."""
    path = Path(path)
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {
        str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
    }


# name in the run folder -> (the run that meets it, what it does): "resume" a copy of grpo_done,
# "fresh" that copy without its checkpoint, "ppo" a ppo_rlhf.py tiny run; "runs" (the link replaced
# or removed, never written through) or "refused" (one line naming it, nothing written)
LINKED_NAMES = {
    "run.lock": ("resume", "runs"),
    "args.json.tmp": ("resume", "runs"),
    "checkpoint.tmp": ("resume", "runs"),
    "metrics.jsonl": ("resume", "refused"),
    "samples.jsonl": ("resume", "refused"),
    "metrics.jsonl.discarded": ("resume", "refused"),
    "tiny_model": ("fresh", "runs"),
    "final_rank0.json": ("ppo", "runs"),
}


@pytest.mark.parametrize("name", sorted(LINKED_NAMES))
def test_10_a_symlink_in_a_run_folder_redirects_no_write(
    name, grpo_done, tiny_assets, tmp_path, capfd
):
    """A run folder copied with its symlinks: a known name pointing outside the folder is never
    written through. Not a byte of the link's target changes; the run either replaces the link
    (the lock, a temporary, an artifact it builds, a file it rewrites whole) or, for the logs a
    resume reads and appends to, is refused in one line naming the link."""
    run, outcome = LINKED_NAMES[name]
    outside = tmp_path / "outside"
    outside.mkdir()
    if run == "ppo":
        out = tmp_path / "ppo"
        out.mkdir()
    else:
        out = copy_of(grpo_done, tmp_path)
    if run == "fresh":
        shutil.rmtree(out / "checkpoint")
    target = outside / name
    if name == "tiny_model":
        shutil.move(out / "tiny_model", target)  # another run's model, elsewhere
    elif name in ("metrics.jsonl", "samples.jsonl"):
        shutil.move(out / name, target)
    elif name == "checkpoint.tmp":
        target.mkdir()
        (target / "keep.txt").write_text("someone else's\n")
    else:
        target.write_text("someone else's\n")
        if os.path.lexists(out / name):
            os.remove(out / name)
    os.symlink(target, out / name)
    before = snapshot(outside)
    if run == "ppo":
        code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 1), capfd)
    else:
        extra = ("--seed", "2") if run == "fresh" else ()
        code, stderr = run_main(grpo.main, grpo_argv(out, 3, *extra), capfd)
    assert snapshot(outside) == before  # no byte written outside the folder
    if outcome == "refused":
        assert code == 1
        assert_one_line(stderr, name, "is a symbolic link")
    else:
        assert code == 0, stderr[-2000:]
        assert not os.path.islink(out / name) or name == "tiny_model"
    if name == "tiny_model":  # built anew in the folder, the link replaced
        assert not os.path.islink(out / "tiny_model")
        assert harness.built_with(str(out / "tiny_model"))["seed"] == 2


def tiny_model_folder(path, seed):
    tasks.build_tiny_model(str(path), arch="gpt2", seed=seed)
    return str(path)


def test_11_a_resume_is_refused_when_what_it_loads_changed_under_the_same_path(
    tiny_assets, tmp_path, capfd
):
    """A resume pins what it loads from outside its checkpoint (the manifest records each input's
    sha256): grpo.py's model folder (its tokenizer and reference model) re-converted under the same
    path, and ppo_rlhf.py's reward model retrained into the same folder, are refused in one line
    naming the input and the file, before anything trains; --allow-changed-settings resumes and
    says what changed."""
    model = tiny_model_folder(tmp_path / "model", seed=0)
    out = tmp_path / "grpo"
    argv = grpo_argv(out, 1, "--model-name-or-path", model, "--kl-loss-coef", "0.01")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 0, stderr[-2000:]
    tiny_model_folder(tmp_path / "model", seed=1)  # another model, the same path
    rows = (out / "metrics.jsonl").read_text()
    argv = grpo_argv(out, 2, "--model-name-or-path", model, "--kl-loss-coef", "0.01")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, "other inputs", "model", "model.safetensors differs")
    assert (out / "metrics.jsonl").read_text() == rows
    code, stderr = run_main(grpo.main, argv + ["--allow-changed-settings"], capfd)
    assert code == 0 and "changed inputs" in stderr, stderr[-2000:]

    reward_model = tmp_path / "rm"
    shutil.copytree(tiny_assets / "reward_model", reward_model)
    shutil.copytree(tiny_assets / "tiny_policy", tmp_path / "tiny_policy")
    out = tmp_path / "ppo"
    argv = ppo_argv(out, tiny_assets, 1)
    argv[argv.index("--reward-model-path") + 1] = str(reward_model)
    code, stderr = run_main(ppo_rlhf.main, argv, capfd)
    assert code == 0, stderr[-2000:]
    recorded = json.load(open(out / "args.json"))["inputs"]["reward model"]
    assert recorded["path"] == str(reward_model) and "reward_head.pt" in recorded["files"]
    retrained = rewards.load_reward_model(str(reward_model))
    with torch.no_grad():
        retrained.reward_bias.fill_(3.0)
    rewards.save_reward_model(retrained, str(reward_model), ppo_rlhf.load_tokenizer(str(model)))
    code, stderr = run_main(ppo_rlhf.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, "other inputs", "reward model", "reward_head.pt differs")


def test_11_a_hub_input_is_pinned_by_its_cached_revision(tmp_path, monkeypatch):
    """A Hub name is pinned by the revision its local snapshot resolves to (huggingface_hub's
    cache, read offline), and a new revision under the same name is a changed input."""
    import huggingface_hub

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--someone--tiny"

    def publish(revision):
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)

    publish("a" * 40)
    before = harness.input_digests({"model": "someone/tiny", "nothing": None})
    assert before == {"model": {"hub": "someone/tiny", "revision": "a" * 40}}
    publish("b" * 40)
    after = harness.input_digests({"model": "someone/tiny"})
    assert "-> " + "b" * 40 in harness.input_change(before["model"], after["model"])
    assert harness.input_digests({"x": "nobody/uncached"})["x"]["revision"] is None


def test_12_a_kill_while_the_tiny_model_is_built_leaves_the_old_one_whole(
    grpo_done, tmp_path, capfd, monkeypatch
):
    """A fresh start with another --seed rebuilds tiny_model/; killed in the middle of the build, it
    leaves the old model whole under its own mark (the new one is built in tiny_model.tmp with its
    mark and swapped in), so a later fresh start with the old seed trains the old seed's model, not
    half of another."""
    out = copy_of(grpo_done, tmp_path)
    shutil.rmtree(out / "checkpoint")
    seed_1 = snapshot(out / "tiny_model")
    real_build = tasks.build_tiny_model

    def killed_mid_build(path, **kwargs):
        real_build(path, **kwargs)  # the new weights are written ...
        raise KeyboardInterrupt  # ... and the run is stopped before the mark

    monkeypatch.setattr(tasks, "build_tiny_model", killed_mid_build)
    code, _ = run_main(grpo.main, grpo_argv(out, 1, "--seed", "2"), capfd)
    assert code == 130
    monkeypatch.setattr(tasks, "build_tiny_model", real_build)
    assert snapshot(out / "tiny_model") == seed_1
    code, stderr = run_main(grpo.main, grpo_argv(out, 1), capfd)
    assert code == 0, stderr[-2000:]
    assert snapshot(out / "tiny_model") == seed_1


def test_13_ppo_rlhf_loads_the_reward_model_of_its_own_folder(
    tiny_assets, tmp_path, capfd, monkeypatch
):
    """The reward model of a run that trains its own is <output_dir>/reward_model_run/reward_model,
    derived, never read back from a file: an --output-dir with a leading space does not load the
    folder without it, and an edited DONE file (what older runs wrote) points nowhere."""
    monkeypatch.chdir(tmp_path)
    decoy = tmp_path / "lead" / "reward_model_run" / "reward_model"
    decoy.mkdir(parents=True)
    trained = []

    def fake_train(rm_args):
        trained.append(rm_args.output_dir)
        os.makedirs(os.path.join(rm_args.output_dir, "reward_model"), exist_ok=True)
        return os.path.join(rm_args.output_dir, "reward_model")

    monkeypatch.setattr(rewards, "train", fake_train)
    args = dataclasses.replace(ppo_rlhf.PRESETS["tiny"][1], output_dir=" lead")
    rm_path, _ = ppo_rlhf.reward_model_paths(args)
    assert rm_path == os.path.join(" lead", "reward_model_run", "reward_model")
    assert trained == [os.path.join(" lead", "reward_model_run.tmp")]
    (tmp_path / " lead" / "reward_model_run" / "DONE").write_text(str(decoy))
    assert ppo_rlhf.reward_model_paths(args)[0] == rm_path  # reused, from its own folder


def test_14_the_lock_holds_the_folder_not_the_file_name(tmp_path, capfd):
    """A run holds its folder, not the name run.lock: deleting run.lock while it runs does not let a
    second run in."""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import harness, sys, time; harness.lock_output_dir(sys.argv[1], 0); "
            "print('locked', flush=True); time.sleep(120)",
            str(out),
        ],
        cwd=ROOT,
        env=dict(ENV, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        os.remove(out / harness.RUN_LOCK)
        code, stderr = run_main(grpo.main, grpo_argv(out, 1), capfd)
        assert code == 1
        assert_one_line(stderr, str(out), "in use by another run")
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def tmpfs(path, size, read_only=False):
    """A tmpfs of `size` bytes mounted at `path` (a real full disk or a read-only filesystem), or
    the test skipped with the reason where this machine cannot mount one (not root, no mount)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount_read_only(path):
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def test_15_a_read_only_or_full_disk_at_the_lock_and_the_row_move_ends_in_one_line(
    grpo_done, tmp_path, capfd
):
    """A run folder on a read-only filesystem: the lock's holder line cannot be written, one line
    naming run.lock and the cause. A filesystem that fills while a resume cuts the rows logged
    after its checkpoint: one line naming metrics.jsonl and the cause, the old file whole."""
    with tmpfs(tmp_path / "ro", 64 << 20) as disk:
        out = copy_of(grpo_done, disk)
        remount_read_only(disk)
        code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
        assert code == 1
        assert_one_line(stderr, "run.lock", "Read-only file system")
    run = copy_of(grpo_done, tmp_path / "big")
    with open(run / "metrics.jsonl", "a") as f:  # 4 MB of rows the resume keeps, one it cuts
        kept = json.dumps({"step": 1, "padding": "x" * 1000}) + "\n"
        f.write(kept * 4000 + json.dumps({"step": 3}) + "\n")
    used = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    with tmpfs(tmp_path / "full", used + (1 << 20)) as disk:
        out = copy_of(run, disk)
        before = (out / "metrics.jsonl").read_bytes()
        code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
        assert code == 1
        assert_one_line(stderr, "metrics.jsonl", "No space left on device")
        assert (out / "metrics.jsonl").read_bytes() == before


def test_16_a_full_disk_while_the_tiny_model_is_built_ends_in_one_line(tmp_path, capfd):
    """The tiny model (1.7 MB) built on a 512 KB filesystem: one line naming tiny_model.tmp and the
    cause, the partial folder removed; the same on every rerun, never a half-built model."""
    with tmpfs(tmp_path / "small", 512 << 10) as disk:
        for _ in range(2):
            code, stderr = run_main(grpo.main, grpo_argv(disk / "run", 1), capfd)
            assert code == 1
            assert_one_line(stderr, "tiny_model.tmp", "No space left on device")
            assert not (disk / "run" / "tiny_model").exists()
            assert not (disk / "run" / "tiny_model.tmp").exists()


def test_17_crafted_weights_run_nothing(grpo_done, tiny_assets, tmp_path, capfd):
    """A checkpoint whose model.safetensors was swapped for a crafted pytorch_model.bin (its
    manifest rewritten), and a reward model whose reward_head.pt is a crafted pickle: one line
    each, nothing in them ran (transformers and rewards.load_reward_model load with
    weights_only=True)."""
    out = copy_of(grpo_done, tmp_path / "grpo")
    marker = tmp_path / "the_pickle_ran"
    checkpoint = out / "checkpoint"
    os.remove(checkpoint / "model.safetensors")
    torch.save({"weight": RunsCode(str(marker))}, checkpoint / "pytorch_model.bin")
    manifest = json.load(open(checkpoint / harness.MANIFEST))
    del manifest["files"]["model.safetensors"]
    json.dump(manifest, open(checkpoint / harness.MANIFEST, "w"))
    rewrite_manifest_entry(checkpoint, "pytorch_model.bin")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "checkpoint", "need more than tensors", "nothing in them ran")
    assert not marker.exists()

    reward_model = tmp_path / "rm"
    shutil.copytree(tiny_assets / "reward_model", reward_model)
    shutil.copytree(tiny_assets / "tiny_policy", tmp_path / "tiny_policy")
    torch.save({"reward_gain": RunsCode(str(marker))}, reward_model / rewards.REWARD_HEAD_FILE)
    argv = ppo_argv(tmp_path / "ppo", tiny_assets, 1)
    argv[argv.index("--reward-model-path") + 1] = str(reward_model)
    code, stderr = run_main(ppo_rlhf.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, rewards.REWARD_HEAD_FILE, "nothing in it ran")
    assert not marker.exists()


MALFORMED_MANIFESTS = {
    "null entry": lambda m: {**m, "files": {**m["files"], "trainer_state.pt": None}},
    "no args": lambda m: {k: v for k, v in m.items() if k != "args"},
    "bytes as a string": lambda m: {
        **m,
        "files": {
            **m["files"],
            "trainer_state.pt": {
                **m["files"]["trainer_state.pt"],
                "bytes": str(m["files"]["trainer_state.pt"]["bytes"]),
            },
        },
    },
    "step not a number": lambda m: {**m, "step": "2"},
}


@pytest.mark.parametrize("fault", sorted(MALFORMED_MANIFESTS))
def test_18_a_malformed_manifest_ends_in_one_line(fault, grpo_done, tmp_path, capfd):
    out = copy_of(grpo_done, tmp_path)
    path = out / "checkpoint" / harness.MANIFEST
    json.dump(MALFORMED_MANIFESTS[fault](json.load(open(path))), open(path, "w"))
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "manifest.json is malformed")


def test_18_metrics_rows_whose_step_is_not_a_number_move_aside(grpo_done, tmp_path, capfd):
    out = copy_of(grpo_done, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": "three", "reward/mean": 0.5}\n{"step": null}\n')
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert "2 line(s) cut short moved" in stderr
    assert steps(out / "metrics.jsonl") == [1, 2, 3]
    assert (out / "metrics.jsonl.discarded").read_text().startswith('{"step": "three"')


@pytest.mark.parametrize("resume", [False, True])
def test_19_a_damaged_tiny_model_is_built_again(resume, grpo_done, tmp_path, capfd):
    """A truncated or emptied tokenizer in tiny_model/ (its mark hashes every file) is built again
    with the same settings, whether the run resumes (the same model again: the resume goes on) or
    starts afresh; it used to fail the same way on every rerun."""
    out = copy_of(grpo_done, tmp_path)
    if not resume:
        shutil.rmtree(out / "checkpoint")
    truncate(out / "tiny_model" / "tokenizer.json")
    (out / "tiny_model" / "tokenizer_config.json").write_text("")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0, stderr[-2000:]
    assert snapshot(out / "tiny_model") == snapshot(grpo_done / "tiny_model")


def test_20_wandb_without_its_server_or_with_a_bad_mode_ends_in_one_line(
    tmp_path, capfd, monkeypatch
):
    """WANDB_MODE=OFFLINE (wandb's modes are lower case) is refused before any model loads; --track
    with a key and no reachable server ends in one line once wandb gives up (WANDB_INIT_TIMEOUT),
    nothing trained."""
    monkeypatch.setenv("WANDB_MODE", "OFFLINE")
    code, stderr = run_main(grpo.main, grpo_argv(tmp_path / "a", 1, "--track"), capfd)
    assert code == 2
    assert_one_line(stderr, "WANDB_MODE=OFFLINE", "offline")
    # a process of its own: wandb keeps its settings per process (an offline run of another test)
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_")}
    env.update(WANDB_API_KEY="0" * 40, WANDB_INIT_TIMEOUT="5", WANDB_SILENT="true")
    env["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # nothing listens on port 9
    command = [sys.executable, "grpo.py", *grpo_argv(tmp_path / "b", 1, "--track")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert_one_line(result.stderr, "--track: wandb could not start a run", "WANDB_MODE=offline")
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_21_an_undecodable_metrics_line_moves_aside_byte_for_byte(grpo_done, tmp_path, capfd):
    """A metrics line that is not UTF-8 moves to metrics.jsonl.discarded as it was, and the kept
    rows stay byte for byte (they used to be rewritten with U+FFFD)."""
    out = copy_of(grpo_done, tmp_path)
    kept = (out / "metrics.jsonl").read_bytes()
    bad = b'{"step": 1, "note": "\xff\xfe"}\n'
    (out / "metrics.jsonl").write_bytes(kept + bad + b'{"step": 3}\n')
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0, stderr[-2000:]
    assert (out / "metrics.jsonl.discarded").read_bytes() == bad + b'{"step": 3}\n'
    assert (out / "metrics.jsonl").read_bytes().startswith(kept)


def test_22_a_checkpoint_of_diverged_weights_ends_in_one_line(grpo_done, tmp_path, capfd):
    """A checkpoint saved after the weights became non-finite (the loss of its last update was
    finite): the rerun does not resume into a failure that blames the learning rate, it says in one
    line that the checkpoint holds diverged weights, before anything runs (with either engine: the
    check is on load; vLLM's own NaN rollout: tests/test_vllm_backend.py)."""
    from safetensors.torch import load_file, save_file

    out = copy_of(grpo_done, tmp_path)
    path = out / "checkpoint" / "model.safetensors"
    weights = load_file(path)
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, path, metadata={"format": "pt"})
    rewrite_manifest_entry(out / "checkpoint", "model.safetensors")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "holds non-finite weights", name, "diverged")


def test_23_a_file_size_limit_at_the_checkpoint_is_named(grpo_done, tmp_path):
    """ulimit -f between the model's size and the optimizer state's: the checkpoint's
    trainer_state.pt passes it; the line names the checkpoint, the cause and the limit (torch's
    writer used to say only "unexpected pos"). A disk quota (EDQUOT) reaches the line the same way,
    through the errno."""
    import resource

    limit = (grpo_done / "tiny_model" / "model.safetensors").stat().st_size + (64 << 10)

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    command = [sys.executable, "grpo.py", *grpo_argv(tmp_path / "run", 1)]
    result = subprocess.run(
        command, cwd=ROOT, env=ENV, capture_output=True, text=True, preexec_fn=limit_file_size
    )
    assert result.returncode == 1
    assert_one_line(result.stderr, "checkpoint.tmp", "File too large", f"is {limit} bytes")


@pytest.mark.parametrize("name", ["checkpoint.tmp", "checkpoint.old"])
def test_24_a_stray_file_where_a_checkpoint_temporary_goes_is_removed(
    name, grpo_done, tmp_path, capfd
):
    """A stray checkpoint.tmp or checkpoint.old that is a file (or a link: test_10) is removed
    before the next save; it used to make every save fail with a line saying the partial
    checkpoint was removed."""
    out = copy_of(grpo_done, tmp_path)
    (out / name).write_text("stray\n")
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 0, stderr[-2000:]
    assert json.load(open(out / "checkpoint" / harness.MANIFEST))["step"] == 3
    assert not (out / name).exists()


def test_25_the_rerun_after_a_failed_final_policy_save_finishes_the_run(
    tiny_assets, tmp_path, capfd, monkeypatch
):
    """No space for ppo_rlhf.py's final policy (simulated: the policy is smaller than the
    checkpoint written just before it, so no real disk fills there first): one line; the documented
    rerun writes the final policy from the last checkpoint instead of refusing with "nothing to
    train", and a rerun after that is refused."""
    out = tmp_path / "ppo"
    real_save = torch.save

    def no_space_for_the_policy(obj, f, *args, **kwargs):
        if "policy.tmp" in str(getattr(f, "name", f)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", no_space_for_the_policy)
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 2), capfd)
    assert code == 1
    assert_one_line(stderr, "policy.tmp", "No space left on device")
    monkeypatch.setattr(torch, "save", real_save)
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 2), capfd)
    assert code == 0, stderr[-2000:]
    assert (out / "policy" / "value_head.pt").exists() and (out / "final_rank0.json").exists()
    assert steps(out / "metrics.jsonl") == [1, 2]
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 2), capfd)
    assert code == 1
    assert_one_line(stderr, "nothing to train")


def test_26_an_output_dir_past_the_path_limit_is_refused_before_anything_loads(tmp_path, capfd):
    long = tmp_path / "/".join(["d" * 200] * 20)
    code, stderr = run_main(grpo.main, grpo_argv(long, 1), capfd)
    assert code == 2
    assert_one_line(stderr, "--output-dir is", "characters long", "path limit")


def test_27_a_checkpoint_resumes_only_with_the_world_size_its_manifest_records(
    grpo_done, tmp_path, capfd
):
    """A 2-process checkpoint whose rank-1 RNG file was deleted (and dropped from the manifest)
    still says it was written by 2 processes: one process cannot resume it."""
    out = copy_of(grpo_done, tmp_path)
    manifest = json.load(open(out / "checkpoint" / harness.MANIFEST))
    json.dump({**manifest, "world_size": 2}, open(out / "checkpoint" / harness.MANIFEST, "w"))
    code, stderr = run_main(grpo.main, grpo_argv(out, 3), capfd)
    assert code == 1
    assert_one_line(stderr, "written by 2 processes", "this run has 1")


def test_28_another_thread_count_on_resume_says_the_last_bits_change(grpo_done, tmp_path, capfd):
    """--torch-threads may change on a resume (the same experiment), and the run says that its
    numbers then differ in their last bits (another summation order)."""
    out = copy_of(grpo_done, tmp_path)
    code, stderr = run_main(grpo.main, grpo_argv(out, 3, "--torch-threads", "2"), capfd)
    assert code == 0, stderr[-2000:]
    assert "--torch-threads 1 -> 2" in stderr and "last bits" in stderr


# --------------------------------------------------------------------------------------------------
# Query and label data_files (issue 61): a file that is wrong ends the run in one line naming the file and
# the cause, never in a traceback and never in a run that trains on it. rewards.py reads a local
# file in its check_args (exit code 2, nothing written); the token ids a policy can read are known
# once its tokenizer is loaded (exit code 1, before any model loads); ppo_rlhf.py reads its queries
# when the run draws them (exit code 1, before the first update)
# --------------------------------------------------------------------------------------------------

# the tiny tokenizer's vocabulary (tasks.build_tiny_tokenizer): [PAD] 0, [EOS] 1, [UNK] 2, then
# one token per character
VOCAB_SIZE = len(tasks.build_tiny_tokenizer())
QUERY_LENGTH, SAMPLE_LENGTH = 8, 16


def valid_labels(n=16):
    """n best-of-4 records in OpenAI's format, token ids of the tiny vocabulary past the special
    tokens; OpenAI's pad id (mapped to ours) where their data_files have it."""
    rng = random.Random(0)

    def ids(length):
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(length)]

    labels = [
        {
            "query": ids(QUERY_LENGTH),
            **{f"sample{k}": ids(SAMPLE_LENGTH) for k in range(rewards.NUM_SAMPLES)},
            "best": rng.randrange(rewards.NUM_SAMPLES),
        }
        for _ in range(n)
    ]
    labels[0]["query"][0] = rewards.OPENAI_PAD_TOKEN_ID
    labels[1]["sample2"][-1] = rewards.OPENAI_PAD_TOKEN_ID
    return labels


def write_query_lines(path, rows):
    """A .jsonl query file, one JSON object per row."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def valid_query_rows():
    """64 rows of a valid query file: tiny queries (lowercase letters and spaces) as "text"."""
    return [{"text": text} for text in tasks.tiny_queries(64, seed=0)]


@pytest.fixture
def data_files(tmp_path):
    """A valid label file and query file of the tiny policy."""
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps(valid_labels()))
    return labels, write_query_lines(tmp_path / "queries.jsonl", valid_query_rows())


def rewards_argv(output_dir, assets, labels, queries):
    """rewards.py on the tiny policy of tiny_assets, one step of 8 labels, 8 held out, 16
    normalisation samples."""
    return [
        "tiny",
        "--output-dir",
        str(output_dir),
        "--base-model",
        str(assets / "tiny_policy"),
        "--label-source",
        str(labels),
        "--query-dataset",
        str(queries),
        "--num-train",
        "8",
        "--num-test",
        "8",
        "--batch-size",
        "8",
        "--normalize-samples",
        "16",
        "--debug-normalize",
        "0",
        "--rollout-batch-size",
        "16",
        "--kl-samples",
        "0",
        "--eval-every",
        "1",
        "--no-save-model",
    ]


def ppo_query_argv(output_dir, assets, queries):
    """ppo_rlhf.py on tiny_assets' policy and reward model with a query file, one update of 32, no
    checkpoint (the later --save-every wins)."""
    policy = str(assets / "tiny_policy")
    extra = ("--base-model", policy, "--query-dataset", str(queries), "--save-every", "0")
    return ppo_argv(output_dir, assets, 1, *extra)


def trained_steps(output_dir):
    """The steps metrics.jsonl logged training rows for (none if the file is absent)."""
    metrics = Path(output_dir) / "metrics.jsonl"
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [row["step"] for row in rows if "train/loss" in row or "ppo/loss/total" in row]


def test_valid_label_and_query_files_train(tiny_assets, data_files, tmp_path, capfd):
    """The checks pass what is right: a label file with OpenAI's pad id in a query and a sample
    and a .jsonl query file train the reward model one step (and evaluate it), and ppo_rlhf.py
    runs one update on the same queries."""
    labels, queries = data_files
    code, stderr = run_main(
        rewards.main, rewards_argv(tmp_path / "rm", tiny_assets, *data_files), capfd
    )
    assert code == 0 and not error_lines(stderr), stderr[-2000:]
    assert trained_steps(tmp_path / "rm") == [1]
    code, stderr = run_main(
        ppo_rlhf.main, ppo_query_argv(tmp_path / "ppo", tiny_assets, queries), capfd
    )
    assert code == 0 and not error_lines(stderr), stderr[-2000:]
    assert trained_steps(tmp_path / "ppo") == [1]


def changed_labels(change):
    """The text of a label file: valid_labels() after change(labels) (which edits them in place)."""
    labels = valid_labels()
    change(labels)
    return json.dumps(labels)


def set_field(index, key, value):
    """A change: record `index`'s `key` becomes `value`."""

    def change(labels):
        labels[index][key] = value

    return change


def set_token(index, key, position, token):
    """A change: the token at `position` of record `index`'s `key` becomes `token`."""

    def change(labels):
        labels[index][key][position] = token

    return change


def drop_field(index, key):
    """A change: record `index` loses `key`."""

    def change(labels):
        del labels[index][key]

    return change


def shorten(index, key):
    """A change: record `index`'s `key` loses its last token."""

    def change(labels):
        labels[index][key] = labels[index][key][:-1]

    return change


def lengthen_samples(index):
    """A change: every sample of record `index` gets one more token (the record agrees with
    itself, not with the others)."""

    def change(labels):
        for k in range(rewards.NUM_SAMPLES):
            labels[index][f"sample{k}"].append(5)

    return change


def replace_record(index, value):
    """A change: record `index` becomes `value`."""

    def change(labels):
        labels[index] = value

    return change


# (the label file's text, what its one error line says besides the file's name); check_args finds
# every one of them, before anything is loaded or written
LABEL_FILE_FAULTS = {
    "empty file": ("", ["is empty"]),
    "whitespace only": ("\n  \n", ["is empty"]),
    "empty list": ("[]", ["holds no label records"]),
    "invalid JSON": (json.dumps(valid_labels())[:-30], ["is not valid JSON"]),
    "invalid UTF-8": (b'[{"query": [3, 4], "best": "\xff"}]', ["is not valid UTF-8"]),
    "not a list": (json.dumps({"labels": valid_labels()}), ["must be a JSON list", "dict"]),
    "record not an object": (
        changed_labels(replace_record(2, [1, 2, 3])),
        ["record 2", "must be an object", "list"],
    ),
    "missing key": (changed_labels(drop_field(3, "sample2")), ["record 3", "'sample2'", "missing"]),
    "null query": (changed_labels(set_field(2, "query", None)), ["record 2", "'query'", "null"]),
    "null best": (changed_labels(set_field(9, "best", None)), ["record 9", "'best'", "null"]),
    "empty sample": (
        changed_labels(set_field(4, "sample0", [])),
        ["record 4", "'sample0'", "empty"],
    ),
    "a float token id": (
        changed_labels(set_token(1, "sample0", 4, 3.5)),
        ["record 1", "'sample0'", "3.5", "token id"],
    ),
    "a negative token id": (
        changed_labels(set_token(4, "query", 0, -1)),
        ["record 4", "'query'", "-1", "token id"],
    ),
    "best 4": (
        changed_labels(set_field(6, "best", 4)),
        ["record 6", "'best'", "0, 1, 2 or 3", "4"],
    ),
    "best -1": (changed_labels(set_field(6, "best", -1)), ["record 6", "'best'", "-1"]),
    "best 1.5": (changed_labels(set_field(12, "best", 1.5)), ["record 12", "'best'", "1.5"]),
    "best a string": (changed_labels(set_field(5, "best", "2")), ["record 5", "'best'", "'2'"]),
    "ragged samples in one record": (
        changed_labels(shorten(7, "sample1")),
        ["record 7", "'sample1'", "15 token ids", "16"],
    ),
    "ragged samples across records": (
        changed_labels(lengthen_samples(11)),
        ["record 11", "'sample0'", "17 token ids", "16"],
    ),
    "ragged queries": (
        changed_labels(shorten(10, "query")),
        ["record 10", "'query'", "7 token ids", "8"],
    ),
}


@pytest.mark.parametrize("fault", LABEL_FILE_FAULTS)
def test_a_bad_label_file_is_refused_in_one_line_before_anything_loads(
    fault, tiny_assets, data_files, tmp_path, capfd
):
    """rewards.py --label-source FILE: a file that is empty, not JSON, not a list of best-of-4
    records, a record missing a key or holding null, a token id that is not a non-negative
    integer, a best that is not 0..3, or token lists of different lengths (what label_batch's
    torch.tensor / torch.stack or the loss would trip over mid-run, or silently cut) is refused
    by check_args: one line naming the file, the record and the key, exit code 2, nothing
    written."""
    text, words = LABEL_FILE_FAULTS[fault]
    labels = tmp_path / "bad_labels.json"
    labels.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    code, stderr = run_main(
        rewards.main, rewards_argv(out, tiny_assets, labels, data_files[1]), capfd
    )
    assert code == 2, stderr[-2000:]
    assert_one_line(stderr, "--label-source", str(labels), *words)
    assert not out.exists()


def test_a_label_file_named_gz_that_is_not_gzip_is_refused_in_one_line(
    tiny_assets, data_files, tmp_path, capfd
):
    """A label file whose name ends in .gz is read through gzip (as the shipped data/*.json.gz):
    one that is not gzip is refused by check_args in one line, not in gzip's traceback."""
    labels = tmp_path / "labels.json.gz"
    labels.write_text(json.dumps(valid_labels()))
    out = tmp_path / "out"
    code, stderr = run_main(
        rewards.main, rewards_argv(out, tiny_assets, labels, data_files[1]), capfd
    )
    assert code == 2, stderr[-2000:]
    assert_one_line(stderr, "--label-source", str(labels), "cannot be read", "gzip")
    assert not out.exists()


@pytest.mark.parametrize("token", [VOCAB_SIZE, rewards.OPENAI_PAD_TOKEN_ID - 1])
def test_a_token_id_outside_the_policys_vocabulary_is_refused_before_any_model_loads(
    token, tiny_assets, data_files, tmp_path, capfd
):
    """A token id the policy's embedding has no row for (>= its vocabulary size; OpenAI's pad id
    50259 is mapped to the pad, so it is allowed) is an index error mid-training today. The
    vocabulary is known once the run has read the policy's config: one line naming the record,
    the key, the id and the vocabulary, exit code 1, no step trained."""
    labels = tmp_path / "bad_labels.json"
    labels.write_text(changed_labels(set_token(5, "sample3", 2, token)))
    out = tmp_path / "out"
    code, stderr = run_main(
        rewards.main, rewards_argv(out, tiny_assets, labels, data_files[1]), capfd
    )
    assert code == 1, stderr[-2000:]
    assert_one_line(
        stderr,
        "--label-source",
        str(labels),
        "record 5's 'sample3'",
        f"token id {token}",
        f"vocabulary of {VOCAB_SIZE} tokens",
    )
    assert trained_steps(out) == []


def query_rows(rows):
    """The bytes of a .jsonl query file holding `rows`."""
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def with_row(rows, index, row):
    """`rows` with row `index` replaced by `row`."""
    rows = copy.deepcopy(rows)
    rows[index] = row
    return rows


# (the query file's bytes, what its one error line says besides the file's name)
QUERY_FILE_FAULTS = {
    "empty file": (b"", ["the file is empty"]),
    "invalid JSON": (b'{"text": "a sentence"\n', ["cannot be read", "JSON"]),
    "invalid UTF-8": (b'{"text": "a sentence"}\n{"text": "ab\xff\xfe"}\n', ["not valid UTF-8"]),
    "no text column": (
        query_rows([{"title": text} for text in tasks.tiny_queries(8, seed=0)]),
        ["no 'text' or 'content' column", "title"],
    ),
    "null text": (query_rows(with_row(valid_query_rows(), 3, {"text": None})), ["row 3", "null"]),
    "null content": (
        query_rows([{"content": None}] + [{"content": text} for text in ["a", "b"]]),
        ["row 0", "'content'", "null"],
    ),
    "texts not strings": (
        query_rows([{"text": number} for number in range(8)]),
        ["'text' must hold strings", "int64"],
    ),
    "every text empty": (query_rows([{"text": ""}] * 40), ["no query in it has any text"]),
}


@pytest.mark.parametrize("fault", QUERY_FILE_FAULTS)
def test_rewards_refuses_a_bad_query_file_in_one_line_before_anything_loads(
    fault, tiny_assets, data_files, tmp_path, capfd
):
    """rewards.py --query-dataset FILE (the normalisation queries): a file that is empty, not
    JSON, not UTF-8, without a text column, with a null text, with texts that are not strings, or
    whose texts are all empty (which trained on empty queries) is refused by check_args: one line
    naming the file and the cause, exit code 2, nothing written."""
    data, words = QUERY_FILE_FAULTS[fault]
    queries = tmp_path / "bad_queries.jsonl"
    queries.write_bytes(data)
    out = tmp_path / "out"
    code, stderr = run_main(
        rewards.main, rewards_argv(out, tiny_assets, data_files[0], queries), capfd
    )
    assert code == 2, stderr[-2000:]
    assert_one_line(stderr, "--query-dataset", str(queries), *words)
    assert not out.exists()


@pytest.mark.parametrize("fault", QUERY_FILE_FAULTS)
def test_ppo_rlhf_refuses_a_bad_query_file_in_one_line_before_the_first_update(
    fault, tiny_assets, tmp_path, capfd
):
    """ppo_rlhf.py --query-dataset FILE: the same faults end the run in its check_args, before any
    model loads (a file behind a URL: where it first reads the queries, rewards.query_texts): one
    line naming the file and the cause, exit code 2, no update trained."""
    data, words = QUERY_FILE_FAULTS[fault]
    queries = tmp_path / "bad_queries.jsonl"
    queries.write_bytes(data)
    out = tmp_path / "out"
    code, stderr = run_main(ppo_rlhf.main, ppo_query_argv(out, tiny_assets, queries), capfd)
    assert code == 2, stderr[-2000:]
    assert_one_line(stderr, "--query-dataset", str(queries), *words)
    assert trained_steps(out) == []


def test_the_shipped_lexicon_labels_pass_with_smollm2s_vocabulary_and_added_pad():
    """The label file that ships with the repository (smol_sentiment's) passes the checks the run
    makes: SmolLM2's 49152 embedding rows (DEVELOPERS.md) and the [PAD] rewards.py adds after them,
    id 49152, which left-pads its queries: the pad id must pass, or every smol_sentiment run
    would be refused."""
    (path,) = (ROOT / "data").glob("lexicon_SmolLM2-135M-Instruct_*.json.gz")
    vocab_size = pad_token_id = 49152
    labels = rewards.load_labels(str(path), vocab_size, pad_token_id)
    assert len(labels) == 1024
    with pytest.raises(ValueError, match="record 0's 'query' holds token id 49152 at position 0"):
        rewards.load_labels(str(path), vocab_size)


# --------------------------------------------------------------------------------------------------
# Round 3 (issue 72): FSDP2's shards, LoRA's adapters and a peer lost inside FSDP2's forwards end
# in one line; nothing is loaded from a path a file names
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def grpo_fsdp2_done(tmp_path_factory):
    """A finished grpo.py tiny run of 2 steps under --sharding fsdp2 in one process (its optimizer
    state saved as shard_rank0.pt)."""
    out = tmp_path_factory.mktemp("faults") / "grpo_fsdp2"
    grpo.main(grpo_argv(out, 2, "--sharding", "fsdp2", "--no-cuda"))
    return out


@pytest.mark.parametrize("fault", ["deleted", "truncated", "another rank's"])
def test_29_a_damaged_optimizer_shard_ends_in_one_line(fault, grpo_fsdp2_done, tmp_path, capfd):
    """An fsdp2 checkpoint whose shard_rank0.pt is gone, cut short or another rank's (its manifest
    rehashed each time: hashes prove nothing about who wrote a file) is refused in one line naming
    the file (before: KeyError 'optimizer', a 154-line traceback, or a resume with the other rank's
    Adam moments)."""
    out = copy_of(grpo_fsdp2_done, tmp_path)
    checkpoint = out / "checkpoint"
    shard = checkpoint / "shard_rank0.pt"
    assert torch.load(shard, weights_only=True)["rank"] == 0  # each shard says whose it is
    if fault == "deleted":
        shard.unlink()
        manifest = json.load(open(checkpoint / harness.MANIFEST))
        del manifest["files"]["shard_rank0.pt"]
        json.dump(manifest, open(checkpoint / harness.MANIFEST, "w"))
        words = ["shard_rank0.pt is missing"]
    elif fault == "truncated":
        shard.write_bytes(shard.read_bytes()[:300])
        rewrite_manifest_entry(checkpoint, "shard_rank0.pt")
        words = ["shard_rank0.pt cannot be read"]
    else:
        state = torch.load(shard, weights_only=True)
        state["rank"] = 1
        torch.save(state, shard)
        rewrite_manifest_entry(checkpoint, "shard_rank0.pt")
        words = ["holds rank 1's optimizer shard, not rank 0's"]
    argv = grpo_argv(out, 3, "--sharding", "fsdp2", "--no-cuda")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, *words)


def test_30_a_lora_checkpoint_is_never_resumed_as_a_whole_model(tmp_path, capfd):
    """A --lora-rank checkpoint holds an adapter beside its pinned base: resumed with --lora-rank 0
    (even with --allow-changed-settings) it is refused in one line, before any model loads (before:
    transformers read the checkpoint's adapter_config.json, loaded the base it names from there,
    and the run ended in "optimizer got an empty parameter list"). A model folder holding an
    adapter is refused by the loader itself: nothing is loaded from a path a file names."""
    out = tmp_path / "lora"
    lora_flags = ["--lora-rank", "4", "--lora-alpha", "8"]
    code, stderr = run_main(grpo.main, grpo_argv(out, 1, *lora_flags), capfd)
    assert code == 0, stderr[-2000:]
    argv = grpo_argv(out, 2, "--lora-rank", "0", "--allow-changed-settings")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 1
    assert_one_line(stderr, "--lora-rank 4", "holds a LoRA adapter")
    with pytest.raises(harness.RunError, match="holds a LoRA adapter") as caught:
        harness.load_model_folder(lambda path: pytest.fail("loaded"), str(out / "checkpoint"))
    assert "\n" not in str(caught.value)


def test_31_unknown_lora_targets_are_refused_before_the_tiny_model_is_built(tmp_path, capfd):
    """--lora-target-modules naming no module of the tiny model (grpo.py) or of the tiny policy
    (ppo_rlhf.py) is refused by check_args, on the meta device: exit code 2, one line, nothing
    built (before: after the tiny model was built and saved, about 10 s)."""
    argv = grpo_argv(tmp_path / "grpo", 1, "--lora-rank", "4", "--lora-target-modules", "nope")
    code, stderr = run_main(grpo.main, argv, capfd)
    assert code == 2
    assert_one_line(stderr, "--lora-target-modules nope")
    assert not (tmp_path / "grpo" / "tiny_model").exists()
    argv = ["tiny", "--output-dir", str(tmp_path / "ppo"), "--lora-rank", "4"]
    code, stderr = run_main(ppo_rlhf.main, [*argv, "--lora-target-modules", "nope"], capfd)
    assert code == 2
    assert_one_line(stderr, "--lora-target-modules nope")
    assert not (tmp_path / "ppo" / "reward_model_run").exists()


def test_32_a_rank_lost_while_fsdp2_samples_ends_the_other_in_one_line(tmp_path):
    """torchrun, 2 processes, --sharding fsdp2: rank 1 is killed (SIGKILL, by itself) in the middle
    of its first rollout, where every new token's forward gathers the shards of both ranks. Rank 0,
    inside that gather, ends in one line saying another rank stopped (its own log: torchrun
    --redirects), no traceback (before: gloo's 49-line "Connection reset by peer")."""
    logs = tmp_path / "logs"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    torchrun += ["2", "--redirects", "3", "--log-dir", str(logs)]
    sizes = ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "4"]
    sizes += ["--ppo-micro-batch-size-per-gpu", "4", "--sharding", "fsdp2"]
    cmd = [*torchrun, str(ROOT / "tests" / "kill_rank1_sampling.py")]
    cmd += [*grpo_argv(tmp_path / "run", 2), *sizes, "--no-cuda"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    (rank0_stderr,) = logs.rglob("attempt_0/0/stderr.log")
    stderr = rank0_stderr.read_text()
    assert_one_line(stderr, "another rank stopped during a collective")


@pytest.fixture(scope="session")
def ppo_fsdp2_done(tmp_path_factory, tiny_assets):
    """A finished ppo_rlhf.py tiny run of 2 updates under --sharding fsdp2 in one process."""
    out = tmp_path_factory.mktemp("faults") / "ppo_fsdp2"
    ppo_rlhf.main(ppo_argv(out, tiny_assets, 2, "--sharding", "fsdp2"))
    return out


@pytest.mark.parametrize("fault", ["shard deleted", "value head of another shape", "lora-rank"])
def test_33_ppo_rlhf_under_fsdp2_and_lora_ends_in_one_line(
    fault, ppo_fsdp2_done, tiny_assets, tmp_path, capfd
):
    """ppo_rlhf.py, probed as grpo.py was: an fsdp2 checkpoint without its shard, a value head of
    another shape (rehashed: before, a traceback from load_state_dict), and a resume that would
    turn an adapter checkpoint into a whole model's (--lora-rank 0) each end in one line."""
    extra = ["--sharding", "fsdp2"]
    if fault == "lora-rank":
        out = tmp_path / "lora"
        lora_flags = ["--lora-rank", "4", "--lora-alpha", "8"]
        code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 1, *lora_flags), capfd)
        assert code == 0, stderr[-2000:]
        extra = ["--lora-rank", "0", "--allow-changed-settings"]
        words = ["--lora-rank 4", "holds a LoRA adapter"]
    else:
        out = copy_of(ppo_fsdp2_done, tmp_path)
        checkpoint = out / "checkpoint"
        (out / "policy").rename(out / "policy_moved")  # so the run resumes to write it again
        if fault == "shard deleted":
            (checkpoint / "shard_rank0.pt").unlink()
            manifest = json.load(open(checkpoint / harness.MANIFEST))
            del manifest["files"]["shard_rank0.pt"]
            json.dump(manifest, open(checkpoint / harness.MANIFEST, "w"))
            words = ["shard_rank0.pt is missing"]
        else:
            torch.save(
                {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}, checkpoint / "value_head.pt"
            )
            rewrite_manifest_entry(checkpoint, "value_head.pt")
            words = ["value_head.pt: not this policy's value head"]
    code, stderr = run_main(ppo_rlhf.main, ppo_argv(out, tiny_assets, 2, *extra), capfd)
    assert code == 1
    assert_one_line(stderr, *words)
