"""The harness every training script runs in: processes, checkpoints and logs.

Nothing here is reinforcement learning; a first read of grpo.py, ppo_rlhf.py or rewards.py can skip
every `harness.` call. The three scripts share this module so that they start, fail, average
gradients, save, resume and log the same way:

    1. command line  parse_args: a preset name and field overrides (tyro); a bad flag is refused in
                     one line (`grpo.py: error: --lr must be > 0, got -1.0`, exit code 2) before any
                     model loads
    2. processes     setup_distributed: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, NCCL on GPUs,
                     gloo on CPUs, and fail fast (a rank that raises ends the job at once; no rank
                     waits in a collective); average_gradients (what DDP does, by hand),
                     reduce_metrics, barrier
    3. checkpoints   save_checkpoint (written to checkpoint.tmp, swapped in with os.replace, every
                     RNG of every rank), find_checkpoint, load_checkpoint (restores this rank's RNG:
                     python, numpy, torch, CUDA)
    4. logs          start_logs: the rerun rule (below), args.json, metrics.jsonl and samples.jsonl
                     (one flushed JSON line per row, written by rank 0), and wandb with --track

The rerun rule, the same for every script. Rerunning a command with the same --output-dir either
resumes (there is a checkpoint: the rows a killed run logged after it move to
metrics.jsonl.discarded, never deleted) or starts afresh (no checkpoint: the earlier run's
metrics.jsonl, samples.jsonl and args.json move to previous_run_<N>/, never appended to). Only logs
move; a model or reward model that a later run reuses stays where it is.
"""

import dataclasses
import json
import os
import random
import shutil
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

CHECKPOINT = "checkpoint"  # <output_dir>/checkpoint: the latest complete checkpoint
TRAINER_STATE = "trainer_state.pt"  # step, optimizer and the script's own state, written by rank 0
LOG_FILES = ("metrics.jsonl", "samples.jsonl", "args.json")  # what a fresh start moves aside


# --------------------------------------------------------------------------------------------------
# 1. The command line
# --------------------------------------------------------------------------------------------------


def parse_args(script, presets, check_args, argv=None):
    """`python SCRIPT.py PRESET [--field value ...]`: tyro builds the Args of the preset with the
    overrides, then check_args(args, world_size) runs every check that needs no model. Its
    ValueError becomes one line on stderr and exit code 2 (argparse's convention; tyro's own parse
    errors exit 2 too, in tyro's boxed format)."""
    import tyro

    args = tyro.extras.overridable_config_cli(presets, args=argv)
    try:
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"{script}: error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    return args


# --------------------------------------------------------------------------------------------------
# 2. Processes: torchrun + torch.distributed, fail fast
# --------------------------------------------------------------------------------------------------


def fail_fast_excepthook(kind, value, tb):
    """Under torchrun an uncaught error ends this rank at once (os._exit skips atexit handlers, such
    as vLLM's shutdown, that could wait on the other ranks); torchrun then stops the ranks left in a
    collective, so none waits for NCCL's 10-minute timeout."""
    traceback.print_exception(kind, value, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def setup_distributed(use_cuda=True):
    """(rank, world_size, device). Under torchrun (WORLD_SIZE > 1) the default process group is
    created, or reused if the caller made it (ppo_rlhf.py calls rewards.train inside its own run).
    use_cuda=False (--no-cuda) keeps every rank on the CPU even where a GPU exists (the exact fp32
    tests)."""
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
        # after init_process_group: torch installs a hook of its own there, which captures stderr
        # while it calls the previous hook; ours exits inside, so its traceback would be lost
        sys.excepthook = fail_fast_excepthook
    return rank, world_size, device


def distributed():
    """True under torchrun with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier():
    """Wait for every rank (nothing to wait for in a single process)."""
    if distributed():
        dist.barrier()


def end_processes(world_size):
    """Under torchrun, destroy the default process group (after the last collective). In a single
    process a group can only be vLLM's own (it makes one of size 1), which the engine's close()
    ends."""
    if world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed):
    """Python's, numpy's and torch's global RNGs (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def average_gradients(parameters, world_size):
    """What DDP does during backward, by hand, once per optimizer step: every rank's p.grad becomes
    the mean of the ranks' gradients (the parameters come in the same order on every rank)."""
    if world_size > 1:
        for p in parameters:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)


def all_sum(tensor):
    """The sum of a tensor over the ranks (a copy; the tensor itself in a single process)."""
    if distributed():
        tensor = tensor.clone()
        dist.all_reduce(tensor)
    return tensor


def all_gather_cat(tensor):
    """1-D tensors of the same length on every rank -> their concatenation, rank by rank."""
    if distributed():
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor.contiguous())
        return torch.cat(gathered)
    return tensor


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
        dist.all_reduce(values, op=ops[op])  # gloo has no AVG: a sum, divided below
        if op == "mean":
            values /= world_size
        out.update(zip(names, values.tolist()))
    return out


def rank_checksum_spread(parameters, world_size):
    """The largest difference between ranks of float64 checksums (sum, sum of squares) of the
    parameters: 0.0 when the averaged gradients kept every rank's parameters identical
    (debug/rank_param_checksum_max_diff)."""
    params = [p.detach().double() for p in parameters]
    checksum = torch.stack([sum(p.sum() for p in params), sum(p.square().sum() for p in params)])
    gathered = [checksum.clone() for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(gathered, checksum)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


# --------------------------------------------------------------------------------------------------
# 3. Checkpoints: atomic, with every RNG of every rank
# --------------------------------------------------------------------------------------------------


def rng_state():
    """This process's RNG states: python, numpy, torch's CPU generator and every CUDA device's."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state):
    """Put back what rng_state() returned (the CUDA states only where CUDA is there)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_checkpoint(output_dir, resume_from=None):
    """--resume-from, else <output_dir>/checkpoint, else <output_dir>/checkpoint.old (what a crash
    during the swap of save_checkpoint leaves), else None: a fresh start."""
    if resume_from:
        candidates = [resume_from]
    else:
        candidates = [
            os.path.join(output_dir, CHECKPOINT),
            os.path.join(output_dir, CHECKPOINT + ".old"),
        ]
    return next((p for p in candidates if os.path.isfile(os.path.join(p, TRAINER_STATE))), None)


def save_checkpoint(output_dir, rank, write_files, trainer_state):
    """Write <output_dir>/checkpoint, every rank together. Rank 0 calls write_files(folder) (the
    model, the tokenizer, ...) and saves trainer_state (a dict: step, optimizer, ...) as
    trainer_state.pt; every rank saves its own RNG states as rng_rank<r>.pt, so a resume continues
    every rank's random stream exactly.

    Atomic: everything goes to checkpoint.tmp, which replaces checkpoint with os.replace
    (checkpoint.old exists only during the swap), so a crash at any moment leaves one complete
    checkpoint."""
    path = os.path.join(output_dir, CHECKPOINT)
    tmp, old = path + ".tmp", path + ".old"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    barrier()
    if rank == 0:
        write_files(tmp)
        torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE))
        # complete: only os.replace creates it; a checkpoint.old beside it is stale
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_checkpoint(path, rank):
    """The trainer_state dict of a checkpoint; this rank's RNG states are restored from
    rng_rank<r>.pt. The script loads its model from the same folder itself."""
    rng_path = os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.isfile(rng_path):
        raise ValueError(
            f"{rng_path} is missing: this checkpoint was written by fewer ranks (or before every "
            f"rank saved its RNG), so it cannot resume rank {rank} exactly"
        )
    state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=False)
    set_rng_state(torch.load(rng_path, weights_only=False))
    return state


# --------------------------------------------------------------------------------------------------
# 4. Logs: the rerun rule, args.json, metrics.jsonl, samples.jsonl, wandb
# --------------------------------------------------------------------------------------------------


def move_rows_after(path, step):
    """On resume: the rows a killed run logged after its checkpoint's step (the resumed run logs
    them again) move from path to <path>.discarded, never deleted."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    later = [json.loads(line).get("step", 0) > step for line in lines]
    if any(later):
        with open(path + ".discarded", "a") as f:
            f.writelines(line for line, is_later in zip(lines, later) if is_later)
        with open(path, "w") as f:
            f.writelines(line for line, is_later in zip(lines, later) if not is_later)


def move_previous_run_aside(output_dir):
    """A fresh start in a folder an earlier run logged into: its metrics.jsonl, samples.jsonl and
    args.json (and their .discarded rows) move to <output_dir>/previous_run_<N>/, N = 1, 2, ...;
    returns that folder, or None."""
    names = [n for n in os.listdir(output_dir) if n.removesuffix(".discarded") in LOG_FILES]
    if not names:
        return None
    n = 1
    while os.path.exists(os.path.join(output_dir, f"previous_run_{n}")):
        n += 1
    folder = os.path.join(output_dir, f"previous_run_{n}")
    os.makedirs(folder)
    for name in names:
        os.replace(os.path.join(output_dir, name), os.path.join(folder, name))
    return folder


class RunLog:
    """Rank 0's metrics.jsonl and samples.jsonl (one JSON line per row, flushed at once, so a crash
    loses nothing) and the wandb run (--track). On every other rank each method does nothing, so the
    scripts call it everywhere."""

    def __init__(self, output_dir, enabled, wandb_run=None):
        self.enabled, self.wandb_run = enabled, wandb_run
        self.metrics_file = (
            open(os.path.join(output_dir, "metrics.jsonl"), "a") if enabled else None
        )
        self.samples_path = os.path.join(output_dir, "samples.jsonl")

    def metrics(self, row):
        """One row of metrics.jsonl; row["step"] is the x of every curve (and wandb's step)."""
        if self.enabled:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
            if self.wandb_run is not None:
                self.wandb_run.log(row, step=row["step"])

    def samples(self, rows):
        """A few rows of what the policy wrote (each with a "step") to samples.jsonl, and a wandb
        Table."""
        if self.enabled and rows:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            if self.wandb_run is not None:
                import wandb

                table = wandb.Table(
                    columns=list(rows[0]), data=[list(row.values()) for row in rows]
                )
                self.wandb_run.log({"samples": table}, step=rows[0]["step"])

    def close(self):
        if self.enabled:
            self.metrics_file.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()


def start_logs(args, script, rank, world_size, resume_step=None):
    """The logs of a run that starts (resume_step None) or resumes after step resume_step, by the
    rerun rule (see the module docstring); rank 0 writes args.json (the script, the world size and
    every field of args) and, with
    --track, opens the wandb run (its files under <output_dir>/wandb). Returns a RunLog."""
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
            for name in ("metrics.jsonl", "samples.jsonl"):
                move_rows_after(os.path.join(args.output_dir, name), resume_step)
        config = {"script": script, "world_size": world_size, **dataclasses.asdict(args)}
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(config, f, indent=2)
        if args.track:
            import wandb

            wandb_run = wandb.init(
                project=args.wandb_project,
                entity=args.wandb_entity,
                name=f"{args.exp_name}__{args.seed}__{int(time.time())}",
                config=config,
                dir=args.output_dir,
            )
    return RunLog(args.output_dir, enabled=rank == 0, wandb_run=wandb_run)
