"""One process of a 2-process CPU dump through jax.distributed (run by test_dump_multihost)."""

import sys

import jax

port, process_id, num_processes, teacher, data, output = sys.argv[1:7]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(num_processes),
                           process_id=int(process_id))

from logit_distill.dump import DumpConfig, run_dump  # noqa: E402

num_steps = int(sys.argv[7]) if len(sys.argv) > 7 else 6
result = run_dump(DumpConfig(teacher=teacher, data=data, output=output, top_k=8, seq_len=32, batch_size=4,
                             num_steps=num_steps, steps_per_file=2, codec="exact", progress=False))
print(f"process {process_id}: complete={result.complete} written={result.chunks_written}", flush=True)
