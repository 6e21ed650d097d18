"""trainer/scoring.py on 2 gloo ranks: who calls the reward functions, what every rank gets, and a failure on one rank.

    torchrun --nproc_per_node 2 tests/workers/scoring_worker.py OUT_DIR --tp 2 | --tp 1

``--tp 2``: one replica of both ranks (rank 0 scores); ``--tp 1``: two replicas (each rank scores its own share).
Each rank writes OUT_DIR/rank{r}.json: the calls its reward function got, the totals it received for a batch
scored once, and the error a reward that raises on the last replica's scoring rank alone gave it.
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()

    import torch.distributed as dist

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.parallel.distributed import init_model_parallel
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.grpo.rewards import RewardComputer, RewardFunctionError
    from oumi_megatron.trainer.scoring import ReplicaScorer

    init_model_parallel(engine_layout(MegatronParams(tensor_model_parallel_size=args.tp)))
    rank, world = dist.get_rank(), dist.get_world_size()
    calls: list[int] = []

    def length(completions: list[str], **kwargs: object) -> list[float]:
        calls.append(len(completions))
        return [float(len(c)) + rank / 10 for c in completions]  # which rank scored shows in the value

    last_scorer = 0 if args.tp == 2 else world - 1  # the scoring rank of the last replica

    def raises_on_last_scorer(completions: list[str], **kwargs: object) -> list[float]:
        if rank == last_scorer:
            raise RuntimeError("judge unreachable")
        return [0.0] * len(completions)

    spec = SimpleNamespace(weight=1.0, kwargs={})
    scorer = ReplicaScorer(RewardComputer([SimpleNamespace(name="length", **vars(spec))], functions={"length": length}))
    scored = scorer(["p"] * 3, ["a", "bb", "ccc"], [{"prompt": "p"}] * 3)
    empty = scorer([], [], [])
    failing = ReplicaScorer(RewardComputer([SimpleNamespace(name="judge", **vars(spec))],
                                           functions={"judge": raises_on_last_scorer}))
    error = None
    try:
        failing(["p"] * 2, ["a", "b"], [{"prompt": "p"}] * 2)
    except RewardFunctionError as e:
        error = str(e)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({
        "calls": calls, "totals": scored.total.tolist(), "samples_scored": scorer.samples_scored,
        "empty": len(empty.total), "error": error, "replica": scorer.ranks}))
    dist.barrier()


if __name__ == "__main__":
    main()
