"""How ranks cooperate: process groups, pipeline schedules (1F1B, interleaved, ZB-H1), context parallelism
and ModuleQueue's streamed weights on the last stage."""
