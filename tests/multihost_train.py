"""One process of a 2-process CPU training run through jax.distributed (run by test_train)."""

import json
import sys

import jax

port, process_id, kwargs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

from logit_distill.train import train_student  # noqa: E402
from logit_distill.train import TrainConfig

result = train_student(TrainConfig(**kwargs))
print(f"process {process_id}: final_step={result.final_step}", flush=True)
