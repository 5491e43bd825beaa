"""A run is never lost and never silently wrong: every broken file, full disk or bad value ends in one
line naming the cause (no traceback), before any training step, and what was on disk is kept.

One row of the fault table per test, on the tiny presets: grpo.py's and ppo_rlhf.py's checkpoints are
built once per test session (two short runs) and each test breaks a copy. The scripts run in this
process through their main(argv), as on the command line; the SIGKILL and torchrun tests run them as
processes. Budget: ~60 s on 2 cores.
"""

import dataclasses
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
    deadline = time.time() + 20
    while live_processes_with(str(out)) and time.time() < deadline:
        time.sleep(0.2)
    assert live_processes_with(str(out)) == []  # no orphan rank runs on
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
    checkpoint, exit 143; the rerun under torchrun resumes and ends with identical ranks."""
    out = tmp_path / "ddp"
    command = [*TORCHRUN, "grpo.py", *grpo_argv(out, 8, *DDP_SIZES, save_every=100)]
    code, stderr = stop_with_a_signal(command, out, 2, signal.SIGTERM)
    assert code != 0
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
