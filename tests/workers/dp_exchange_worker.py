"""What a rank receives when a step's rollouts are dealt to the DP ranks that train on them, as DP grows.

    torchrun --nproc-per-node 4 tests/workers/dp_exchange_worker.py OUT.json

A global batch of 48 rollouts (a 1,000-token completion each, as trainer/collection.py carries them) is generated
round-robin over the DP ranks (rollout i on rank i % DP) and trained contiguously (rank k owns its share,
i // (48 / DP) == k), which is how dynamic sampling re-deals the groups it keeps. Each rank reports, as JSON lines in
OUT.json (rank 0 writes): the bytes it received through ``trainer/dp.exchange_objects_dp`` (the collation by need),
the pickled size of its own share, and what an all-gather of every rank's rollouts (the collation before issue 45)
would have delivered to it; and whether it got exactly its share's rollouts.
"""

import argparse
import json
import pickle
from pathlib import Path

import torch

GLOBAL_BATCH = 48


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    args = p.parse_args()

    import torch.distributed as dist

    from oumi_megatron.config.megatron_params import MegatronParams
    from oumi_megatron.engine.parallel.distributed import init_model_parallel
    from oumi_megatron.engine.parallel.layout import engine_layout
    from oumi_megatron.trainer.dp import dp_size_and_rank, exchange_objects_dp

    init_model_parallel(engine_layout(MegatronParams()))
    dp, me = dp_size_and_rank()
    share = GLOBAL_BATCH // dp
    rollout = lambda i: {"index": i, "completion_ids": list(range(i, i + 1000)), "logprobs": [0.5] * 1000}  # noqa: E731
    generated = [i for i in range(GLOBAL_BATCH) if i % dp == me]
    outgoing: list[list] = [[] for _ in range(dp)]
    for i in generated:
        outgoing[i // share].append(rollout(i))
    incoming, received = exchange_objects_dp(outgoing, torch.device("cpu"))
    got = sorted(r["index"] for part in incoming for r in part)
    gathered: list = [None] * dp
    dist.all_gather_object(gathered, [rollout(i) for i in generated])
    result = {
        "dp": dp, "rank": me, "received_bytes": received,
        "share_bytes": len(pickle.dumps([rollout(i) for i in range(me * share, (me + 1) * share)],
                                        protocol=pickle.HIGHEST_PROTOCOL)),
        "all_gather_bytes": sum(len(pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)) for part in gathered),
        "got_own_share": got == list(range(me * share, (me + 1) * share)),
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
