"""Asynchronous rollouts (grpo.py --async-rollouts, rollout.AsyncRollouts): a producer thread that
samples step t with the weights after update t - K while the trainer trains. Asynchrony changes the
timing, never the numbers: K = 1 and 2 equal the simulated lag (--rollout-staleness K) bit for bit,
rows and weights; the producer samples each batch with the version it is owed (a hand-built model
whose weight counts its updates); in-flight updates record each token's own version's logprob; the
staleness bound drops a batch too old (free-running); a SIGKILLed or SIGTERMed run resumes to the
uninterrupted end, also under 2 processes; a producer that fails ends the run in one line; what the
producer cannot share is refused. Budget: ~135 s (132 s measured alone, 2 cores)."""

import copy
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
import logprobs  # noqa: E402
import rollout  # noqa: E402
from tolerances import EPS32, assert_float32_close  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
# grpo.py tiny, small: 8 prompts x 8 samples per step, two optimizer steps of 4 prompts, 10 steps
SMALL = ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "8"]
SMALL += ["--train-size", "64", "--log-samples-every", "0", "--val-every", "5"]
SMALL += ["--total-steps", "10"]


def run_grpo(out, *extra):
    """grpo.py tiny, small, as a user starts it (its own process: the producer is a thread)."""
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), *SMALL, *extra]
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def rows(out, keep_async=False):
    """The logged rows without their timings (what asynchrony may change) and, unless keep_async,
    the producer's own async/ metrics (which a run without one does not log)."""
    dropped = ("timing/",) if keep_async else ("timing/", "async/")
    with open(out / "metrics.jsonl") as f:
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(dropped)} for line in f
        ]


def wait_for_rows(process, metrics, rows_wanted, timeout=300):
    """Wait until `metrics` (a run's metrics.jsonl) holds rows_wanted rows or the process ends."""
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows_wanted:
            return
        time.sleep(0.02)


def weights(out):
    from safetensors.torch import load_file

    return load_file(out / "checkpoint" / "model.safetensors")


def same_weights(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def async_k2(tmp_path_factory):
    """--async-rollouts --max-staleness 2, uninterrupted (saving every 3 steps)."""
    out = tmp_path_factory.mktemp("async") / "k2"
    return run_grpo(out, "--async-rollouts", "--max-staleness", "2", "--save-every", "3")


@pytest.mark.parametrize("k", [1, 2])
def test_async_rollouts_equal_the_simulated_lag_bit_for_bit(k, async_k2, tmp_path):
    """10 steps: every logged number but the timings and every final weight are the ones of
    --rollout-staleness K, which samples step t with the weights after update t - K too, one step
    after another."""
    if k == 2:
        asynchronous = async_k2
    else:
        asynchronous = run_grpo(tmp_path / "async", "--async-rollouts", "--max-staleness", "1")
    lagged = run_grpo(tmp_path / "lag", "--rollout-staleness", str(k))
    assert len(rows(lagged)) == 11  # step 0's validation and 10 steps
    assert rows(asynchronous) == rows(lagged)
    assert same_weights(weights(asynchronous), weights(lagged))
    # every batch was sampled K updates behind the trainer (fewer while t < K)
    ages = [row["async/oldest_version_age"] for row in rows(asynchronous, True) if row["step"]]
    assert ages == [min(step, k) for step in range(10)]
    # and the lag is real: the on-policy run differs
    on_policy = run_grpo(tmp_path / "sync") if k == 1 else None
    if on_policy is not None:
        assert rows(on_policy)[2] != rows(lagged)[2]


def torchrun_grpo(out, *flags, check=True):
    """grpo.py tiny, small, 6 steps, under torchrun with 2 processes."""
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), *SMALL, *flags]
    argv += ["--total-steps", "6", "--ppo-micro-batch-size-per-gpu", "8"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    return [*torchrun, "2", *argv]


def test_async_rollouts_under_two_processes_equal_the_lag_and_resume_per_rank(tmp_path):
    """torchrun, 2 processes (each rank its own producer), K = 1, 6 steps: the rows and the final
    weights of --rollout-staleness 1; the same async run killed with SIGKILL after its 4th row and
    rerun ends there too (each rank resumes with its own batches sampled ahead)."""
    runs = {}
    for name, flags in (
        ("async", ["--async-rollouts", "--max-staleness", "1"]),
        ("lag", ["--rollout-staleness", "1"]),
    ):
        runs[name] = tmp_path / name
        done = subprocess.run(
            torchrun_grpo(runs[name], *flags),
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(rows(runs["lag"])) == 7
    assert rows(runs["async"]) == rows(runs["lag"])
    assert same_weights(weights(runs["async"]), weights(runs["lag"]))
    out = tmp_path / "killed"
    flags = ["--async-rollouts", "--max-staleness", "1", "--save-every", "2"]
    process = subprocess.Popen(
        torchrun_grpo(out, *flags),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = out / "metrics.jsonl"
    wait_for_rows(process, metrics, 4)
    process.send_signal(signal.SIGKILL)  # the launcher: its ranks stop within a second
    process.wait()
    time.sleep(2)
    assert len(metrics.read_text().splitlines()) < 7
    done = subprocess.run(
        torchrun_grpo(out, *flags), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert rows(out) == rows(runs["async"])
    assert same_weights(weights(out), weights(runs["async"]))


def test_an_async_run_is_not_extended_past_its_last_step(async_k2, tmp_path):
    """Its last checkpoint holds no batch sampled ahead, so a rerun with more steps is refused in
    one line (before any model loads)."""
    out = tmp_path / "extended"
    shutil.copytree(async_k2, out)
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), *SMALL]
    argv += ["--async-rollouts", "--max-staleness", "2", "--save-every", "3", "--total-steps", "12"]
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "total_steps" in last.replace("-", "_"), done.stderr[-2000:]


@pytest.mark.parametrize("mode", ["k2", "in_flight"])
def test_a_sigkilled_async_run_resumes_to_the_uninterrupted_end(mode, async_k2, tmp_path):
    """Killed with SIGKILL after its 5th row, then rerun: every row and the final weights equal the
    uninterrupted run's. K = 2: the checkpoint at step 3 holds the batches of steps 4 and 5,
    sampled with versions 2 and 3, older than its weights; in-flight updates (K = 1): step 4's
    batch, whose first tokens came from version 3."""
    k = 2 if mode == "k2" else 1
    flags = ["--async-rollouts", "--max-staleness", str(k), "--save-every", "3"]
    if mode == "in_flight":
        flags.append("--in-flight-updates")
        uninterrupted = run_grpo(tmp_path / "uninterrupted", *flags)
    else:
        uninterrupted = async_k2
    out = tmp_path / "killed"
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), *SMALL, *flags]
    process = subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL
    )
    metrics = out / "metrics.jsonl"
    wait_for_rows(process, metrics, 6)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(metrics.read_text().splitlines()) < 11  # killed before the end
    state = harness.load_checkpoint(out / "checkpoint", 0)
    queued = sorted(state["rollout_queue"][0])  # rank 0's
    assert state["step"] >= 3 and queued == list(range(state["step"], state["step"] + k))
    run_grpo(out, *flags)
    assert rows(out, keep_async=True) == rows(uninterrupted, keep_async=True)
    assert same_weights(weights(out), weights(uninterrupted))


def test_sigterm_with_the_producer_running_saves_and_the_rerun_ends_as_uninterrupted(
    async_k2, tmp_path
):
    """SIGTERM while the producer samples ahead: the step in progress ends, the checkpoint holds the
    batches sampled ahead, one line says so and the exit code is 143; a copy resumed with another
    --max-staleness is refused in one line; the rerun then ends with the uninterrupted run's rows
    and weights."""
    out = tmp_path / "stopped"
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), *SMALL]
    argv += ["--async-rollouts", "--max-staleness", "2", "--save-every", "3"]
    process = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    metrics = out / "metrics.jsonl"
    wait_for_rows(process, metrics, 3)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=300)[1].decode()
    assert process.returncode == 143, stderr[-2000:]
    stopped = [line for line in stderr.splitlines() if line.startswith("grpo.py: stopped by")]
    assert len(stopped) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert len(metrics.read_text().splitlines()) < 11
    # the same checkpoint resumed with another K: its queued batches are not this run's, refused in
    # one line (before: the producer waited for weights a resume never holds, and so did the run)
    other_k = tmp_path / "other_k"
    shutil.copytree(out, other_k)
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(other_k), *SMALL]
    argv += ["--async-rollouts", "--max-staleness", "1", "--allow-changed-settings"]
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "--max-staleness 1 owes it" in last, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    run_grpo(out, "--async-rollouts", "--max-staleness", "2", "--save-every", "3")
    assert rows(out) == rows(async_k2)
    assert same_weights(weights(out), weights(async_k2))


class CountingEngine:
    """A stand-in engine for a model whose one weight counts the updates done: generate returns the
    weight it samples with, and generate_in_flight the weight of every chunk (each after
    before_chunk(c), which may load another version)."""

    def __init__(self, model):
        self.model = model

    def sync_weights(self, model):
        self.weight = model.weight.item()

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed):
        return self.weight

    def generate_in_flight(self, prompts, n, max_new_tokens, temperature, seed, chunk, before):
        weights = []
        for c in range(0, max_new_tokens, chunk):
            before(c // chunk)
            weights.append(self.weight)
        return weights


def counting_model():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    return model


def sample_with(record):
    """A producer's sample(step, engine) that records the step and calls the engine once."""

    def sample(step, engine):
        record.append(step)
        return engine.generate([[0]], 1, 3, 1.0, step)

    return sample


@pytest.mark.parametrize("way", ["engine", "lagged copy", "producer"])
def test_one_rollout_source_for_every_way_of_sampling(way):
    """rollout.RolloutSource, what train() calls whichever way a batch is sampled, on a model whose
    weight counts its updates: take(t) samples with the weights after update t (the engine synced
    at every publish), t - 2 (--rollout-staleness 2: a lagged copy) or t - 2 sampled ahead
    (--async-rollouts --max-staleness 2: a producer thread); validation_engine always holds the
    trainer's current weights; checkpoint_state keeps what a resume needs (the producer's batches
    sampled ahead, the lagged copy's older weights); a resume with them samples as the
    uninterrupted run; close() closes the engine it built and stops the producer."""
    from types import SimpleNamespace

    closed = []

    class Engine(CountingEngine):
        def close(self):
            closed.append(self)

    def sample(step, engine):
        # (prompt indices, rollout: response ids first, metrics), as grpo.sample_step returns
        return [step], ([[5, 6]], engine.generate([[0]], 1, 2, 1.0, step)), {"step": step}

    args = SimpleNamespace(
        rollout_staleness=2 if way == "lagged copy" else 0,
        async_rollouts=way == "producer",
        max_staleness=2,
        total_steps=6,
        in_flight_updates=False,
        in_flight_chunk_tokens=2,
        async_free_running=False,
    )
    model = counting_model()
    source = rollout.RolloutSource(model, Engine, sample, args)
    sampled_with, validated_with, saved_after = [], [], {}
    for step in range(args.total_steps):
        indices, (responses, weight), metrics = source.take(step)
        assert indices == [step] and metrics["step"] == step
        sampled_with.append(weight)
        with torch.no_grad():
            model.weight.add_(1.0)  # update step + 1
        source.publish(model, step + 1)
        with source.validation_engine(model) as engine:
            validated_with.append(engine.generate([[0]], 1, 2, 0.0, 0))
        saved = source.checkpoint_state(step + 1)
        saved_after[step + 1] = saved
        if way == "producer":  # the batches sampled ahead, rank 0's at index 0
            ahead = [t for t in (step + 1, step + 2) if t < args.total_steps]
            assert list(saved) == ["rollout_queue"] and sorted(saved["rollout_queue"][0]) == ahead
        elif way == "lagged copy":  # the weights after updates step - 1 and step (or fewer)
            versions = [[float(v)] for v in range(max(0, step - 1), step + 1)]
            assert [[t.item() for t in v.values()] for v in saved["lagged_weights"]] == versions
        else:
            assert saved == {}
    lag = 0 if way == "engine" else 2
    assert sampled_with == [float(max(0, t - lag)) for t in range(6)]
    assert validated_with == [float(t + 1) for t in range(6)]
    if way == "producer":
        assert metrics["async/oldest_version_age"] == 2
    source.close()
    assert closed == [source.engine]
    if way == "producer":
        assert not source.producer.thread.is_alive()
    # a resume after update 4 with what the checkpoint then held samples steps 4 and 5 as above
    resumed_model = counting_model()
    with torch.no_grad():
        resumed_model.weight.fill_(4.0)
    resumed = rollout.RolloutSource(
        resumed_model, Engine, sample, args, first_step=4, saved=saved_after[4]
    )
    for step in (4, 5):
        assert resumed.take(step)[1][1] == sampled_with[step]
        with torch.no_grad():
            resumed_model.weight.add_(1.0)
        resumed.publish(resumed_model, step + 1)
    resumed.close()
    # an engine the caller passed in is the caller's to close
    passed_in = Engine(model)
    source = rollout.RolloutSource(
        model, Engine, sample, without_lag_or_producer(args), engine=passed_in
    )
    source.close()
    assert passed_in not in closed


def without_lag_or_producer(namespace):
    """A copy of a SimpleNamespace of flags without the lag or the producer."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(namespace), "rollout_staleness": 0, "async_rollouts": False})


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_producer_samples_each_step_with_the_version_it_is_owed(k):
    """A model whose weight is the number of updates done: step t is sampled with weight max(0, t -
    K), and the producer runs ahead of the trainer by at most K + 1 batches."""
    model = counting_model()
    ahead = []
    producer = rollout.AsyncRollouts(model, CountingEngine, sample_with(ahead), 0, 8, k)
    for step in range(8):
        versions, sampled_with = producer.take(step)
        assert versions == [sampled_with] == [max(0, step - k)]
        # batch t waits for version t - K, and version step + 1 is not out yet: batch step + K + 1
        # may have begun (it waits in its sample), none after it
        assert max(ahead) <= step + k + 1
        with torch.no_grad():
            model.weight.add_(1.0)  # the update of this step
        producer.publish(model, step + 1)
    producer.thread.join(timeout=10)
    assert not producer.thread.is_alive() and ahead == list(range(8))


def test_in_flight_updates_move_to_the_next_version_between_chunks():
    """--in-flight-updates, K = 1, one token per chunk, 3 tokens: step t's first token is sampled
    with version t - 1 and the others with version t (what the trainer holds when it takes the
    batch); a response of 3 tokens spans 2 versions, the oldest one update old."""
    model = counting_model()
    producer = rollout.AsyncRollouts(model, CountingEngine, sample_with([]), 0, 5, 1, token_chunk=1)
    for step in range(5):
        versions, per_chunk = producer.take(step)
        assert versions == per_chunk == [max(0, step - 1), step, step]
        with torch.no_grad():
            model.weight.add_(1.0)
        producer.publish(model, step + 1)
    engine = rollout.VersionedEngine(producer, 4)
    engine.versions = [3, 4, 4]
    metrics = engine.version_metrics([[5, 6, 7], [5]])
    assert metrics == {
        "async/oldest_version_age": 1,
        "async/versions_per_sequence": 1.5,
        "async/dropped_batches": 0,
    }


def test_a_free_running_run_stays_within_the_bound(tmp_path):
    """--async-free-running --max-staleness 2 with in-flight updates, 10 steps: it runs to the end,
    and no batch the trainer kept is more than 2 updates old (which version sampled what depends on
    the timing, so nothing more is asserted)."""
    out = run_grpo(
        tmp_path / "free",
        "--async-rollouts",
        "--async-free-running",
        "--max-staleness",
        "2",
        "--in-flight-updates",
    )
    ages = [row["async/oldest_version_age"] for row in rows(out, True) if row["step"]]
    assert len(ages) == 10 and max(ages) <= 2


def test_the_staleness_bound_drops_a_batch_older_than_k_and_samples_it_again():
    """Free-running, K = 2: step 3's batch started at version 0 and finished at version 3 (a
    checkpoint's queue, built by hand); the trainer, at version 3, takes it 3 updates stale, drops
    it and gets it sampled again with the newest version (3). A batch 2 updates stale is kept."""
    model = counting_model()
    with torch.no_grad():
        model.weight.fill_(3.0)
    sampled = []
    queue = {3: ([0, 1, 2, 3], "sampled from version 0 to 3"), 4: ([2, 3], "two updates old")}
    producer = rollout.AsyncRollouts(
        model, CountingEngine, sample_with(sampled), 3, 5, 2, queue, free_running=True
    )
    assert producer.take(3) == ([3], 3.0)
    assert producer.dropped == 1 and sampled == [3]
    with torch.no_grad():
        model.weight.add_(1.0)
    producer.publish(model, 4)
    assert producer.take(4) == ([2, 3], "two updates old")
    producer.thread.join(timeout=10)
    assert not producer.thread.is_alive() and sampled == [3]


def test_in_flight_logprobs_are_each_token_s_own_version_s_and_the_is_weights_use_it():
    """A hand-built swap after token 2: HFBackend.generate_in_flight samples tokens 0-1 with weights
    W0 and the rest with W1 (chunks of 2 tokens). Every recorded logprob equals a teacher-forced
    recompute with its own version's weights (fp32: 128 eps32 of the largest |logprob|, sums in
    another order: generate's cached forwards); decoupled token IS against pi_old = W1
    then weights tokens 0-1 by pi_W1 / pi_W0 and the later tokens by 1."""
    import corrections
    import tasks

    w0, tokenizer = tasks.build_tiny_model(arch="gpt2", seed=0, max_positions=64)
    w1, _ = tasks.build_tiny_model(arch="gpt2", seed=1, max_positions=64)
    engine = rollout.HFBackend(copy.deepcopy(w0), tokenizer.eos_token_id, tokenizer.pad_token_id)
    loaded = []

    def before_chunk(c):  # the swap: version 1 from the second chunk on
        if c == 1:
            engine.model.load_state_dict(w1.state_dict())
        loaded.append(0 if c == 0 else 1)

    prompts = [tokenizer("abc=")["input_ids"], tokenizer("dd=")["input_ids"]]
    responses, recorded, _ = engine.generate_in_flight(prompts, 4, 6, 1.0, 7, 2, before_chunk)
    assert loaded[:2] == [0, 1] and max(len(r) for r in responses) > 2
    prompt_rows = [p for p in prompts for _ in range(4)]
    batch = rollout.make_batch(prompt_rows, responses, recorded, tokenizer.pad_token_id, 6, "cpu")
    settings = logprobs.LogprobSettings(temperature=1.0)
    under = {v: logprobs.response_logprobs(m, batch, settings)[0] for v, m in ((0, w0), (1, w1))}
    mask = batch["response_mask"]
    version = (torch.arange(6) >= 2).long().expand_as(mask)  # token j: chunk j // 2's version
    own = torch.where(version == 0, under[0], under[1])
    assert_float32_close(own * mask, batch["rollout_logprobs"] * mask, terms=128)
    # the recompute with one version alone would not give them back
    assert ((under[1] - batch["rollout_logprobs"]) * mask)[:, :2].abs().max() > 1e-2
    config = corrections.RolloutCorrection.from_name("decoupled_token_is")
    is_weights, _, _ = corrections.apply_rollout_correction(
        under[1], batch["rollout_logprobs"], mask, config
    )
    expected = torch.where(version == 0, (under[1] - under[0]).exp().clamp(max=2.0), 1.0)
    # the weights carry both logprobs' rounding (128 eps32 of the largest |logprob| each, as above)
    # times the weight itself (at most 2, the clamp)
    logprob_bound = 128 * EPS32 * batch["rollout_logprobs"].abs().max()
    assert ((is_weights - expected) * mask).abs().max() <= 2 * 2 * logprob_bound


def test_a_resumed_producer_hands_over_its_queued_batches_first():
    """Resumed at step 4 with K = 2: steps 4 and 5 come from the checkpoint's queue (sampled with
    versions 2 and 3), step 6 is the first the producer samples, with the saved weights (version
    4)."""
    model = counting_model()
    with torch.no_grad():
        model.weight.fill_(4.0)
    sampled = []
    queue = {4: ([2], 2.0), 5: ([3], 3.0)}
    producer = rollout.AsyncRollouts(model, CountingEngine, sample_with(sampled), 4, 7, 2, queue)
    assert producer.take(4) == ([2], 2.0) and producer.take(5) == ([3], 3.0)
    assert producer.take(6) == ([4], 4.0)
    assert sampled == [6]


def ends_within(seconds, function):
    """Run function() in a thread and return what it raised (None: it returned); fail if it still
    runs after `seconds` (a wait without end, which today's code must never have)."""
    import threading

    outcome = {}

    def run():
        try:
            function()
        except BaseException as error:  # what the caller checks
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return outcome.get("error")


@pytest.mark.parametrize(
    "queue, named",
    [
        ({4: ([2], 2.0), 5: ([3], 3.0)}, "versions [2], not the [3]"),  # a K = 2 queue, K = 1 here
        ({5: ([3], 3.0)}, "steps [5], not"),  # the right batch under another step number
    ],
    ids=["another_k", "other_steps"],
)
def test_a_resume_with_a_queue_this_run_cannot_use_ends_in_one_line(queue, named):
    """Resumed at step 4 with K = 1: a queue of batches another --max-staleness sampled, or of other
    steps, is refused in one line when the producer starts, not waited for (before, the producer
    asked for a version a resume never holds and both threads waited for good)."""
    model = counting_model()
    with torch.no_grad():
        model.weight.fill_(4.0)

    def resume_and_take():
        producer = rollout.AsyncRollouts(model, CountingEngine, sample_with([]), 4, 7, 1, queue)
        for step in (4, 5, 6):
            producer.take(step)

    error = ends_within(20, resume_and_take)
    assert isinstance(error, harness.RunError) and named in str(error), error
    assert "\n" not in str(error)


def test_waits_that_cannot_end_end_in_one_line():
    """No wait without end: the producer asked for a version older than every one it holds gets a
    RunError at once (a resume never holds those); a trainer waiting for a batch while the
    producer waits for work it will never get (free-running at K = 0, which --max-staleness
    refuses) ends in a RunError naming both waits, within a second."""
    model = counting_model()
    producer = rollout.AsyncRollouts(model, CountingEngine, sample_with([]), 3, 6, 0)
    error = ends_within(10, lambda: producer.load(1))
    assert isinstance(error, harness.RunError) and "version 1" in str(error), error
    producer.close()
    stuck = rollout.AsyncRollouts(
        model, CountingEngine, sample_with([]), 0, 4, 0, free_running=True
    )
    error = ends_within(10, lambda: stuck.take(0))
    assert isinstance(error, harness.RunError) and "neither can go on" in str(error), error
    stuck.close()


def test_a_signal_ends_a_trainer_that_waits_for_its_batch():
    """SIGTERM while take() waits for a batch the producer is still sampling: the wait ends at once
    in a harness.Stopped (one line, exit code 143 from harness.run), the checkpoint before it
    standing; before, the run printed "stopping at the end of this step" and waited."""
    import threading

    release = threading.Event()

    def slow_sample(step, engine):
        release.wait(30)
        return engine.generate([[0]], 1, 3, 1.0, step)

    producer = rollout.AsyncRollouts(counting_model(), CountingEngine, slow_sample, 0, 4, 1)
    harness.catch_stop_signals()
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        error = ends_within(10, lambda: producer.take(0))
    finally:
        harness.restore_signals()
        release.set()
        producer.close()
    assert isinstance(error, harness.Stopped) and error.exit_code == 143, error
    assert "waited for its rollout batch" in str(error)


def test_a_failing_producer_ends_the_run_in_one_line():
    """An error inside the producer thread reaches the trainer at its next take(): a RunError naming
    the step and the error's first line."""

    def sample(step, engine):
        if step == 1:
            raise RuntimeError("probability tensor contains inf\nmore detail")
        return engine.generate([[0]], 1, 1, 1.0, step)

    producer = rollout.AsyncRollouts(counting_model(), CountingEngine, sample, 0, 4, 1)
    assert producer.take(0) == ([0], 0.0)
    with pytest.raises(harness.RunError) as caught:
        producer.take(1)
    assert str(caught.value) == (
        "the rollout producer failed before step 2: RuntimeError: probability tensor contains inf"
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--rollout-staleness", "1"], "--rollout-staleness"),
        (["--policy-loss", "clip_cov"], "--policy-loss"),
        (["--adv-estimator", "remax"], "--adv-estimator"),
        (["--max-staleness", "-1"], "--max-staleness"),
        (["--gradient-checkpointing"], "--gradient-checkpointing"),
        (["--compile-layers"], "--compile-layers"),
        (["--val-temperature", "1.0"], "--val-temperature"),
        (["--in-flight-updates", "--max-staleness", "2"], "--max-staleness"),
        (["--dynamic-sampling"], "--dynamic-sampling"),
        (["--backend", "vllm", "--vllm-sleep-mode"], "--vllm-sleep-mode"),
        (["--async-free-running", "--max-staleness", "0"], "--max-staleness"),
    ],
)
def test_what_the_producer_cannot_share_is_refused_in_one_line(
    flags, named, capsys, monkeypatch, tmp_path
):
    """Each ends in `grpo.py: error: --flag ...` and exit status 2, before any model loads."""
    import transformers

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("a model was loaded before the bad flag was refused"),
    )
    argv = ["tiny", "--async-rollouts", "--output-dir", str(tmp_path / "run"), *flags]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert err[0].startswith("grpo.py: error: " + named), err
