"""One process of a 2-process CPU dump through jax.distributed (run by the multi-host tests of test_dump).

Arguments: port process_id num_processes teacher data output [num_steps [JSON of more DumpConfig fields]].
A failure ends as the CLI ends it: one line on stderr and its exit code.
"""

import json
import sys

import jax

port, process_id, num_processes, teacher, data, output = sys.argv[1:7]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(num_processes),
                           process_id=int(process_id))

from logit_distill.cli.main import report_failure  # noqa: E402
from logit_distill.dump import DumpConfig, run_dump  # noqa: E402

num_steps = int(sys.argv[7]) if len(sys.argv) > 7 else 6
more = json.loads(sys.argv[8]) if len(sys.argv) > 8 else {}
settings = dict(selection="topk", top_k=8, seq_len=32, batch_size=4, num_steps=num_steps, steps_per_file=2, codec="exact",
                progress=False)
settings.update(more)
try:
    result = run_dump(DumpConfig(teacher=teacher, data=data, output=output, **settings))
except Exception as e:  # noqa: BLE001 - as the CLI: one line, the documented exit code
    sys.exit(report_failure("dump", e, debug=False))
print(f"process {process_id}: complete={result.complete} written={result.chunks_written}", flush=True)
